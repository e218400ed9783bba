"""Plan: a contraction order for a network with every size bound, as plain data.

:mod:`tnspec.planning.problem` prices each pairwise merge (conv-aware: a step that brings the data
together with all carriers of a relation's kernel is a convolution); :mod:`tnspec.planning.paths`
searches for the cheapest order; :func:`plan` runs a planner, lets a chooser measured on the
device decide how each channel-mixing step runs, guards the sizes, and returns a :class:`Plan`
of :class:`Step` records that lowering only names and emits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import SpecError
from ..ir import DEFAULT_MAX_BYTES, Network, Role
from ..shapes import guard_bytes
from .cost import Chooser, CostModel
from .lookup import plan_lookup
from .paths import PLANNERS
from .problem import OPS, Operand, Problem, Split, Step

__all__ = ["OPS", "PLANNERS", "Operand", "Plan", "Problem", "Split", "Step", "plan"]


@dataclass(frozen=True)
class Plan:
    network: Network  # with every size bound
    steps: tuple[Step, ...]
    planner: str
    dense_macs: int  # the same layer as one dense conv (or linear)

    @property
    def flops(self) -> int:
        """Floating-point operations of the whole contraction (2 per multiply-add)."""
        return sum(s.flops for s in self.steps)

    @property
    def largest_intermediate(self) -> int:
        """Elements of the largest tensor a step produces, at the planned batch."""
        sizes = self.network.sizes
        return max((math.prod(sizes[i] for i in s.result.indices) for s in self.steps), default=0)

    def report(self) -> str:
        """A table like opt_einsum's PathInfo: each step, its kind, FLOPs and result size."""
        sizes = self.network.sizes
        rows = [f"  {'step':<5}{'op':<9}{'FLOPs':>12}{'elements':>12}  contraction"]
        for n, s in enumerate(self.steps, 1):
            what = f"{s.left} * {s.right} -> {s.result}"
            if s.convs:
                what += "  over " + ", ".join(c.text for c in s.convs)
            size = math.prod(sizes[i] for i in s.result.indices)
            rows.append(f"  {n:<5}{s.op:<9}{s.flops:>12,}{size:>12,}  {what}")
        dense = 2 * self.dense_macs
        net = self.network
        shape = [math.prod(sizes[i] for i in axis) for axis in net.input.axes]
        runtime = ", ".join(f"{i}={sizes[i]}" for i in net.input.indices if net.index(i).runtime)
        head = (f"plan ({self.planner}) for {net.spec}\n"
                f"  for an input {net.input.name} of shape {shape}"
                + (f" ({runtime})" if runtime else "") + "; another shape may be planned "
                "differently\n"
                f"  total {self.flops:,} FLOPs vs dense {dense:,} "
                f"({dense / max(self.flops, 1):.2f}x fewer); "
                f"largest intermediate {self.largest_intermediate:,} elements")
        return head + "\n" + "\n".join(rows)


def check_planner(name: str, planner: str) -> str:
    """``planner`` where it names one of ``PLANNERS``, else a SpecError naming the setting."""
    if planner not in PLANNERS:
        raise SpecError(f"unknown {name} {planner!r}",
                        hint=f"choose one of {', '.join(sorted(PLANNERS))}")
    return planner


def plan(net: Network, planner: str = "auto", *, max_bytes: int = DEFAULT_MAX_BYTES,
         itemsize: int = 4, model: CostModel | None = None,
         choose: Chooser | None = None) -> Plan:
    """Plan the contraction of ``net``, whose sizes must all be bound (see ``bind_shape``).
    ``model`` prices the steps for the search (default: the built-in constants); ``choose``,
    if given, has the last word on how each channel-mixing step of the chosen order runs
    (1x1 conv or einsum). A tensor of the forward pass (the padded input, an intermediate, the
    output) of more than ``max_bytes`` bytes, at ``itemsize`` bytes per element, is refused
    before anything is allocated."""
    check_planner("planner", planner)
    if net.lookup:  # an index input: its own planner
        return plan_lookup(net, model, max_bytes=max_bytes, itemsize=itemsize)  # type: ignore
    problem = Problem(net, model)
    if len(problem.operands) == 1:
        steps: list[Step] = []
    else:
        replayed = problem.replay(PLANNERS[planner](problem))
        if replayed is None:
            raise SpecError(f"planner {planner!r} gave an order that needs a kernel index "
                            "before its convolution", hint="use planner='auto'")
        steps = replayed
    if choose is not None:
        steps = [problem.rechoose(s, choose) for s in steps]
    sizes = net.sizes
    guard_bytes(net, [(str(s.result), math.prod(sizes[i] for i in s.result.indices))
                      for s in steps], max_bytes, itemsize)
    positions = math.prod(sizes[i] for i in net.with_role(Role.BATCH, Role.SPATIAL_OUT))
    return Plan(net, tuple(steps), planner, net.dense_parameters * positions)
