"""The contraction problem: a bound network's operands and the exact conv-aware
price of merging any two groups of them, as the planners (:mod:`tnspec.planning.paths`) search it.

The operands are the data tensor (position 0) and the cores; a group of operands is a bitmap
over their positions. A pairwise step that brings the data side together with *all* carriers of
a relation's kernel index resolves that relation: it is a convolution, and costs its
direct-convolution multiply-adds (output positions x kernel x channels). Until then the data
side carries the input-side spatial index (its size is the real, padded-free input size). A step
may not give the data side a kernel index without resolving its relation (that would be
im2col), so kernel-bearing cores are merged before the conv.

Pricing is vectorized: :meth:`Problem.price` scores whole arrays of candidate merges at once
(indices as bits of an integer, sizes of index sets read from per-byte tables), so that the
exhaustive search over every split of every group costs milliseconds, not a Python call per
merge. :meth:`Problem.replay` turns a chosen path into :class:`Step` records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any, Sequence

import numpy as np

from ..ir import MAX_CONV_DIMS, Conv, Network, Role, without_units
from .cost import Chooser, CostModel, Mixing

#: bitmaps of at most this many indices are int64; more are Python ints in object arrays
INT64_BITS = 62

#: up to this many operands, merges of two cores are priced with their layouts (see
#: ``Problem.pair_cost``); the exact search stops at 14
PAIRS_MAX = 16

#: an opt_einsum-style path: pairs of positions in a list where each result goes to the end
Path = list[tuple[int, ...]]


@dataclass(frozen=True)
class Operand:
    """A tensor during the contraction: the data, a core, or an intermediate ``t1``, ``t2``..."""

    name: str
    indices: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.name}[{', '.join(self.indices)}]"


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


class Problem:
    """The contraction problem of a bound network, with the exact conv-aware cost model."""

    def __init__(self, net: Network, model: "CostModel | None" = None) -> None:
        self.net = net
        self.sizes = net.sizes
        # kernel-less relations (pure subsampling) are applied to the data before any step
        swap = {c.source: c.target for c in net.convs if c.kernel is None}
        data = tuple(swap.get(i, i) for i in net.input.indices)
        self.operands = [Operand(net.input.name, data)] + [  # a unit axis is no index
            Operand(c.name, c.indices) for c in without_units(net).cores]
        self.output = tuple(net.output.indices)
        self.output_position = {i: n for n, i in enumerate(self.output)}
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
        self.model = model or CostModel()
        # one bit per index; above 62 indices the bitmaps are Python ints in object arrays
        self.bit = {i: 1 << n for n, i in enumerate(self.sizes)}
        self.dtype: Any = np.int64 if len(self.bit) <= INT64_BITS else object
        self.operand_bits = [self.bits(op.indices) for op in self.operands]
        # sources and kernels are kept until their relation is resolved
        self.kept_bits = self.bits(chain(self.output, (c.source for c in self.convs),
                                         (str(c.kernel) for c in self.convs)))
        self.conv_bits = [(self.bit[c.source], self.bit[str(c.kernel)], self.bit[c.target],
                           self.sizes[c.target] * self.sizes[str(c.kernel)]) for c in self.convs]
        self.spatial_bits = self.bits(i for i in self.spatial if i in self.bit)
        # product of the sizes of the indices set in each byte of a bitmap, byte by byte
        names = list(self.sizes)
        byte = np.arange(256)
        self.tables = []
        for first in range(0, len(names), 8):
            table = np.ones(256)
            for j, name in enumerate(names[first:first + 8]):
                table *= np.where(byte >> j & 1, float(self.sizes[name]), 1.0)
            self.tables.append(table)
        self._legs: dict[int, tuple[str, ...]] = {}
        # two cores merged where what they share sits inside one's stored layout, neither
        # first nor last: that core is permuted into a copy forward and its gradient back,
        # priced as one more step's overhead, so that of two orders alike in cost the one
        # that takes the cores as they are stored wins (tucker2's kernel: V with G, not U)
        n = len(self.operands)
        self.pair_cost = np.zeros(1 << n if n <= PAIRS_MAX else 0)  # by group bitmap
        cores = range(1, n) if n <= PAIRS_MAX else range(0)  # position 0 is the data
        for p in cores:
            for q in range(p + 1, n):
                one, other = self.operands[p].indices, self.operands[q].indices
                if _inside(one, set(other)) or _inside(other, set(one)):
                    self.pair_cost[1 << p | 1 << q] = self.model.overhead

    def bits(self, indices: Any) -> int:
        """The bitmap of some indices."""
        return sum({self.bit[i] for i in indices})

    def array(self, subsets: Sequence[int]) -> np.ndarray:
        """Bitmaps as an array of this problem's integer type."""
        return np.array(subsets, dtype=self.dtype)

    def pick(self, where: np.ndarray, bits: int) -> np.ndarray:
        """``bits`` where ``where`` holds, else 0, in this problem's integer type."""
        out = np.zeros(where.shape, dtype=self.dtype)
        out[where] = bits
        return out

    def size(self, masks: np.ndarray) -> np.ndarray:
        """Products of the sizes of the indices in each bitmap, as floats (exact below 2^53)."""
        out = np.ones(masks.shape)
        for k, table in enumerate(self.tables):
            out *= table[(masks >> 8 * k & 255).astype(np.intp)]
        return out

    def masks(self, subsets: np.ndarray) -> np.ndarray:
        """For each group of operands (a bitmap over positions), the bitmap of the indices of
        the tensor contracted from it: those it shares with the rest of the network or the
        output; where the group holds the data and every carrier of a relation's kernel, the
        relation is resolved (its source becomes its target and its kernel is summed)."""
        inside = np.zeros(subsets.shape, dtype=self.dtype)
        outside = np.full(subsets.shape, self.kept_bits, dtype=self.dtype)
        for p, bits in enumerate(self.operand_bits):
            has = (subsets >> p & 1) == 1
            inside = inside | self.pick(has, bits)
            outside = outside | self.pick(~has, bits)
        legs = inside & outside
        data = (subsets & 1) == 1
        for (src, ker, tgt, _), carriers in zip(self.conv_bits, self.carriers):
            done = data & ((subsets & carriers) == carriers)
            moved = (legs & ~src & ~ker) | self.pick((legs & src) != 0, tgt)
            legs = np.where(done, moved, legs)
        return legs

    def legs(self, subset: int) -> tuple[str, ...]:
        """Indices of the tensor contracted from the operands in ``subset`` (a bitmap), in
        order of first appearance, a resolved source in its place replaced by its target."""
        if subset not in self._legs:
            self.learn_legs([subset])
        return self._legs[subset]

    def learn_legs(self, subsets: Sequence[int]) -> None:
        """Compute :meth:`legs` of many groups with one call of :meth:`masks`."""
        target = {c.source: c.target for c in self.convs}
        for subset, mask in zip(subsets, self.masks(self.array(subsets)).tolist()):
            legs = []
            for i in dict.fromkeys(chain(*(op.indices for p, op in enumerate(self.operands)
                                           if subset >> p & 1))):
                if not mask & self.bit[i]:
                    i = target.get(i, i)
                if mask & self.bit[i]:
                    legs.append(i)
            self._legs[subset] = tuple(legs)

    def price(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Merging groups ``a[k]`` and ``b[k]``, for every k: the predicted seconds forward and
        backward (``inf`` where the merge is not allowed: it would hand the data side a kernel
        index without its conv, or resolve more relations than torch has conv dims), the
        multiply-adds, and whether a conv runs it (else an einsum)."""
        swap = (b & 1) == 1  # the data side, if any, goes first
        a, b = np.where(swap, b, a), np.where(swap, a, b)
        data = (a & 1) == 1
        whole = a | b
        ma, mb, res = self.masks(a), self.masks(b), self.masks(whole)
        la, lb = ma, mb
        kernel, factor = np.ones(a.shape), np.ones(a.shape)
        resolved = np.zeros(a.shape, dtype=np.int64)
        allowed = np.ones(a.shape, dtype=bool)
        for conv, (src, ker, _, out), carriers in zip(self.convs, self.conv_bits,
                                                      self.carriers):
            inside = whole & carriers
            allowed &= ~(data & (inside != 0) & (inside != carriers))
            new = data & (inside != 0) & ((a & carriers) == 0)
            kernel *= np.where(new, float(self.sizes[str(conv.kernel)]), 1.0)
            factor *= np.where(new, float(out), 1.0)
            la, lb = np.where(new, la & ~src, la), np.where(new, lb & ~ker, lb)
            resolved += new
        allowed &= resolved <= MAX_CONV_DIMS
        size, spatial = self.size, self.spatial_bits
        macs = factor * size(la | lb)
        traffic = size(ma) + size(mb) + size(res)
        einsum = self.model.einsum(macs, traffic)
        shared = la & lb
        conv = self.model.conv(size(la & ~lb & ~spatial), size(shared & res),
                               size(shared & ~res), size(lb & ~la), size(res & spatial),
                               kernel, traffic)
        by_conv = data & ((res & spatial) != 0) & ((resolved > 0) | (conv < einsum))
        seconds = np.where(allowed, np.where(by_conv, conv, einsum), np.inf)
        if len(self.pair_cost):
            seconds = seconds + self.pair_cost[whole.astype(np.int64)]
        return seconds, macs, by_conv

    # opt_einsum's view: data carries virtual kernel legs until its relations are resolved
    def plain_inputs(self) -> list[set[str]]:
        data = set(self.operands[0].indices) | {str(c.kernel) for c in self.convs}
        return [data] + [set(op.indices) for op in self.operands[1:]]

    def plain_output(self) -> set[str]:
        # sources are listed as output so that opt_einsum does not sum them out up front
        return set(self.output) | {c.source for c in self.convs}

    def plain_masks(self, subsets: np.ndarray) -> np.ndarray:
        """:meth:`masks` in that view: a data group without any carrier of a relation's kernel
        counts the kernel as its own, so "data with kernel core" is a contraction, not an
        outer product, to a test of connectivity."""
        legs = self.masks(subsets)
        data = (subsets & 1) == 1
        for (_, ker, _, _), carriers in zip(self.conv_bits, self.carriers):
            legs = legs | self.pick(data & ((subsets & carriers) == 0), ker)
        return legs

    # ---- replay a path into steps ----------------------------------------------------------

    def replay(self, path: Path) -> list[Step] | None:
        """The steps of an opt_einsum-style path (pairs of positions in a shrinking list);
        None if the path does not contract everything or a step is not allowed."""
        live, merges = [1 << p for p in range(len(self.operands))], []
        for pair in path:
            if len(pair) != 2 or len(set(pair)) != 2 or max(pair) >= len(live):
                return None
            i, j = sorted(pair)
            a, b = (live[j], live[i]) if live[j] & 1 else (live[i], live[j])  # data first
            del live[j], live[i]
            merges.append((a, b))
            live.append(a | b)
        if len(live) != 1:
            return None
        if not merges:
            return []
        seconds, macs, by_conv = self.price(self.array([a for a, _ in merges]),
                                            self.array([b for _, b in merges]))
        if np.isinf(seconds).any():
            return None
        self.learn_legs([a | b for a, b in merges])
        made = {1 << p: op for p, op in enumerate(self.operands)}
        steps: list[Step] = []
        for (a, b), s, m, c in zip(merges, seconds.tolist(), macs.tolist(), by_conv.tolist()):
            left, right, data_side = made[a], made[b], bool(a & 1)
            convs = tuple(conv for conv, carriers in zip(self.convs, self.carriers)
                          if data_side and carriers & b and not carriers & a)
            order = self.result_order(left, right, convs, self.legs(a | b), data_side)
            result = Operand(self.fresh_name(len(steps) + 1), order)
            op, split = self.operation(left, right, result, convs,
                                       "conv" if c else "einsum", data_side)
            steps.append(Step(left, right, result, op, convs, round(m), data_side, split, s))
            made[a | b] = result
        return steps

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
                                       outputs=tuple(i for i in result.indices if i not in L))
            return "einsum", Split()
        kernels = {str(c.kernel) for c in convs}
        split = Split(batch=tuple(i for i in L if i not in R and i not in spatial),
                      groups=tuple(i for i in L if i in R and i in res),
                      inputs=tuple(i for i in L if i in R and i not in res),
                      outputs=tuple(i for i in result.indices
                                    if i in R and i not in L and i not in kernels),
                      spatial=tuple(spatial))
        return ("conv" if convs else "conv1x1"), split

    def rechoose(self, step: Step, choose: Chooser) -> Step:
        """``step`` with its op picked by ``choose`` when it is channel mixing that both a 1x1
        conv and an einsum can run; other steps are returned as they are. A conv whose every
        relation is the identity (a kernel of 1, stride 1, no padding or dilation: a 1x1
        conv's core) is channel mixing too: as an einsum it keeps its relations and split, for
        lowering to read the data's axes as the output's, the core without its unit kernel
        axes, and a weight built of cores in the layout the conv would read."""
        if step.data_side and step.op == "conv" and self.identities(step.convs):
            return step if choose(self.mixing(step.split)) == "conv1x1" else \
                replace(step, op="einsum")
        if not step.data_side or step.convs or step.op not in ("conv1x1", "einsum"):
            return step
        op, split = self.operation(step.left, step.right, step.result, (), "conv", True)
        if op != "conv1x1":
            return step
        if choose(self.mixing(split)) == "conv1x1":
            return replace(step, op="conv1x1", split=split)
        return replace(step, op="einsum", split=Split())

    def identities(self, convs: tuple[Conv, ...]) -> bool:
        """Every relation of ``convs`` (one at least) maps its data axis onto its output axis
        unchanged: a kernel of size 1, stride 1, no padding, no dilation of either kind."""
        return bool(convs) and all(
            c.kernel is not None and self.sizes[c.kernel] == 1 and c.stride == 1 and
            c.dilation == 1 and c.padding == 0 and c.input_dilation == 1 for c in convs)

    def mixing(self, split: Split) -> Mixing:
        """The sizes a chooser sees of a channel-mixing step of ``split``."""
        sizes = self.sizes

        def size(indices: tuple[str, ...]) -> int:
            return math.prod(sizes[i] for i in indices)
        return Mixing(size(split.batch), size(split.groups), size(split.inputs),
                      size(split.outputs), tuple(sizes[i] for i in split.spatial))

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
        steps never moves the data; among cores: left's order, then right's. Output channels
        come in the network output's order: that permutes the core side (small), where the
        core side's own order would make the last step permute the whole output."""
        kept_set = set(kept)
        if not data_side:
            return tuple(i for i in dict.fromkeys(chain(left.indices, right.indices))
                         if i in kept_set)
        targets = {c.source: c.target for c in convs}
        spatial = [targets.get(i, i) for i in left.indices if i in self.spatial]
        batch = [i for i in left.indices if i not in right.indices and i not in self.spatial]
        groups = [i for i in left.indices if i in right.indices and i in kept_set]
        outs = [i for i in right.indices if i not in left.indices and i in kept_set]
        outs.sort(key=lambda i: self.output_position.get(i, len(self.output)))
        return tuple(batch + groups + outs + spatial)


def _inside(layout: Sequence[str], shared: set[str]) -> bool:
    """Whether the indices of ``layout`` in ``shared`` are not one run at its start or end."""
    where = [k for k, i in enumerate(layout) if i in shared]
    return bool(where) and where != list(range(len(where))) and \
        where != list(range(len(layout) - len(where), len(layout)))
