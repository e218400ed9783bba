"""Stage 4, plan: a contraction order for a network with every size bound, as plain data.

The operands are the data tensor (position 0) and the cores. A pairwise step that brings the
data side together with *all* carriers of a relation's kernel index resolves that relation: it
is a convolution, and costs its direct-convolution multiply-adds (output positions x kernel x
channels). Until then the data side carries the input-side spatial index (its size is the real,
padded-free input size). A step may not give the data side a kernel index without resolving its
relation (that would be im2col), so kernel-bearing cores are merged before the conv.

The search is opt_einsum's :class:`~opt_einsum.paths.DynamicProgramming`, driven by an exact
conv-aware cost (its ``minimize`` accepts a callable that scores each merge of two sub-networks).
To its connectivity test the data side carries the kernel indices of unresolved relations as
virtual legs, so that "data with kernel core" counts as a contraction, not an outer product.
Planners live in a registry (:data:`PLANNERS`); ``auto`` takes the cheapest of the DP, the
"dense kernel first" order and the left-to-right order (einconv's).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from itertools import chain
from typing import Callable, Sequence

from opt_einsum.paths import DynamicProgramming, greedy

from .cost import Chooser, CostModel, Mixing
from .errors import SpecError
from .ir import DEFAULT_MAX_BYTES, MAX_CONV_DIMS, Conv, Network, Role
from .shapes import guard_bytes

Path = list[tuple[int, ...]]


@dataclass(frozen=True)
class Operand:
    """A tensor during the contraction: the data, a core, or an intermediate ``t1``, ``t2``..."""

    name: str
    indices: tuple[str, ...]


@dataclass(frozen=True)
class Split:
    """How a data-side step's indices map onto the axes of the torch op that runs it:
    ``batch`` (the data side's own indices), ``groups`` (shared and kept), ``inputs`` (shared
    and summed: input channels), ``outputs`` (the core side's own: output channels) and
    ``spatial`` (the axes a conv slides over; kernel 1 where no relation is resolved)."""

    batch: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    spatial: tuple[str, ...] = ()


#: what runs a step: a grouped convolution resolving relations, a grouped 1x1 convolution
#: (channel mixing on the data side), ``F.linear``, or a pairwise ``torch.einsum``
OPS = ("conv", "conv1x1", "linear", "einsum")


@dataclass(frozen=True)
class Step:
    """One pairwise contraction. When one operand descends from the data, it is ``left``
    (``data_side``); its result is laid out (batch, groups, out channels, spatial). ``op`` and
    ``split`` say exactly how it runs; lowering only names and emits."""

    left: Operand
    right: Operand
    result: Operand
    op: str  # one of OPS
    convs: tuple[Conv, ...]
    macs: int
    data_side: bool = False
    split: Split = Split()
    seconds: float = 0.0  # the cost model's forward+backward estimate

    @property
    def flops(self) -> int:
        return 2 * self.macs


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
            what = (f"{_operand(s.left)} * {_operand(s.right)} -> {_operand(s.result)}")
            if s.convs:
                what += "  over " + ", ".join(c.text for c in s.convs)
            size = math.prod(sizes[i] for i in s.result.indices)
            rows.append(f"  {n:<5}{s.op:<9}{s.flops:>12,}{size:>12,}  {what}")
        dense = 2 * self.dense_macs
        head = (f"plan ({self.planner}) for {self.network.spec}\n"
                f"  total {self.flops:,} FLOPs vs dense {dense:,} "
                f"({dense / max(self.flops, 1):.2f}x fewer); "
                f"largest intermediate {self.largest_intermediate:,} elements")
        return head + "\n" + "\n".join(rows)


def _operand(op: Operand) -> str:
    return f"{op.name}[{', '.join(op.indices)}]"


# ---- the problem ----------------------------------------------------------------------------


class Problem:
    """The contraction problem of a bound network, with the exact conv-aware cost model."""

    def __init__(self, net: Network, model: "CostModel | None" = None) -> None:
        self.net = net
        self.sizes = net.sizes
        # kernel-less relations (pure subsampling) are applied to the data before any step
        swap = {c.source: c.target for c in net.convs if c.kernel is None}
        data = tuple(swap.get(i, i) for i in net.input.indices)
        self.operands = [Operand(net.input.name, data)] + [
            Operand(c.name, c.indices) for c in net.cores]
        self.output = tuple(net.output.indices)
        self.convs = tuple(c for c in net.convs if c.kernel is not None)
        #: the data side's spatial axes: every source and target (kernel-less ones included)
        self.spatial = frozenset(c.source for c in net.convs) | {c.target for c in net.convs}
        # and plain axes the data keeps after its channels (x[b, c, h, w] -> y[b, o, h, w]):
        # a 1x1 conv mixes channels across them without moving the data
        axes, out = net.input.axes, net.output.axes
        plain = {a[0] for a, o in zip(axes[2:], out[2:]) if len(a) == 1 and a == o
                 and net.index(a[0]).role is Role.BATCH} if len(axes) == len(out) else set()
        if len(net.convs) + len(plain) <= MAX_CONV_DIMS:
            self.spatial |= plain
        # which operands carry each relation's kernel (bitmap over operand positions)
        self.carriers = [sum(1 << p for p, op in enumerate(self.operands)
                             if c.kernel in op.indices and p) for c in self.convs]
        self._legs: dict[int, tuple[str, ...]] = {}
        # the cost model works on bitmasks of indices, with sizes of masks cached
        self.bit = {i: 1 << n for n, i in enumerate(self.sizes)}
        self._mask: dict[int, int] = {}
        self._size: dict[int, int] = {0: 1}
        self.conv_bits = [(self.bit[c.source], self.bit[str(c.kernel)],
                           self.sizes[c.target] * self.sizes[str(c.kernel)]) for c in self.convs]
        self.spatial_bits = 0
        for i in self.spatial:
            self.spatial_bits |= self.bit.get(i, 0)
        self.model = model or CostModel()

    def legs(self, subset: int) -> tuple[str, ...]:
        """Indices of the tensor contracted from the operands in ``subset`` (a bitmap)."""
        if subset in self._legs:
            return self._legs[subset]
        inside = [op for p, op in enumerate(self.operands) if subset >> p & 1]
        outside = set(self.output).union(*(op.indices for p, op in enumerate(self.operands)
                                           if not subset >> p & 1))
        # sources and kernels are kept until their relation is resolved
        outside |= {c.source for c in self.convs} | {str(c.kernel) for c in self.convs}
        legs = [i for i in dict.fromkeys(chain(*(op.indices for op in inside))) if i in outside]
        if subset & 1:
            for c, carriers in zip(self.convs, self.carriers):
                if carriers & subset == carriers:  # resolved: the source becomes the target
                    legs = [c.target if i == c.source else i for i in legs if i != c.kernel]
        self._legs[subset] = tuple(legs)
        return self._legs[subset]

    def mask(self, subset: int) -> int:
        """:meth:`legs` as a bitmask of indices."""
        if subset not in self._mask:
            m = 0
            for i in self.legs(subset):
                m |= self.bit[i]
            self._mask[subset] = m
        return self._mask[subset]

    def size(self, mask: int) -> int:
        """Product of the sizes of the indices in ``mask``."""
        if mask not in self._size:
            n, rest = 1, mask
            for i, bit in self.bit.items():
                if rest & bit:
                    n *= self.sizes[i]
            self._size[mask] = n
        return self._size[mask]

    def merge(self, a: int, b: int) -> tuple[float, int, tuple[Conv, ...], str] | None:
        """Merging subsets a and b: (predicted seconds forward and backward, multiply-adds,
        the relations it resolves, how lowering runs it: "conv" or "einsum"), or None if the
        merge is not allowed (it would hand the data side a kernel index without its conv).
        Called for every merge the search considers, so it works on bitmasks only."""
        if b & 1:
            a, b = b, a
        union = a | b
        la, lb, res = self.mask(a), self.mask(b), self.mask(union)
        kernel, factor, resolved = 1, 1, ()
        if a & 1:
            for conv, (src, ker, out), carriers in zip(self.convs, self.conv_bits,
                                                       self.carriers):
                inside = carriers & union
                if inside and inside != carriers:
                    return None
                if inside and not carriers & a:
                    kernel *= self.size(ker)
                    factor *= out  # target positions x kernel taps
                    la &= ~src
                    lb &= ~ker
                    resolved += (conv,)
            if len(resolved) > MAX_CONV_DIMS:
                return None
        size = self.size
        macs = factor * size(la | lb)
        traffic = size(self.mask(a)) + size(self.mask(b)) + size(res)
        einsum = self.model.einsum(macs, traffic)
        if not (a & 1 and res & self.spatial_bits):
            return einsum, macs, resolved, "einsum"
        shared = la & lb
        conv = self.model.conv(size(la & ~lb & ~self.spatial_bits), size(shared & res),
                               size(shared & ~res), size(lb & ~la), size(res & self.spatial_bits),
                               kernel, traffic)
        if resolved or conv < einsum:
            return conv, macs, resolved, "conv"
        return einsum, macs, resolved, "einsum"

    def cost(self, a: int, b: int) -> float | None:
        """Predicted seconds of merging subsets a and b (None if not allowed)."""
        merged = self.merge(a, b)
        return None if merged is None else merged[0]

    # opt_einsum's view: data carries virtual kernel legs until its relations are resolved
    def plain_inputs(self) -> list[set[str]]:
        data = set(self.operands[0].indices) | {str(c.kernel) for c in self.convs}
        return [data] + [set(op.indices) for op in self.operands[1:]]

    def plain_output(self) -> set[str]:
        # sources are listed as output so that opt_einsum does not sum them out up front
        return set(self.output) | {c.source for c in self.convs}

    def plain_legs(self, subset: int) -> set[str]:
        legs = set(self.legs(subset))
        if subset & 1:
            legs |= {str(c.kernel) for c, carriers in zip(self.convs, self.carriers)
                     if not carriers & subset}
        return legs

    # ---- replay a path into steps ----------------------------------------------------------

    def replay(self, path: Path) -> list[Step] | None:
        """The steps of an opt_einsum-style path (pairs of positions in a shrinking list);
        None if a step is not allowed."""
        live = [(1 << p, op) for p, op in enumerate(self.operands)]
        steps: list[Step] = []
        for pair in path:
            if len(pair) != 2:
                return None
            i, j = sorted(pair)
            (a, left), (b, right) = live[i], live[j]
            del live[j], live[i]
            merged = self.merge(a, b)
            if merged is None:
                return None
            seconds, macs, convs, impl = merged
            if b & 1:
                a, b, left, right = b, a, right, left
            order = self.result_order(left, right, convs, self.legs(a | b), bool(a & 1))
            result = Operand(self.fresh_name(len(steps) + 1), order)
            op, split = self.operation(left, right, result, convs, impl, bool(a & 1))
            steps.append(Step(left, right, result, op, convs, macs, bool(a & 1), split,
                              seconds))
            live.append((a | b, result))
        return steps if len(live) == 1 else None

    def operation(self, left: Operand, right: Operand, result: Operand,
                  convs: tuple[Conv, ...], impl: str, data_side: bool) -> tuple[str, Split]:
        """The op that runs a step and its axis split. On the data side: a grouped conv when
        it resolves relations or the cost model prefers a 1x1 conv, ``F.linear`` when there are
        neither spatial axes nor groups; everything else is an einsum."""
        L, R, res = left.indices, right.indices, set(result.indices)
        spatial = [i for i in L if i in self.spatial] if data_side else []
        if data_side and convs and len(spatial) > MAX_CONV_DIMS:
            spatial = [c.source for c in convs]  # the others ride along with the batch
        elif not (data_side and 1 <= len(spatial) <= MAX_CONV_DIMS and
                  (convs or impl == "conv")):
            if data_side and not spatial and not any(i in R and i in res for i in L):
                return "linear", Split(tuple(i for i in L if i not in R),
                                       inputs=tuple(i for i in L if i in R),
                                       outputs=tuple(i for i in R if i not in L))
            return "einsum", Split()
        kernels = {str(c.kernel) for c in convs}
        split = Split(batch=tuple(i for i in L if i not in R and i not in spatial),
                      groups=tuple(i for i in L if i in R and i in res),
                      inputs=tuple(i for i in L if i in R and i not in res),
                      outputs=tuple(i for i in R if i not in L and i not in kernels),
                      spatial=tuple(spatial))
        return ("conv" if convs else "conv1x1"), split

    def rechoose(self, step: Step, choose: Chooser) -> Step:
        """``step`` with its op picked by ``choose`` when it is channel mixing that both a 1x1
        conv and an einsum can run; other steps are returned as they are."""
        if not step.data_side or step.convs or step.op not in ("conv1x1", "einsum"):
            return step
        op, split = self.operation(step.left, step.right, step.result, (), "conv", True)
        if op != "conv1x1":
            return step
        sizes = self.sizes

        def size(indices: tuple[str, ...]) -> int:
            return math.prod(sizes[i] for i in indices)
        mixing = Mixing(size(split.batch), size(split.groups), size(split.inputs),
                        size(split.outputs), tuple(sizes[i] for i in split.spatial))
        if choose(mixing) == "conv1x1":
            return replace(step, op="conv1x1", split=split)
        return replace(step, op="einsum", split=Split())

    def fresh_name(self, k: int) -> str:
        """``t<k>`` for the k-th intermediate, never the name of one of the network's tensors
        (a core may be called ``t1``)."""
        taken = {self.net.input.name, self.net.output.name} | {c.name for c in self.net.cores}
        name = f"t{k}"
        while name in taken:
            name += "_"
        return name

    def result_order(self, left: Operand, right: Operand, convs: Sequence[Conv],
                     kept: Sequence[str], data_side: bool) -> tuple[str, ...]:
        """Layout of a step's result (the set ``kept``). On the data side: (batch, groups, out
        channels, spatial), as a grouped convolution produces it, so that a chain of such
        steps never moves the data; among cores: left's order, then right's."""
        kept_set = set(kept)
        if not data_side:
            return tuple(i for i in dict.fromkeys(chain(left.indices, right.indices))
                         if i in kept_set)
        targets = {c.source: c.target for c in convs}
        spatial = [targets.get(i, i) for i in left.indices if i in self.spatial]
        batch = [i for i in left.indices if i not in right.indices and i not in self.spatial]
        groups = [i for i in left.indices if i in right.indices and i in kept_set]
        outs = [i for i in right.indices if i not in left.indices and i in kept_set]
        return tuple(batch + groups + outs + spatial)


# ---- planners -------------------------------------------------------------------------------

Planner = Callable[[Problem], Path]
PLANNERS: dict[str, Planner] = {}


def register(name: str) -> Callable[[Planner], Planner]:
    """Add a planner to :data:`PLANNERS` under ``name``."""
    def add(fn: Planner) -> Planner:
        PLANNERS[name] = fn
        return fn
    return add


@register("dp")
def dynamic_programming(problem: Problem) -> Path:
    """opt_einsum's dynamic programming, scoring each merge by the conv-aware cost."""
    inputs, output = problem.plain_inputs(), problem.plain_output()
    # opt_einsum numbers indices by first appearance; legs handed back must use its numbers
    number = {c: j for j, c in enumerate(Counter(chain(*inputs, output)))}

    first: list[tuple[int, int]] = []

    def compare(cost1, cost2, i1_union_i2, size_dict, cost_cap, s1, s2, xn, g, all_tensors,
                inputs_, i1_cut_i2_wo_output, memory_limit, contract1, contract2):
        # opt_einsum repeats its passes until a full path exists; a second pass finds nothing new
        if not first:
            first.append((s1, s2))
        elif first[0] == (s1, s2):
            raise _NoPath
        step = problem.cost(s1, s2)
        if step is None:
            return
        cost = cost1 + cost2 + step
        if cost <= cost_cap:
            s = s1 | s2
            if s not in xn or cost < xn[s][1]:
                legs = frozenset(number[i] for i in problem.plain_legs(s))
                xn[s] = (legs, cost, (contract1, contract2))

    # no cost cap: its restarts cost more than they prune once the cost is conv-aware
    search = DynamicProgramming(minimize=compare, cost_cap=False)
    try:
        return search(inputs, output, problem.sizes)
    except _NoPath:
        return []  # replays as "no path"


class _NoPath(Exception):
    """Raised inside opt_einsum's search when no allowed order exists."""


@register("greedy")
def greedy_plain(problem: Problem) -> Path:
    """opt_einsum's greedy search over the plain view (conv steps priced as im2col)."""
    return greedy(problem.plain_inputs(), problem.plain_output(), problem.sizes)


@register("dense-first")
def dense_first(problem: Problem) -> Path:
    """Contract all cores, left to right, into the dense kernel; then one step with the data."""
    n = len(problem.operands)  # a result goes to the end of the list, the data stays first
    if n == 2:
        return [(0, 1)]
    return [(1, 2)] + [(1, m - 1) for m in range(n - 1, 2, -1)] + [(0, 1)]


@register("left-to-right")
def left_to_right(problem: Problem) -> Path:
    """The data with the first core, the result with the next core, and so on (einconv)."""
    n = len(problem.operands)  # a result goes to the end of the list
    return [(0, 1)] + [(0, m - 1) for m in range(n - 1, 1, -1)]


#: above this many operands the exact DP (3^n merges) gives way to the greedy search
DP_LIMIT = 12


@register("auto")
def auto(problem: Problem) -> Path:
    """The cheapest of dp (greedy beyond DP_LIMIT operands), dense-first and left-to-right
    under the conv-aware cost."""
    best: tuple[float, Path] | None = None
    search = "dp" if len(problem.operands) <= DP_LIMIT else "greedy"
    for name in (search, "dense-first", "left-to-right"):
        path = PLANNERS[name](problem)
        steps = problem.replay(path) if path else None
        if steps is not None:
            cost = sum(s.seconds for s in steps)
            if best is None or cost < best[0]:
                best = (cost, path)
    if best is None:
        raise SpecError("no allowed contraction order: some core carries the kernels of more "
                        f"than {MAX_CONV_DIMS} convolution axes, which torch cannot lower",
                        hint="split the kernel over several cores, e.g. one per axis (CP)")
    return best[1]


def plan(net: Network, planner: str = "auto", *, max_bytes: int = DEFAULT_MAX_BYTES,
         itemsize: int = 4, model: CostModel | None = None,
         choose: Chooser | None = None) -> Plan:
    """Plan the contraction of ``net``, whose sizes must all be bound (see ``bind_shape``).
    ``model`` prices the steps for the search (default: the built-in constants); ``choose``,
    if given, has the last word on how each channel-mixing step of the chosen order runs
    (1x1 conv or einsum). A tensor of the forward pass (the padded input, an intermediate, the
    output) of more than ``max_bytes`` bytes, at ``itemsize`` bytes per element, is refused
    before anything is allocated."""
    if planner not in PLANNERS:
        raise SpecError(f"unknown planner {planner!r}",
                        hint=f"choose one of {', '.join(sorted(PLANNERS))}")
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
    guard_bytes(net, [(_operand(s.result), math.prod(sizes[i] for i in s.result.indices))
                      for s in steps], max_bytes, itemsize)
    positions = math.prod(sizes[i] for i in net.with_role(Role.BATCH, Role.SPATIAL_OUT))
    return Plan(net, tuple(steps), planner, net.dense_parameters * positions)
