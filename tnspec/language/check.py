"""Check: AST -> ir.Network, reporting every semantic error at once.

:func:`check` picks one layer of a parsed document, binds its sizes and options (``settings``),
validates the network and builds the IR.
All problems found are raised together as one :class:`SpecError` whose ``errors`` lists each.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import replace
from typing import Any, Mapping

from ..errors import Span, SpecError
from ..ir import (DEFAULT_MAX_ELEMENTS, MAX_CONV_DIMS, Conv, Index, Network, Options, Role,
                  assign_roles, clashes, unit_name)
from . import conv_edges
from .nodes import Document, IndexNode, LayerNode, NetworkNode, OperandNode, SizeExpr
from .settings import SizeBinder, read_options


#: cores in one network: the planner and the init analysis are polynomial in this
MAX_CORES = 256


def check(doc: Document, *, layer: str | None = None, sizes: Mapping[str, Any] | None = None,
          max_elements: int = DEFAULT_MAX_ELEMENTS) -> Network:
    """Check one layer of ``doc`` with keyword ``sizes`` and build its :class:`Network`."""
    node = select_layer(doc, layer)
    checker = _Checker(doc, node, max_elements)
    net = checker.run(dict(sizes or {}))
    if checker.errors:
        first = checker.errors[0]
        raise SpecError(first.message, span=first.span, source=first.source, hint=first.hint,
                        errors=checker.errors)
    assert net is not None
    return net


def _alike(a: str, b: str) -> bool:
    """Whether two index names look like one typed twice: one letter changed (of two or
    more), added or dropped (``r1``/``rl``, ``o``/``oo``), or, for longer names, close as
    ``difflib`` measures it."""
    if a == b:
        return False
    if len(a) == len(b):  # one letter of two or more changed (never 'r' for 's')
        return len(a) > 1 and sum(x != y for x, y in zip(a, b)) == 1
    short, long = sorted((a, b), key=len)
    if len(long) - len(short) == 1:
        return any(long[:k] + long[k + 1:] == short for k in range(len(long)))
    return difflib.SequenceMatcher(None, a, b).ratio() >= 0.8


def select_layer(doc: Document, name: str | None) -> LayerNode:
    """The layer of ``doc`` called ``name`` (None: the only one)."""
    if name is None:
        if len(doc.layers) == 1:
            return doc.layers[0]
        names = [str(lay.name) for lay in doc.layers]
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        raise SpecError(f"the file has {len(names)} layers ({shown}); say which one",
                        hint="pass name=... (or --layer NAME)")
    found = doc.by_name.get(name)
    if found is not None:
        return found
    if not doc.is_file:
        raise SpecError(f"name={name!r} picks a layer of a .tn file, but this spec is a "
                        "single expression", hint="leave name out for an expression")
    names = [str(lay.name) for lay in doc.layers]
    close = difflib.get_close_matches(name, names, n=1)
    shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
    raise SpecError(f"no layer named {name!r}; the file has {shown}",
                    hint=f"did you mean {close[0]!r}?" if close else None)


class _Checker:
    def __init__(self, doc: Document, layer: LayerNode, max_elements: int) -> None:
        self.doc, self.layer, self.max_elements = doc, layer, max_elements
        self.errors: list[SpecError] = []
        self.bad_sizes: set[str] = set()

    def error(self, message: str, span: Span | None, hint: str | None = None) -> None:
        self.errors.append(SpecError(message, span=span, source=self.doc.source, hint=hint))

    # ---- driver -----------------------------------------------------------------------------

    def run(self, overrides: dict[str, Any]) -> Network | None:
        lay = self.layer
        if len(lay.networks) != 1:
            self.error(f"layer {lay.name!r} has {len(lay.networks)} networks; it needs exactly "
                       "one",
                       lay.networks[1].span if len(lay.networks) > 1 else lay.name_span,
                       "write one 'x[...], ... -> y[...]' per layer")
            return None
        options = read_options(lay, self.error)
        for size in (*lay.params, *lay.derived):
            self.not_dunder("size", size.name, size.span)
        net = lay.networks[0]
        written = {n for o in (*net.operands, net.output) for i in o.indices for n in i.names}
        binder = SizeBinder(lay, self.error)
        env = binder.bind(overrides, written)
        self.bad_sizes = binder.bad
        network = self.network(net, env, options)
        if network is None:
            return None
        derived = tuple((d.name, _formula(d.expr)) for d in lay.derived)
        names = [p.name for p in lay.params] if lay.params or self.doc.is_file else \
            [n for n in env if n in network.sizes]
        return replace(network, params=tuple((n, env[n]) for n in names if n in env),
                       derived=derived)

    # ---- sizes ------------------------------------------------------------------------------

    def network(self, net: NetworkNode, env: dict[str, int], options: Options) -> Network | None:
        for node in (net.operands[0], net.output):
            for ix in node.indices:
                if ix.kind == "unit":
                    self.error(f"unit axis {ix.text} in {node.name!r}: only cores hold unit axes",
                               ix.span, "reshape the data instead, or name the axis")
        for node in net.operands[1:]:
            for ix in node.indices:
                if ix.kind == "unit" and int(ix.text) != 1:
                    self.error(f"axis {ix.text} of core {node.name!r}: the one number an axis "
                               "can be is 1 (a unit axis)", ix.span,
                               f"name the axis and give its size, e.g. {node.name}[..., k] "
                               f"with k={ix.text}")
        net = replace(net, operands=(net.operands[0], *map(_units_named, net.operands[1:])))
        data, *cores = net.operands
        result = net.output
        if not cores:
            self.error("the network has no core", data.span,
                       "add a learnable operand after the input, e.g. 'W[i, o]'")
        if len(cores) > MAX_CORES:
            self.error(f"the network has {len(cores)} cores, more than the limit of {MAX_CORES}",
                       cores[MAX_CORES].span, "split it into several layers")
            return None
        self.operand_names(net)
        for node in net.operands[1:]:
            for ix in node.indices:
                if ix.kind == "group":
                    self.error(f"group {ix.text} in core {node.name!r}: cores take single indices",
                               ix.span, "write 1 for an axis of length 1" if not ix.names else
                               "write the indices separately, e.g. W[i0, i1, o]")
        for node in (*cores, result):
            for ix in node.indices:
                if ix.kind == "affine":
                    self.error(f"affine index '{ix.text}' outside the input operand", ix.span,
                               "affine terms describe input positions; write them in the first "
                               "operand only")
        for node in (data, result):
            for ix in node.indices:
                if ix.kind == "group" and len(ix.names) < 2:
                    self.error(f"group {ix.text} needs at least two names", ix.span,
                               f"write {ix.names[0]} without parentheses" if ix.names else
                               "remove the empty parentheses")
        core_names = {n for c in cores for i in c.indices for n in i.names}
        out_names = [n for i in result.indices for n in i.names]
        convs = [c for c in (conv_edges.relation(ix, core_names, set(out_names), self.error)
                             for ix in data.indices if ix.kind == "affine") if c]
        conv_edges.unique_relations(convs, data, self.error)
        data_t, result_t = conv_edges.tensor(data, convs), conv_edges.tensor(result, convs)
        core_tensors = tuple(conv_edges.tensor(c, convs) for c in cores)
        roles = assign_roles(data_t, core_tensors, result_t, [c for c, _ in convs])
        self.roles_valid(net, roles, convs)
        self.output_groups(result, core_names)
        kernels = {str(c.kernel) for c, _ in convs}
        for node in cores:
            own = [ix for ix in node.indices if ix.names and ix.names[0] in kernels]
            if len(own) > MAX_CONV_DIMS:
                self.error(f"core {node.name!r} carries {len(own)} kernel indices; torch "
                           f"convolves at most {MAX_CONV_DIMS} axes at once",
                           own[MAX_CONV_DIMS].span,
                           "split the kernel over several cores, e.g. one per axis (CP)")
        self.core_names = core_names
        indices = tuple(self.index(name, role, env, net) for name, role in roles.items())
        self.groups_sized(net, env)
        if net.lookup is not None:
            self.lookup(net, roles, env, options)
            given = {o.key for o in self.layer.options}  # an embedding: linear, no bias
            options = replace(options, activation="linear" if "activation" not in given
                              else options.activation, bias="bias" in given and options.bias)
        elif options.padding_idx is not None or options.num_embeddings is not None:
            self.error("padding_idx and num_embeddings need an index input", data.span,
                       f"write the input as {data.name}[...] in (v0 v1 ...), or drop them")
        network = Network(data_t, core_tensors, result_t, indices,
                          tuple(c for c, _ in convs), self.layer.name, options,
                          lookup=net.lookup is not None)
        if not self.errors:
            for core, node in zip(core_tensors, cores):
                n = network.core_numel(core)
                if n > self.max_elements:
                    dims = " x ".join(str(env.get(i, "?")) for i in core.indices)
                    self.error(f"core {core.name!r} would have {n:,} elements ({dims}), more than "
                               f"the limit of {self.max_elements:,}", node.span,
                               "lower its sizes, or raise max_elements")
            bias = math.prod(env.get(i, 1) for axis in result_t.axes for i in axis
                             if i in core_names)
            if options.bias and bias > self.max_elements:
                self.error(f"the bias over the output's core indices would have {bias:,} "
                           f"elements, more than the limit of {self.max_elements:,}",
                           result.span, "lower the output sizes, or set bias: false")
        return network

    def lookup(self, net: NetworkNode, roles: dict[str, Role], env: dict[str, int],
               opts: Options) -> None:
        """An index input: its axes are lookup positions, which the output repeats first; its
        modes are sized and carried by cores only; the vocabulary options fit them."""
        data, ix, out = net.operands[0], net.lookup, net.output
        assert ix is not None
        axes = data.indices[:-1]
        for axis in axes:
            if axis.kind != "name" or roles.get(axis.names[0]) is not Role.BATCH:
                self.error(f"axis {axis.text} of the index input {data.name!r} is not a lookup "
                           "position", axis.span, "an index input's axes are carried by the "
                           "output only; the modes after 'in' are what the cores read")
        if [a.names for a in out.indices[:len(axes)]] != [a.names for a in axes]:
            self.error(f"the output {out.name!r} must start with the axes of the index input",
                       out.span, f"write {out.name}[{', '.join(a.text for a in axes)}, ...]")
        for n in ix.names:
            if roles.get(n) is not Role.INPUT_MODE:
                self.error(f"index mode {n!r} must be carried by a core and not by the output",
                           ix.span, f"add {n!r} to a core, e.g. G[{n}, d, r]")
            elif n not in env:
                self.error(f"index mode {n!r} has no size", ix.span,
                           f"give {n}=<size>: the data's integers cannot tell it")
        modes = math.prod(env.get(n, 1) for n in ix.names)
        for key, limit in (("num_embeddings", modes), ("padding_idx",
                                                       (opts.num_embeddings or modes) - 1)):
            value = getattr(opts, key)
            if value is not None and value > limit:
                self.error(f"{key}={value} is out of range for modes of {modes:,} indices",
                           ix.span, f"{key} is at most {limit:,}")

    def operand_names(self, net: NetworkNode) -> None:
        seen: dict[str, OperandNode] = {}
        data = net.operands[0]
        for i, node in enumerate((*net.operands, net.output)):
            is_core = 0 < i <= len(net.operands) - 1
            if node.name in seen:
                first = seen[node.name]
                what = ("the input" if first is data else "the output" if first is net.output
                        else "another core")
                self.error(f"operand name {node.name!r} is used twice"
                           + (f" (a core named like {what})" if is_core else ""),
                           node.name_span, "give every operand its own name")
            seen[node.name] = node
            if is_core and clashes(node.name):
                self.error(f"core name {node.name!r} clashes with an attribute of the generated "
                           "module", node.name_span, f"rename it, e.g. {node.name.strip('_')}_w")
            seen_ix: set[str] = set()
            for ix in node.indices:
                for n in ix.names:
                    self.not_dunder("index", n, ix.span)
                for n in (ix.names if ix.kind != "affine" else ()):
                    if n in seen_ix:
                        self.error(f"index {n!r} appears twice in {node.name!r}", ix.span,
                                   "an operand carries each index once (no diagonals)")
                    seen_ix.add(n)

    def not_dunder(self, what: str, name: str, span: Span) -> None:
        if name.startswith("__"):
            self.error(f"{what} {name!r}: names starting with '__' are reserved", span,
                       f"rename it, e.g. {name.strip('_') or 'n'}; Python would mangle it "
                       "inside the generated class")

    def output_groups(self, result: OperandNode, core_names: set[str]) -> None:
        """An output group is made of core indices only, or of none: the bias and the
        reshapes that build the output group by where an index comes from."""
        for ix in result.indices:
            on_core = [n for n in ix.names if n in core_names]
            other = [n for n in ix.names if n not in core_names]
            if ix.kind == "group" and on_core and other:
                self.error(f"output group {ix.text} mixes {on_core[0]!r}, carried by a core, "
                           f"with {other[0]!r}, which comes from the input", ix.span,
                           "write them as separate output axes, e.g. "
                           f"y[..., {on_core[0]}, {other[0]}], and reshape the result")

    def roles_valid(self, net: NetworkNode, roles: dict[str, Role],
                    convs: list[tuple[Conv, IndexNode]]) -> None:
        data, *cores = net.operands
        kernels = {c.kernel for c, _ in convs}
        targets = {c.target for c, _ in convs}
        first: dict[str, Span] = {}
        for node in (*net.operands, net.output):
            for ix in node.indices:
                if ix.kind != "affine":
                    for n in ix.names:
                        first.setdefault(n, ix.span)
        data_names = {n for ix in data.indices if ix.kind != "affine" for n in ix.names}
        core_names = {n for c in cores for ix in c.indices for n in ix.names}
        # names inside affine indices: any problem with them was reported at the affine index
        affine = {n for node in (*net.operands, net.output) for ix in node.indices
                  if ix.kind == "affine" for n in ix.names}
        for ix in net.output.indices:
            for n in ix.names:
                if n in affine:
                    continue
                if n not in data_names and n not in core_names and n not in targets:
                    self.error(f"output index {n!r} is provided by no operand", ix.span,
                               f"add {n!r} to a core or to the input, or remove it from the "
                               "output")
        dangling: dict[str, tuple[str, IndexNode]] = {}  # index -> (its core, where)
        for c in cores:
            for ix in c.indices:
                for n in ix.names:
                    if n in targets:
                        self.error(f"spatial output index {n!r} cannot be carried by core "
                                   f"{c.name!r}", ix.span, "weights shared across positions "
                                   "carry the kernel index, not the position")
                    elif n not in roles and n not in kernels and n not in affine:
                        dangling.setdefault(n, (c.name, ix))
        self.dangling(dangling, set(first) - set(dangling))
        for n in data_names:
            if n not in roles:
                self.error(f"input index {n!r} is used by no core and not in the output; it "
                           "would be summed away silently", first[n],
                           f"add {n!r} to the output (batch-like) or to a core")

    def dangling(self, found: dict[str, tuple[str, IndexNode]], others: set[str]) -> None:
        """Core indices carried by one core only: summed away where they stand. Two such
        indices that look alike (``r1`` and ``rl``) are one typo, reported once, at the
        later one."""
        typos: dict[str, str] = {}  # the later index -> the earlier one it looks like
        names = list(found)
        for k, n in enumerate(names):
            close = [m for m in names[:k] if m not in typos and _alike(n, m)
                     and found[m][0] != found[n][0]]
            if close:
                typos[n] = close[0]
        for n, (core, ix) in found.items():
            if n in typos.values():
                continue
            if n in typos:
                m, (other, _) = typos[n], found[typos[n]]
                self.error(f"core index {n!r} of {core!r} and {m!r} of {other!r} each appear "
                           "once; both would be summed away silently: a typo?", ix.span,
                           f"did you mean {m!r}? One name joins {other!r} and {core!r}")
                continue
            close = [m for m in sorted(others) if _alike(n, m)]
            self.error(f"core index {n!r} appears in no other operand and not in the output; "
                       "it would be summed away silently", ix.span,
                       (f"did you mean {close[0]!r}? If not, c" if close else "c") +
                       f"onnect {n!r} to another core, or add it to the output")

    def index(self, name: str, role: Role, env: dict[str, int], net: NetworkNode) -> Index:
        if role is Role.UNIT:
            return Index(name, 1, role)
        size = env.get(name)
        on_core = name in self.core_names
        spatial = role in (Role.SPATIAL_IN, Role.SPATIAL_OUT)
        if size is None and on_core and not spatial and name not in self.bad_sizes:
            span = next(ix.span for c in net.operands[1:] for ix in c.indices if name in ix.names)
            hint = (f"add {name}=<size> to the layer's parameters" if self.doc.is_file
                    else f"pass {name}=<size> to tnspec.layer")
            self.error(f"core index {name!r} has no size", span, hint)
        if spatial and size is not None and role is Role.SPATIAL_OUT:
            self.error(f"size {name}={size} is given for a spatial index; it would be ignored",
                       self.first_span(net, name), "spatial sizes come from the input's shape; "
                       "remove the size (tnspec compile plans for --shape)")
        return Index(name, None if spatial else size, role)  # spatial sizes come from the data

    def first_span(self, net: NetworkNode, name: str) -> Span | None:
        return next((ix.span for op in (*net.operands, net.output) for ix in op.indices
                     if name in ix.names), None)

    def groups_sized(self, net: NetworkNode, env: dict[str, int]) -> None:
        for node in (net.operands[0], net.output):
            for ix in node.indices:
                if ix.kind == "group":
                    unsized = [n for n in ix.names if n not in env]
                    if len(unsized) > 1:
                        self.error(f"group {ix.text} has {len(unsized)} members without a size "
                                   f"({', '.join(unsized)})", ix.span,
                                   "give all but one of them a size; the last is inferred")


def _units_named(node: OperandNode) -> OperandNode:
    """A core with each unit axis (``1``) named as the IR names it (:func:`unit_name`)."""
    if not any(ix.kind == "unit" for ix in node.indices):
        return node
    return replace(node, indices=tuple(
        replace(ix, kind="name", names=(unit_name(node.name, k),)) if ix.kind == "unit" else ix
        for k, ix in enumerate(node.indices)))


def _formula(e: SizeExpr) -> tuple:
    """A size expression as plain nested tuples (see ir.Formula)."""
    if e.op in ("int", "name"):
        return (e.op, e.value)
    return (e.op, e.value, tuple(_formula(a) for a in e.args))
