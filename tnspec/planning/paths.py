"""The search: planners that pick a contraction order for a
:class:`~tnspec.planning.problem.Problem`, in a registry (:data:`PLANNERS`) like opt_einsum's.

``dp`` is exact under the conv-aware cost (vectorized: the 10-operand Odd network in a few
ms; ``opt-dp`` runs opt_einsum's DP under the same cost, a merge at a time, to the same
orders); ``greedy`` is opt_einsum's, for networks too large for an exact search;
``dense-first`` (the kernel first, as reconstructing libraries do, the cores in their cheapest
order) and ``left-to-right`` (einconv's order) are the orders other libraries use; and
``auto`` takes the cheapest of them.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from itertools import chain
from typing import Callable
from weakref import WeakKeyDictionary

import numpy as np
from opt_einsum.paths import DynamicProgramming, greedy

from ..errors import SpecError
from ..ir import MAX_CONV_DIMS
from .problem import Path, Problem

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
    """The exact search: the cheapest way to contract every group of operands, built up from
    the cheapest ways to contract each of its two parts, over every split of every group
    (3^n candidate merges, all priced in one vectorized call). Merges of groups that share
    no index are considered only when the network has no order without them."""
    n = len(problem.operands)
    if n > DP_MAX:
        raise SpecError(f"planner 'dp' is an exact search over 3^n merges: {n} operands are "
                        f"too many (at most {DP_MAX})", hint="use planner='auto' (greedy "
                        f"beyond {DP_LIMIT} operands) or 'greedy'")
    parts = _cheapest(problem, (1 << n) - 1)
    return _path(n, parts) if parts else []  # [] replays as "no path"


def _cheapest(problem: Problem, group: int) -> Callable[[int], tuple[int, int]] | None:
    """The cheapest split of ``group`` and of each group inside it (the DP's table), or None
    when it has no allowed order."""
    for linked_only in (True, False):
        best, parts = _table(problem, linked_only)
        if best[group] < np.inf:
            return parts
    return None


#: the DP's tables per problem, filled as asked: ``auto`` runs dp and dense-first, which read
#: the same table, so the 3^n merges are priced once
_TABLES: WeakKeyDictionary[Problem, dict] = WeakKeyDictionary()


def _table(problem: Problem, linked_only: bool
           ) -> tuple[np.ndarray, Callable[[int], tuple[int, int]]]:
    """The cheapest cost of every group and its best split, over merges of groups that share
    an index (``linked_only``) or over all merges."""
    memo = _TABLES.setdefault(problem, {})
    n = len(problem.operands)
    a, b, levels = _splits(n)
    if "seconds" not in memo:
        memo["seconds"] = problem.price(a.astype(problem.dtype), b.astype(problem.dtype))[0]
    if linked_only not in memo:
        allowed = memo["seconds"]
        if linked_only:
            plain = problem.plain_masks(problem.array(range(1 << n)))
            allowed = np.where((plain[a] & plain[b]) != 0, allowed, np.inf)
        whole = a | b
        best = np.full(1 << n, np.inf)
        best[1 << np.arange(n)] = 0.0
        split = np.zeros(1 << n, dtype=np.int64)
        for lo, hi in levels:  # groups of k operands after all groups of fewer
            total = best[a[lo:hi]] + best[b[lo:hi]] + allowed[lo:hi]
            groups = whole[lo:hi]
            order = np.lexsort((total, groups))  # cheapest split first within each group
            first = order[np.r_[True, groups[order][1:] != groups[order][:-1]]]
            best[groups[first]] = total[first]
            split[groups[first]] = lo + first
        memo[linked_only] = (best, lambda s: (int(a[split[s]]), int(b[split[s]])))
    return memo[linked_only]


@register("opt-dp")
def opt_einsum_dp(problem: Problem) -> Path:
    """opt_einsum's :class:`~opt_einsum.paths.DynamicProgramming` under the same cost, one
    Python call per merge: the same orders as ``dp``, an order of magnitude slower (kept as
    the reference that ``dp`` is tested against)."""
    inputs, output = problem.plain_inputs(), problem.plain_output()
    # opt_einsum numbers indices by first appearance; legs handed back must use its numbers
    number = {c: j for j, c in enumerate(Counter(chain(*inputs, output)))}
    names = {bit: name for name, bit in problem.bit.items()}
    first: list[tuple[int, int]] = []

    def compare(cost1, cost2, i1_union_i2, size_dict, cost_cap, s1, s2, xn, g, all_tensors,
                inputs_, i1_cut_i2_wo_output, memory_limit, contract1, contract2):
        # opt_einsum repeats its passes until a full path exists; a second pass finds nothing new
        if not first:
            first.append((s1, s2))
        elif first[0] == (s1, s2):
            raise _NoPath
        step = float(problem.price(problem.array([s1]), problem.array([s2]))[0][0])
        cost = cost1 + cost2 + step
        if cost < np.inf and (s1 | s2 not in xn or cost < xn[s1 | s2][1]):
            legs = int(problem.plain_masks(problem.array([s1 | s2]))[0])
            xn[s1 | s2] = (frozenset(number[names[bit]] for bit in names if legs & bit), cost,
                           (contract1, contract2))

    # no cost cap: its restarts cost more than they prune once the cost is conv-aware
    try:
        search = DynamicProgramming(minimize=compare, cost_cap=False)
        return search(inputs, output, problem.sizes)
    except _NoPath:
        return []  # replays as "no path"


class _NoPath(Exception):
    """Raised inside opt_einsum's search when no allowed order exists."""


@lru_cache(maxsize=None)
def _splits(n: int) -> tuple[np.ndarray, np.ndarray, tuple[tuple[int, int], ...]]:
    """Every split of every group of n operands into two non-empty parts ``a < b`` (bitmaps),
    sorted by the size of ``a | b``, and the range of each size."""
    code = np.arange(3 ** n)
    a, b = np.zeros_like(code), np.zeros_like(code)
    for p in range(n):  # digit p of code in base 3: operand p in neither, a or b
        digit = code // 3 ** p % 3
        a |= (digit == 1).astype(np.int64) << p
        b |= (digit == 2).astype(np.int64) << p
    keep = (a > 0) & (b > 0) & (a < b)
    a, b = a[keep], b[keep]
    count = sum((a | b) >> p & 1 for p in range(n))
    order = np.argsort(count, kind="stable")
    a, b, count = a[order], b[order], count[order]
    bounds = np.searchsorted(count, np.arange(2, n + 2))
    return a, b, tuple(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def _path(n: int, parts: Callable[[int], tuple[int, int]]) -> Path:
    """The opt_einsum-style path that contracts all n operands as ``parts`` splits groups."""
    live, path = [1 << p for p in range(n)], []

    def build(group: int) -> None:
        if group & (group - 1):  # more than one operand
            a, b = parts(group)
            build(a)
            build(b)
            path.append((live.index(a), live.index(b)))
            live.remove(a)
            live.remove(b)
            live.append(group)
    build((1 << n) - 1)
    return path


@register("greedy")
def greedy_plain(problem: Problem) -> Path:
    """opt_einsum's greedy search over the plain view (conv steps priced as im2col)."""
    return greedy(problem.plain_inputs(), problem.plain_output(), problem.sizes)


@register("dense-first")
def dense_first(problem: Problem) -> Path:
    """Contract all cores into the dense kernel, in the cheapest order among cores (a ring
    split in two halves, not walked around); then one step with the data."""
    n = len(problem.operands)  # the data is operand 0
    if n == 2:
        return [(0, 1)]
    if n > DP_LIMIT:  # too many for the exact search: greedy among the cores
        plain = problem.plain_inputs()
        kept = plain[0] | problem.plain_output()  # what the kernel carries on to the data
        among = greedy(plain[1:], kept & set().union(*plain[1:]), problem.sizes)
        # the data stays first and results go last in both lists: positions shift by one
        return [(i + 1, j + 1) for i, j in among] + [(0, 1)]
    cores = (1 << n) - 2
    parts = _cheapest(problem, cores)
    if parts is None:  # left to right, each result going to the end of the list
        return [(1, 2)] + [(1, m - 1) for m in range(n - 1, 2, -1)] + [(0, 1)]
    return _path(n, lambda s: (1, cores) if s == cores | 1 else parts(s))


@register("left-to-right")
def left_to_right(problem: Problem) -> Path:
    """The data with the first core, the result with the next core, and so on (einconv)."""
    n = len(problem.operands)  # a result goes to the end of the list
    return [(0, 1)] + [(0, m - 1) for m in range(n - 1, 1, -1)]


#: above this many operands the exact DP (3^n merges) gives way to the greedy search in auto
#: and dense-first; an explicit planner="dp" is refused above DP_MAX (its tables take GBs)
DP_LIMIT = 12
DP_MAX = 14


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
