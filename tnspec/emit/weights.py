"""What a generated ``forward`` builds of the cores alone: the split (``codegen`` prints those
calls as the class's ``_weights`` method) and ``_reused``, the module-level function through
which ``forward`` reads them, printed once into a module that has any.

The weights are the same at every call until a core changes, so a frozen layer can build them
once (``keep_built``), and an adapter less a frozen copy of itself can contract the data once,
with the difference of the two weights, where one weight meets the data.
"""

from __future__ import annotations

from typing import Any

from ..program import (Bias, Call, CheckShape, Let, Node, Param, Program, Require, Unpack, Var,
                       reads)

#: printed once into a module whose forwards build weights from cores. A layer with
#: ``keep_built`` set (a frozen copy of an adapter) builds them once while no core needs a
#: gradient. A change is seen through the cores' version counters (every in-place op, an
#: optimizer's step, ``load_state_dict``) and their storage (a replaced core, ``.to``); a write
#: through ``.data`` bumps no counter, hence off by default. ``_minus`` (a frozen layer of the
#: same code, set for one call by ``tnspec``'s adapters) asks for ``layer(x) - _minus(x)``:
#: where the data meets the cores through one weight (``alone``), that is one contraction
#: with the difference of the two weights; where it meets them through a chain of two
#: (``chain``), one chain at twice the bond between them; ``_minus`` is taken out to say it
#: was done, and left where it was not.
REUSED = '''def _reused(layer: nn.Module, build, alone: bool = False,
            chain: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
    """build(layer): the weights forward builds from the cores alone, built once and reused
    where the layer asks (keep_built) while no core needs a gradient and none changed.
    alone: forward reads the cores through the one weight build returns, and nothing else;
    then a layer given _minus for one call (a frozen copy of it, by tnspec's adapters) gets
    the difference of the two weights: forward computes layer(x) - _minus(x) in one go.
    chain: forward applies the two weights build returns one after the other (a linear or
    conv of the data by the first, of its result by the second); then _minus gets them at
    twice the bond between: the first two stacked along their outputs (axis chain[0]), the
    second two along their inputs (axis chain[1]), the copy's negated, which computes
    layer(x) - _minus(x) in one go."""
    if torch.compiler.is_compiling():
        return build(layer)
    if (alone or chain) and layer.bias is None and "_minus" in layer.__dict__:
        mine, theirs = build(layer), _reused(layer.__dict__.pop("_minus"), build)
        if alone:
            return (mine[0] - theirs[0],)
        return (torch.cat((mine[0], theirs[0]), chain[0]),
                torch.cat((mine[1], theirs[1].neg()), chain[1]))
    if not getattr(layer, "keep_built", False) or hasattr(layer, "parametrizations"):
        return build(layer)
    cores = tuple(layer.parameters())
    if torch.is_grad_enabled() and any(c.requires_grad for c in cores):
        return build(layer)
    key = (build, torch.is_inference_mode_enabled(),
           *((c._version, c.data_ptr(), c.dtype, c.device) for c in cores))
    kept = layer.__dict__.get("_kept")
    if kept is None or kept[0] != key:
        with torch.no_grad():
            # the cores detached, held with the weights: their storage stays theirs
            kept = layer.__dict__["_kept"] = (key, [c.detach() for c in cores], build(layer))
    return kept[2]'''


def built_from_cores(program: Program) -> tuple[list[Call], tuple[str, ...]]:
    """The calls of ``program`` that read only cores and the layer's sizes (not the data, nor a
    size read off it), in order, and the variables among their results that the rest reads:
    what ``forward`` builds from the cores alone, the same at every call until a core changes.
    """
    known = {v for v, _ in program.sizes}
    built: list[Call] = []
    names: set[str] = set()
    for node in program.nodes:
        if isinstance(node, Call) and reads(node) <= known | names:
            built.append(node)
            names.add(node.out)
    read = set().union(*(reads(n) for n in program.nodes if n not in built), {program.result})
    return built, tuple(n.out for n in built if n.out in read)


def reads_cores(node: Node) -> bool:
    """Whether a node reads a core itself (``self.<name>``; the bias is no core)."""
    def visit(arg: Any) -> bool:
        return isinstance(arg, Param) and arg.name != "bias" or \
            isinstance(arg, (tuple, list)) and any(map(visit, arg))
    return isinstance(node, Call) and (visit(node.args) or visit([v for _, v in node.kwargs]))


#: ops whose weight, their second argument, holds its outputs first and its inputs second
_CHAINED = {"F.linear", "F.conv1d", "F.conv2d", "F.conv3d"}
#: ops that take their weight the other way round: inputs first (a linear step whose weight
#: arrives in that layout, see ``lower``)
_TRANSPOSED = {"torch.matmul"}


def chain(program: Program,
          split: tuple[list[Call], tuple[str, ...]] | None = None) -> tuple[int, int] | None:
    """Whether the data meets the cores through two weights built of them, and nothing else:
    a linear or ungrouped conv of the data by the first, whose result the same by the second
    alone reads (the bond between them its channels). The output is then the two weights'
    chain, and the difference of two such layers one chain at twice the bond (see
    ``_reused``). Where it does, the axis of the first weight that holds the bond (its
    outputs) and that of the second (its inputs); else None. ``split``: what
    :func:`built_from_cores` gives, where it is at hand."""
    built, kept = split or built_from_cores(program)
    rest = [n for n in program.nodes if n not in built]
    if len(kept) != 2 or any(reads_cores(n) for n in rest):
        return None
    uses = [n for n in rest if reads(n) & set(kept)]
    if len(uses) != 2 or not all(_plain(n, first=k == 0) for k, n in enumerate(uses)):
        return None
    first, second = uses
    if first.args[1] == Var(kept[0]) and \
            second.args[:2] == (Var(first.out), Var(kept[1])) and \
            [n for n in rest if first.out in reads(n)] == [second]:
        return int(first.fn in _TRANSPOSED), int(second.fn not in _TRANSPOSED)
    return None


def _plain(node: Node, first: bool) -> bool:
    """An ungrouped linear or conv, without a bias if it is the first of a chain."""
    kwargs = dict(node.kwargs) if isinstance(node, Call) else {}
    return isinstance(node, Call) and node.fn in _CHAINED | _TRANSPOSED and \
        len(node.args) > 1 and \
        "groups" not in kwargs and not (first and "bias" in kwargs)


def alone(program: Program, split: tuple[list[Call], tuple[str, ...]] | None = None) -> bool:
    """Whether the data meets the cores through one weight built of them, and nothing else:
    the output is then linear in that weight (the bias aside). ``split``: what
    :func:`built_from_cores` gives for ``program``, where it is at hand."""
    built, kept = split or built_from_cores(program)
    return len(kept) == 1 and not any(reads_cores(n) for n in program.nodes if n not in built)


def applied(program: Program,
            split: tuple[list[Call], tuple[str, ...]] | None = None) -> str | None:
    """Whether the layer is one ungrouped linear or conv (``F.linear``, ``F.conv1d/2d/3d``, or
    ``torch.matmul`` by a weight built inputs first) of its input as given by one weight built
    of the cores, whose result is its output (the bias, if any, its own): then a base layer of
    the same geometry can take that weight into its own, and the two run as one (how
    ``tnspec``'s adapters run such an adapter beside its base). The op's name where it is,
    else None. ``split``: what :func:`built_from_cores` gives, where it is at hand."""
    built, kept = split or built_from_cores(program)
    # what reads and checks the data's shape computes nothing
    rest = [n for n in program.nodes
            if n not in built and not isinstance(n, (CheckShape, Unpack, Let, Require))]
    data = [n.var for n in program.nodes if isinstance(n, CheckShape)]
    # the bias added after a product that takes none
    rest = [n for n in rest if not (isinstance(n, Bias) and n.out == program.result)]
    if len(kept) != 1 or len(rest) != 1 or len(data) != 1 or not isinstance(rest[0], Call):
        return None
    (call,) = rest
    ok = call.fn in _CHAINED | _TRANSPOSED and \
        {k for k, _ in call.kwargs} <= {"bias", "padding", "stride", "dilation"} and \
        call.args[:2] == (Var(data[0]), Var(kept[0])) and \
        all(a == Param("bias") for a in [*call.args[2:], *(v for k, v in call.kwargs
                                                              if k == "bias")]) and \
        (call.out == program.result or [n.var for n in program.nodes if isinstance(n, Bias)]
         == [call.out])
    return call.fn if ok else None
