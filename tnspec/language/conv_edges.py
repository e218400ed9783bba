"""Conv edges: an affine input index such as ``2*h+kh-1`` read as a :class:`~tnspec.ir.Conv`
(output position ``h`` with stride 2, kernel ``kh``, padding 1), with every way it can be written
wrong reported at the index itself.

Functions take a ``report`` callback (as ``settings`` does) so that ``check`` collects every
problem of a spec before raising.
"""

from __future__ import annotations

from dataclasses import replace

from ..ir import Conv, Tensor
from .nodes import IndexNode, OperandNode
from .settings import Report


def relation(ix: IndexNode, core_names: set[str], out_names: set[str],
             report: Report) -> tuple[Conv, IndexNode] | None:
    """The conv relation written by the affine index ``ix`` (input position)."""
    named = [t for t in ix.terms if t.name is not None]
    in_out = [t for t in named if t.name in out_names]
    if len(in_out) > 1 and any(t.name not in core_names for t in in_out):
        # the position is the output name no core carries; the others are kernels
        for t in in_out:
            if t.name in core_names:
                report(f"kernel index {t.name!r} appears in the output", t.span,
                       "a kernel window is summed; remove it from the output")
                return None
    targets = [t for t in named if t.name in out_names]
    kernels = [t for t in named if t.name not in out_names]
    constant = sum(t.coef for t in ix.terms if t.name is None)
    ok = True
    if len({t.name for t in named}) != len(named):
        report(f"affine index '{ix.text}' names an index twice", ix.span,
               "write each index once, with its coefficient, e.g. '2*h+kh-1'")
        return None
    if len(targets) != 1:
        ok = False
        if targets:
            report(f"affine index '{ix.text}' has {len(targets)} output indices "
                   f"({', '.join(str(t.name) for t in targets)})", ix.span,
                   "one output position per axis, e.g. 'h+kh-1'")
        else:
            report(f"affine index '{ix.text}' has no output index", ix.span,
                   "name the output position it depends on, e.g. 'h+kh-1'")
    if len(kernels) > 1:
        ok = False
        report(f"affine index '{ix.text}' has {len(kernels)} kernel indices", ix.span,
               "one kernel window per axis")
    for k in kernels:
        if k.name not in core_names:
            ok = False
            report(f"kernel index {k.name!r} of '{ix.text}' is carried by no core",
                   k.span, f"add {k.name!r} to the core that holds the kernel, or add "
                   f"{k.name!r} to the output if it is the output position")
    if constant > 0:
        ok = False
        report(f"constant +{constant} in '{ix.text}' means negative padding", ix.span,
               "write the padding as a subtraction, e.g. 'h+kh-1' for padding 1")
    stride = targets[0].coef if targets else 1
    dilation = kernels[0].coef if kernels else 1
    for what, value, term in (("stride", stride, targets), ("dilation", dilation, kernels)):
        if value <= 0:
            ok = False
            report(f"{what} {value} in '{ix.text}' must be a positive integer",
                   term[0].span, f"write a {what} of 1 or more")
    if not ok:
        return None
    conv = Conv(source="", target=str(targets[0].name),
                kernel=str(kernels[0].name) if kernels else None,
                stride=stride, dilation=dilation, padding=-constant)
    return replace(conv, source=conv.text), ix  # the source is named by its affine text


def unique_relations(convs: list[tuple[Conv, IndexNode]], data: OperandNode,
                     report: Report) -> None:
    """Each output position and each kernel index serves one affine index, and none is also a
    plain index of the input."""
    plain = {n for ix in data.indices if ix.kind != "affine" for n in ix.names}
    for attr in ("target", "kernel"):
        seen: set[str] = set()
        for conv, ix in convs:
            name = getattr(conv, attr)
            if name is None:
                continue
            if name in seen:
                report(f"index {name!r} is used by two affine indices", ix.span,
                       "each spatial axis needs its own output and kernel index")
            if name in plain:
                report(f"index {name!r} is both a plain input index and part of "
                       f"'{ix.text}'", ix.span, "rename one of them")
            seen.add(name)


def tensor(node: OperandNode, convs: list[tuple[Conv, IndexNode]]) -> Tensor:
    """The operand as an IR :class:`~tnspec.ir.Tensor`: an affine axis is named by its
    relation's text (``h+kh-1``), which the IR's roles and the planner key on."""
    by_node = {id(ix): conv for conv, ix in convs}
    axes = []
    for ix in node.indices:
        if ix.kind == "affine":
            conv = by_node.get(id(ix))
            axes.append((conv.source if conv else ix.text,))
        else:
            axes.append(ix.names)
    return Tensor(node.name, tuple(axes))
