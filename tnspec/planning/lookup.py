"""Stages 4 and 5 for an index input (``x[b] in (v0 v1 v2)``): plan a lookup and lower it.

The network contracts a one-hot input, which is never built. Each index is split into the
digits of its modes (mixed radix, the first mode most significant, as a group is row-major).
The modes are cut into *runs* of consecutive modes. A run's cores (those carrying its modes)
are contracted into one table over the run's modes (a lone core is its own table), and each
lookup's row of it is gathered with ``index_select``, whose backward adds into the table: a
core's gradient never passes through the full table unless the plan builds it. The gathered
rows and the cores without modes are then contracted per lookup, in the order opt_einsum
finds. One run of all the modes is the reconstruct-first path (the table built whole, rows
picked, as ``nn.Embedding`` does: the cheapest when there are more lookups than rows); one run
per core is gather-then-contract. :func:`plan_lookup` prices every cut with the same cost
model as the contraction planner and keeps the cheapest; :func:`lookup_candidates` gives the
others, which autotuning times against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import opt_einsum

from ..errors import SpecError
from ..ir import DEFAULT_MAX_BYTES, Network
from ..program import Bias, Builder, CheckIndex, Param, Program, Unflatten, Unpack, Var, prune
from ..shapes import Size, guard_bytes
from .cost import CostModel

LOOKUP = "@"  # the per-lookup axis in layouts (no index name can be "@")
#: the weight of a per-lookup element against a table element in the plan's cost. Timings of
#: every cut of TT embeddings (10^4-10^6 rows, 4096-16384 lookups, rank 16, 2 CPU threads)
#: put the gathered 4-D cores of the one-run-per-core cut far behind their size; 2, 3 and 5
#: here all pick a two-run cut for large vocabularies and the whole table when lookups
#: outnumber rows. A rough constant: where the layer autotunes, the cuts are timed
PER_LOOKUP = 3


@dataclass(frozen=True)
class Run:
    """Consecutive modes of the index input, the cores contracted into their table, and the
    table's other axes (indices the rest of the network still needs)."""

    modes: tuple[str, ...]
    cores: tuple[str, ...]
    axes: tuple[str, ...]


@dataclass(frozen=True)
class LookupPlan:
    network: Network  # with every size bound (the lookup count as the batch)
    runs: tuple[Run, ...]
    static: tuple[str, ...]  # cores without modes, used as they are
    path: tuple[tuple[int, ...], ...]  # opt_einsum's pairwise order over runs, then static
    flops: int  # building the tables and contracting per lookup, forward
    elements: int  # tables built, plus PER_LOOKUP x (gathered rows, per-lookup intermediates)
    dense_macs: int  # the same lookups from a dense table: one row copy each
    planner: str = "lookup"

    @property
    def steps(self) -> tuple:
        """No contraction steps of the conv planner (a lookup is planned here)."""
        return ()

    def report(self) -> str:
        """The chosen cut, what each run gathers, and the cost."""
        net = self.network
        sizes = net.sizes
        lookups = math.prod(sizes[i] for axis in net.input.axes[:-1] for i in axis)
        rows = [f"plan (lookup) for {net.spec}",
                f"  for {lookups:,} lookups into {net.vocabulary:,} rows; "
                f"{self.flops:,} FLOPs, {self.elements:,} elements moved (per-lookup ones "
                f"counted {PER_LOOKUP}x)"]
        for run in self.runs:
            table = math.prod(sizes[i] for i in (*run.modes, *run.axes))
            built = "built from " + " * ".join(run.cores) if len(run.cores) > 1 else run.cores[0]
            rows.append(f"  gather ({' '.join(run.modes)}) from {built} "
                        f"[{table:,} elements], {math.prod(sizes[i] for i in run.axes):,} a row")
        if self.static:
            rows.append(f"  with {', '.join(self.static)} as they are")
        return "\n".join(rows)


def plan_lookup(net: Network, model: CostModel | None = None, *,
                max_bytes: int = DEFAULT_MAX_BYTES, itemsize: int = 4) -> LookupPlan:
    """The cheapest cut of ``net``'s modes into runs, at its bound lookup count; tables and
    per-lookup tensors larger than ``max_bytes`` are refused."""
    return lookup_candidates(net, model, max_bytes=max_bytes, itemsize=itemsize)[0]


def lookup_candidates(net: Network, model: CostModel | None = None, *,
                      max_bytes: int = DEFAULT_MAX_BYTES, itemsize: int = 4
                      ) -> list[LookupPlan]:
    """Every cut of ``net``'s modes whose tables fit in ``max_bytes``, the cheapest by
    ``model`` first (the others are what autotuning times against it)."""
    model = model or CostModel()
    priced = []
    for cut in _cuts(len(net.input.axes[-1])):
        candidate = _price(net, cut)
        if candidate is not None:
            priced.append((model.einsum(candidate.flops // 2, candidate.elements), candidate))
    if not priced:
        raise SpecError(f"no core order can look up {net.spec}: a core carries modes that are "
                        "not consecutive in the index input",
                        hint="write the modes after 'in' in the order the cores carry them")
    priced.sort(key=lambda pair: pair[0])
    sizes = net.sizes
    kept: list[LookupPlan] = []
    for k, (_, candidate) in enumerate(priced):
        try:
            guard_bytes(net, [(f"table ({' '.join(r.modes)})", math.prod(
                sizes[i] for i in (*r.modes, *r.axes))) for r in candidate.runs
                if len(r.cores) > 1], max_bytes, itemsize)
        except SpecError:
            if k == 0:
                raise  # the cheapest cut's error: the layer's own for this size
            continue
        kept.append(candidate)
    return kept


#: up to this many cuts (9 modes) every one is priced; past it, those of at most three runs and
#: one run per mode: where the best cuts lie (two runs for a large vocabulary, one when the
#: lookups outnumber the rows), and n^2 / 2 of them rather than 2^(n-1) (14 modes: 92, not
#: 8,192, each priced through opt_einsum)
ALL_CUTS = 256


def _cuts(n: int) -> list[tuple[int, ...]]:
    """The ways to cut n modes into runs that are priced, as the runs' lengths."""
    if n <= 1 or 2 ** (n - 1) <= ALL_CUTS:
        return _every_cut(n)
    few = [(n,)] + [(a, n - a) for a in range(1, n)] + \
        [(a, b, n - a - b) for a in range(1, n - 1) for b in range(1, n - a)]
    return few + [(1,) * n]


def _every_cut(n: int) -> list[tuple[int, ...]]:
    """Every way to cut n modes into runs, as the runs' lengths."""
    if n == 0:
        return [()]
    return [(k, *rest) for k in range(1, n + 1) for rest in _every_cut(n - k)]


def _price(net: Network, cut: tuple[int, ...]) -> LookupPlan | None:
    """The plan of one cut (None where a core carries modes of two runs)."""
    modes = net.input.axes[-1]
    sizes = net.sizes
    starts = [sum(cut[:k]) for k in range(len(cut))]
    groups = [modes[s:s + n] for s, n in zip(starts, cut)]
    owner: dict[str, int] = {}
    for k, group in enumerate(groups):
        for core in net.cores:
            if set(core.indices) & set(group):
                if owner.setdefault(core.name, k) != k:
                    return None
    if len(groups) == 1:  # the whole table: every core joins it (reconstruct-first)
        owner = {c.name: 0 for c in net.cores}
    cores = {c.name: c for c in net.cores}
    static = tuple(c.name for c in net.cores if c.name not in owner)
    out = net.embedded
    runs, flops, elements = [], 0, 0
    for k, group in enumerate(groups):
        mine = [c for c in net.cores if owner.get(c.name) == k]
        elsewhere = set(out) | {i for c in net.cores if owner.get(c.name) != k
                                for i in c.indices}
        axes = tuple(dict.fromkeys(i for c in mine for i in c.indices
                                   if i not in group and i in elsewhere))
        runs.append(Run(tuple(group), tuple(c.name for c in mine), axes))
        if len(mine) > 1 or tuple(i for i in mine[0].indices if i in group) != tuple(group):
            terms = [c.indices for c in mine]
            info = _path(terms, (*group, *axes), sizes)
            flops += info[1]
            elements += math.prod(sizes[i] for i in (*group, *axes))
    lookups = math.prod(sizes[i] for axis in net.input.axes[:-1] for i in axis)
    terms = [(LOOKUP, *r.axes) for r in runs] + [cores[n].indices for n in static]
    sizes = {**sizes, LOOKUP: lookups}
    path, cost, largest = _path(terms, (LOOKUP, *out), sizes)
    # per-lookup tensors cost far more than their size: gathered, added back into the cores
    # in the backward (index_add), and fed to batched products of small matrices
    elements += PER_LOOKUP * (sum(lookups * math.prod(sizes[i] for i in r.axes)
                                  for r in runs) + largest)
    return LookupPlan(net, tuple(runs), static, path, flops + cost, elements,
                      lookups * math.prod(sizes[i] for i in out))


def _path(terms: Sequence[Sequence[str]], out: Sequence[str], sizes: dict[str, int]
          ) -> tuple[tuple[tuple[int, ...], ...], int, int]:
    """opt_einsum's pairwise order for ``terms -> out``, its FLOPs and its largest
    intermediate (elements)."""
    if len(terms) == 1:
        return (), 0, 0
    names = list(dict.fromkeys([*out, *(i for t in terms for i in t)]))
    sym = {n: opt_einsum.get_symbol(k) for k, n in enumerate(names)}
    eq = ",".join("".join(sym[i] for i in t) for t in terms) + "->" + \
        "".join(sym[i] for i in out)
    shapes = [tuple(sizes[i] for i in t) for t in terms]
    path, info = opt_einsum.contract_path(eq, *shapes, shapes=True,
                                          optimize="optimal" if len(terms) <= 5 else "auto")
    return tuple(map(tuple, path)), int(info.opt_cost), int(info.largest_intermediate)


# ---- lowering -----------------------------------------------------------------------------

def lower_lookup(plan: LookupPlan) -> Program:
    """The nodes that run ``plan`` for index tensors of any shape (see :class:`CheckIndex`)."""
    return _Lowering(plan).program()


class _Lowering(Builder):
    def __init__(self, plan: LookupPlan) -> None:
        super().__init__(plan.network)
        self.plan = plan

    def program(self) -> Program:
        net, plan = self.net, self.plan
        x = self.name("tensor:" + net.input.name, net.input.name)
        written = len(net.input.axes) - 1
        modes = net.input.axes[-1]
        self.nodes.append(CheckIndex(x, net.input.name, self.vocabulary(),
                                     None if written == 1 else written, self.product(modes)))
        n = self.name("size:lookups", "n")
        ids = self.call("ids", ".reshape", Var(x), -1, layout=(LOOKUP,), dims=[Size.of(n)],
                        comment="one lookup per index, whatever the input's shape")
        self.nodes.append(Unpack(ids.name, (n,)))
        operands: list[Var | Param] = []
        for run in plan.runs:
            digit = self.digit(ids, modes, run.modes)
            table = self.table(run)
            layout, dims = list(self.layout[table]), list(self.dims[table])
            layout[0], dims[0] = LOOKUP, Size.of(n)
            operands.append(self.call(
                f"{'_'.join(run.cores)}_rows", ".index_select", table, 0, digit,
                layout=tuple(layout), dims=dims,
                comment=f"each lookup's slice of ({' '.join(run.modes)})"))
        for name in plan.static:
            operands.append(self.core(name))
        out = list(net.embedded)
        result = self.contract(operands, [LOOKUP, *out], plan.path)
        shape = [Size.of(n)] + [self.product(axis) for axis in net.output.axes[written:]]
        result = self.arrange(result, [LOOKUP, *out], shape)
        y = self.name("tensor:" + net.output.name, net.output.name)
        last = result.name
        pad = net.options.padding_idx
        if pad is not None:
            mask = self.call("padding", ".eq", ids, pad, layout=(LOOKUP,), dims=[Size.of(n)])
            mask = self.call("padding", ".unsqueeze", mask, 1, layout=(LOOKUP, "1"),
                             dims=[Size.of(n), Size.of(1)])
            last = self.call(y, ".masked_fill", result, mask, 0.0, layout=(), dims=[],
                             comment=f"index {pad} (padding_idx) reads a zero row").name
        if net.options.bias:
            self.nodes.append(Bias(y, last, tuple(shape[1:]), "the bias, one per output"))
            last = y
        self.nodes.append(Unflatten(y, last, x, tuple(shape[1:])))
        nodes, _ = prune(self.nodes, y)
        return Program(net, x, tuple(self.static.items()), tuple(nodes), y)

    def vocabulary(self) -> Size:
        given = self.net.options.num_embeddings
        return Size.of(given) if given is not None else self.product(self.net.input.axes[-1])

    def core(self, name: str) -> Param:
        core = next(c for c in self.net.cores if c.name == name)
        holder = Param(name)
        self.layout[holder] = core.indices
        self.dims[holder] = tuple(self.size(i) for i in core.indices)
        return holder

    def digit(self, ids: Var, modes: tuple[str, ...], run: tuple[str, ...]) -> Var:
        """The run's digits of each index, as one number: ``ids // (later sizes) % (its
        sizes)``."""
        at = modes.index(run[0])
        later = modes[at + len(run):]
        dims = self.dims[ids]
        digit = ids
        if later:
            digit = self.call("digit", "torch.div", digit, self.product(later), layout=(LOOKUP,),
                              dims=dims, rounding_mode="floor")
        if at:
            digit = self.call("digit", "torch.remainder", digit, self.product(run),
                              layout=(LOOKUP,), dims=dims)
        return digit

    def table(self, run: Run) -> Var | Param:
        """The run's table, its rows along the first axis (a lone core with one mode: a view
        with that axis first, so that the gathered rows come out with the lookups first, as
        the batched products after them want)."""
        parts = [self.core(name) for name in run.cores]
        if len(parts) == 1 and len(run.modes) == 1:
            layout = self.layout[parts[0]]
            rest = [i for i in layout if i != run.modes[0]]
            return self.arrange(parts[0], [run.modes[0], *rest],
                                [self.dim(parts[0], i) for i in [run.modes[0], *rest]])
        table = parts[0] if len(parts) == 1 else self.contract(parts, [*run.modes, *run.axes])
        return self.merged(table, [list(run.modes), *[[a] for a in run.axes]])

    def contract(self, operands: list[Var | Param], out: list[str],
                 path: tuple[tuple[int, ...], ...] | None = None) -> Var | Param:
        """``operands`` contracted pairwise into the indices ``out``, in ``path`` (default:
        opt_einsum's order for these operands, which carry no lookup axis)."""
        if path is None:
            path = _path([self.layout[o] for o in operands], out, self.net.sizes)[0]
        live = list(operands)
        for pair in path:
            picked = [live[k] for k in sorted(pair)]
            for k in sorted(pair, reverse=True):
                live.pop(k)
            rest = {i for o in live for i in self.layout[o]} | set(out)
            seen = list(dict.fromkeys(i for o in picked for i in self.layout[o]))
            keep = [i for i in seen if i in rest]
            if not live:  # the last product: written in the result's order, not permuted after
                keep = [i for i in out if i in keep] + [i for i in keep if i not in out]
            live.append(self.einsum(picked[0], picked[1], keep))
        return live[0]

    def einsum(self, a: Var | Param, b: Var | Param, keep: list[str]) -> Var:
        names = list(dict.fromkeys([*self.layout[a], *self.layout[b]]))
        sym = {n: opt_einsum.get_symbol(k) for k, n in enumerate(names)}
        eq = "".join(sym[i] for i in self.layout[a]) + "," + \
            "".join(sym[i] for i in self.layout[b]) + "->" + "".join(sym[i] for i in keep)
        dims = {i: d for h in (a, b) for i, d in zip(self.layout[h], self.dims[h])}
        return self.call(f"{a.name}_{b.name}", "torch.einsum", eq, a, b, layout=tuple(keep),
                         dims=[dims[i] for i in keep],
                         comment=" * ".join(self._axes(h) for h in (a, b)))

    def _axes(self, holder: Var | Param) -> str:
        axes = ("lookup" if i == LOOKUP else i for i in self.layout[holder])
        return f"{holder.name}[{', '.join(axes)}]"
