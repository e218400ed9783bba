"""Alternating least squares for the cores of any tensor network against a dense weight: the
engine under ``decompose.fit``.

Fitting is alternating least squares (ALS): the network is linear in each core, so the best core
given all the others solves the normal equations ``G c = B`` where

    B = <W, the network without core k>          (the weight contracted with the other cores)
    G = <the other cores, a copy of them>         (summed over every weight index)

Both are contractions that opt_einsum plans once per core; neither forms the (weight x core)
matrix of the problem, so memory stays near the dense weight's. A weight index that the core
shares with other cores (a group index, a hyperedge into the weight) makes one small problem
per value of it. When ``G`` would be large it is never formed: conjugate gradients solve the
same equations with products computed through the network.

Start: a core whose only non-weight index is one bond (a Tucker or CP factor, the end of a
chain) starts from the leading left singular vectors of the weight unfolded along its weight
indices (HOSVD, TensorLy's "svd" init); every other start gives the same subspace, in a random
basis, to a core with several such indices that span fewer dimensions than its weight indices
(a block-term factor); the other cores start from a Graph-in draw and are solved first. Basin
hops then redraw a few cores of the best fit and sweep again, which is what gets loopy networks
(the Odd one) out of the minima every start stops in. At the end the cores are rescaled (their
product unchanged) so that their standard deviations keep the proportions of Graph-in init,
which is what training expects.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import opt_einsum
import torch
from torch import Tensor

from ..ir import Network
from ..progress import now

#: the Gram matrix of one core's problem is formed when it has at most GRAM_ELEMENTS elements
#: or GRAM_FACTOR times the dense weight's, whichever is more; beyond, conjugate gradients
#: solve the same equations without it
GRAM_ELEMENTS = 2**22
GRAM_FACTOR = 4
_RIDGE = 1e-10  # relative to the Gram's mean diagonal: keeps gauge-redundant problems solvable


def run(stds: Mapping[str, float], problems: Mapping[str, "Problem"], order: Sequence[str],
        whole, w: Tensor, cores: dict[str, Tensor], sweeps: int, tol: float,
        deadline: float = math.inf) -> tuple[float, dict[str, Tensor]]:
    """ALS sweeps over ``order`` with Bro's extrapolation, until converged or ``deadline``
    (``tnspec.progress.now``); returns (error, cores)."""
    norm = float(torch.linalg.vector_norm(w))

    def error_of(c: Mapping[str, Tensor]) -> float:
        return float(torch.linalg.vector_norm(whole(*c.values()) - w)) / norm
    error, previous, last = math.inf, math.inf, None
    for sweep in range(1, sweeps + 1):
        before = dict(cores)
        for name in order:
            residual2 = problems[name].solve(w, cores, deadline)  # the cores' error now
            if now() > deadline:  # one core's solve can take minutes (Odd, 256)
                # cut short, the solve may not be a least-squares optimum: its residual
                # formula does not hold, so the error is computed from the cores
                _balance(stds, cores)
                return error_of(cores), cores
        error = math.sqrt(max(residual2, 0.0)) / norm
        if last is not None and sweep > 2:  # jump along the last sweep's direction
            jump = sweep ** (1 / 3)
            trial = {n: cores[n] + jump * (cores[n] - last[n]) for n in cores}
            trial_error = error_of(trial)
            if trial_error < error:
                cores, error = trial, trial_error
        last = before
        _balance(stds, cores)
        if error < 1e-13 or previous - error <= tol * error or now() > deadline:
            break
        previous = error
    return error, cores


PROBE, PAYS = 8, 0.95  # hopping goes on past PROBE hops only if they cut the error 5%


def hop(stds: Mapping[str, float], problems: Mapping[str, "Problem"], whole, w: Tensor,
        best: tuple[float, dict[str, Tensor]], hops: int, sweeps: int, tol: float,
        deadline: float = math.inf) -> tuple[float, dict[str, Tensor]]:
    """Basin hopping: redraw one to three cores of the best fit at random, solve them first,
    sweep ALS again, and keep the result when its error is lower. The minima ALS stops in on a
    loopy network (the Odd one) usually have a few cores wrong and the rest right: restarting
    those few keeps what is right, where a fresh start loses it. Stops after ``hops`` hops,
    after ``hops // 2`` hops in a row without a gain of 1%, or after the first ``PROBE`` hops
    when they lowered the error by less than 5%: on a loopy network stuck in a wrong minimum
    the first hops cut the error several-fold (8 hops take a 16-channel Odd fit from 0.20 to
    under 0.02 in the tests), while on a weight the format only approximates they gain
    little for many times the cost of the starts."""
    gen = torch.Generator().manual_seed(len(best[1]))  # the global RNG stays untouched
    error, cores = best
    names = list(cores)
    idle = 0
    screen = max(tol, 1e-5)  # a hop's sweeps stop early; the best is polished at the end
    patience = max(hops // 2, 1)
    first = error
    for hop in range(hops):
        if error < 1e-13 or idle >= patience or (hop == PROBE and error > PAYS * first) \
                or now() > deadline:
            break
        k = 1 + int(torch.randint(min(3, len(names) - 1), (), generator=gen))
        chosen = [names[int(i)] for i in torch.randperm(len(names), generator=gen)[:k]]
        trial = dict(cores)
        for n in chosen:
            rms = float(trial[n].square().mean().sqrt()) or stds[n]
            draw = torch.randn(trial[n].shape, generator=gen, dtype=torch.float64) * rms
            trial[n] = draw.to(w.device)
        order = chosen + [n for n in names if n not in chosen]
        trial_error, trial = run(stds, problems, order, whole, w, trial, sweeps, screen,
                                 deadline)
        idle = 0 if trial_error < 0.99 * error else idle + 1
        if trial_error < error:
            error, cores = trial_error, trial
    return run(stds, problems, names, whole, w, cores, sweeps, tol, deadline) \
        if screen > tol and now() <= deadline else (error, cores)


class Problem:
    """The least-squares problem of one core given the others, as opt_einsum expressions."""

    def __init__(self, name: str, labels: Mapping[str, Sequence[str]], lay: Any,
                 sizes: Mapping[str, int]) -> None:
        """The problem of core ``name`` (``labels``: every core's indices) for the dense
        layout ``lay`` (a ``decompose.DenseLayout``: ``target`` indices of ``modes`` sizes)."""
        self.name = name
        self.others = [n for n in labels if n != name]
        own, target = labels[name], set(lay.target)
        elsewhere = {i for n in self.others for i in labels[n]}
        self.shared = [i for i in own if i in target and i in elsewhere]  # one problem per value
        self.free = [i for i in own if i in target and i not in elsewhere]  # right-hand sides
        self.unknowns = [i for i in own if i not in target]
        self.order = self.shared + self.free + self.unknowns  # the solver's layout of the core
        self.own = list(own)
        self.target = list(lay.target)
        dangling = [i for i in self.unknowns if i not in elsewhere]  # summed by this core only
        self.ones = [torch.ones(sizes[i], dtype=torch.float64) for i in dangling]
        other_terms = [list(labels[n]) for n in self.others] + [[i] for i in dangling]
        self.sizes = {i: sizes[i] for i in (*lay.target, *elsewhere, *own)}
        n_shared = math.prod(sizes[i] for i in self.shared)
        self.n_unknowns = math.prod(sizes[i] for i in self.unknowns)
        self.rhs = expression([list(lay.target)] + other_terms, self.order, self.sizes)
        self.network = expression(other_terms + [self.order], list(lay.target), self.sizes)
        budget = max(GRAM_ELEMENTS, GRAM_FACTOR * math.prod(lay.modes))
        self.gram = None
        if n_shared * self.n_unknowns**2 <= budget:
            keep = set(lay.target)

            def prime(term: list) -> list:
                return [i if i in keep else (i, "'") for i in term]
            out = self.shared + self.unknowns + [(i, "'") for i in self.unknowns]
            self.gram = expression(other_terms + [prime(t) for t in other_terms], out,
                                   {**self.sizes, **{(i, "'"): s for i, s in self.sizes.items()}},
                                   limit=budget)  # else its path's intermediates are too big

    def solve(self, w: Tensor, cores: dict[str, Tensor], deadline: float = math.inf) -> float:
        """Replace the core by its least-squares best; return the squared residual (past
        ``deadline``, conjugate gradients stop early: a better core, not the best)."""
        others = [cores[n] for n in self.others] + [t.to(w.device) for t in self.ones]
        b = self.rhs(w, *others)
        m = self.n_unknowns
        current = cores[self.name].permute([self.own.index(i) for i in self.order])
        if self.gram is not None:
            g = self.gram(*others, *others).reshape(-1, m, m)
            ridge = _RIDGE * g.diagonal(dim1=1, dim2=2).mean() + 1e-300
            g = g + ridge * torch.eye(m, dtype=g.dtype, device=g.device)
            rows = b.reshape(g.shape[0], -1, m).transpose(1, 2)  # (shared, unknowns, free)
            c = _spd_solve(g, rows).transpose(1, 2).reshape(b.shape)
        else:
            c = self._cg(b, current, others, deadline=deadline)
        cores[self.name] = c.permute([self.order.index(i) for i in self.own]).contiguous()
        return float((w * w).sum() - (b * c).sum())

    def _cg(self, b: Tensor, x: Tensor, others: list[Tensor], steps: int = 50,
            deadline: float = math.inf) -> Tensor:
        """Conjugate gradients on ``G c = B`` with ``G c`` computed through the network."""
        def gram_times(c: Tensor) -> Tensor:
            return self.rhs(self.network(*others, c), *others)
        r = b - gram_times(x)
        p, rr = r, (r * r).sum()
        for _ in range(steps):  # a step of a large network's CG can take seconds
            if now() > deadline:
                break
            if rr <= 1e-28 * (b * b).sum():
                break
            gp = gram_times(p)
            alpha = rr / (p * gp).sum()
            x, r = x + alpha * p, r - alpha * gp
            rr, rr_old = (r * r).sum(), rr
            p = r + (rr / rr_old) * p
        return x


def expression(terms: list[list], out: list, sizes: Mapping, limit: float = math.inf
               ) -> opt_einsum.contract.ContractExpression | None:
    """An opt_einsum expression for ``terms -> out`` with any hashable labels; None when its
    largest intermediate would exceed ``limit`` elements."""
    symbols: dict = {}

    def text(term: list) -> str:
        return "".join(symbols.setdefault(i, opt_einsum.get_symbol(len(symbols))) for i in term)
    equation = ",".join(map(text, terms)) + "->" + text(out)
    shapes = [tuple(sizes[i] for i in t) for t in terms]
    path, info = opt_einsum.contract_path(equation, *shapes, shapes=True, optimize="auto")
    if info.largest_intermediate > limit:
        return None
    return opt_einsum.contract_expression(equation, *shapes, optimize=path)


def start(net: Network, w: Tensor, problems: Mapping[str, Problem],
          stds: Mapping[str, float], seed: int) -> tuple[dict[str, Tensor], set[str]]:
    """Starting cores and the names of those started from the weight's SVD: single-bond
    cores always, cores with several bonds whose weight indices span more on odd starts (in
    a random basis); a Graph-in draw for the others."""
    gen = torch.Generator().manual_seed(seed)  # the user's global RNG stays untouched
    sizes, cores, seeded = net.sizes, {}, set()
    for core in net.cores:
        p = problems[core.name]
        shape = [sizes[i] for i in core.indices]
        rows = math.prod(sizes[i] for i in p.free)
        subspace = seed % 2 == 1 and 1 < p.n_unknowns < rows  # every other start
        if (len(p.unknowns) == 1 or subspace) and not p.shared and not p.ones and p.free:
            # the weight unfolded along the core's own indices has its column space in the
            # core's: the leading singular vectors span it (up to a basis of the core's bonds)
            rank = p.n_unknowns
            unfolded = w.permute([p.target.index(i) for i in p.free] +
                                 [i for i, n in enumerate(p.target) if n not in p.free])
            u = _leading(unfolded.reshape(rows, -1), rank, gen)
            if len(p.unknowns) > 1:  # several bonds (or a hyperedge): a random basis
                q = torch.linalg.qr(torch.randn(rank, rank, generator=gen,
                                                dtype=torch.float64))[0]
                u = u @ q.to(u.device)
            cores[core.name] = u.reshape([sizes[i] for i in p.free + p.unknowns]).permute(
                [p.order.index(i) for i in core.indices]).contiguous()
            seeded.add(core.name)
        else:
            cores[core.name] = (torch.randn(shape, generator=gen, dtype=torch.float64) *
                                stds[core.name]).to(w.device)
    return cores, seeded


def _spd_solve(g: Tensor, rows: Tensor) -> Tensor:
    """``g^-1 rows`` for a batch of symmetric positive definite ``g`` (Gram matrices with a
    ridge), by Cholesky: half an LU's work, and it sidesteps torch 2.13's batched LU on the
    CPU, which with more than one thread failed inside MKL ("Parameter 6 was incorrect on
    entry to DLASWP", then "Pivots given to lu_solve must all be greater or equal to 1") on
    the Grams of a grouped conv's fit. A matrix that is not positive definite in floating
    point is solved alone, by LU."""
    factor, info = torch.linalg.cholesky_ex(g)
    out = torch.cholesky_solve(rows, factor)
    for i in torch.nonzero(info).flatten().tolist():
        out[i] = torch.linalg.solve(g[i], rows[i])
    return out


def _leading(m: Tensor, rank: int, gen: torch.Generator) -> Tensor:
    """The ``rank`` leading left singular vectors of ``m``, random columns past its rank.
    From the eigenvectors of the smaller Gram matrix (``m m^T`` or ``m^T m``): in float64 the
    same leading subspace as the SVD's (to 1e-13 on MiniLM-sized unfoldings), in a quarter to
    a half of its time, where the SVD also computed the right vectors, which are thrown away
    (a fit's start ran one per core and start: issue 60)."""
    rows, cols = m.shape
    k = min(rank, rows, cols)
    if rows <= cols:
        u = torch.linalg.eigh(m @ m.T)[1][:, rows - k:].flip(1)
    else:  # u = m v / |m v| for the leading right vectors v; a null direction is dropped
        u = m @ torch.linalg.eigh(m.T @ m)[1][:, cols - k:].flip(1)
        norms = u.norm(dim=0)
        kept = norms > 1e-10 * norms.max().clamp_min(1e-300)
        u = u[:, kept] / norms[kept]
    if u.shape[1] < rank:
        extra = torch.randn(m.shape[0], rank - u.shape[1], generator=gen, dtype=m.dtype)
        u = torch.cat([u, extra.to(m.device) / math.sqrt(m.shape[0])], 1)
    return u


def _balance(stds: Mapping[str, float], cores: dict[str, Tensor]) -> None:
    """Rescale the cores, their product unchanged, so that their standard deviations keep the
    proportions of ``stds`` (Graph-in's)."""
    logs = {}
    for name, init_std in stds.items():
        core = cores[name]
        std = float(core.std()) if core.numel() > 1 else float(core.abs().sum())
        if not std > 0 or not math.isfinite(std):
            return
        logs[name] = math.log(std / init_std)
    mean = sum(logs.values()) / len(logs)
    for name, log in logs.items():
        cores[name] = cores[name] * math.exp(mean - log)
