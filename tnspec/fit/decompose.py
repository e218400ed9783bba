"""Decomposition: a conv-like or linear-like network as the dense weight torch would run, and the
reverse, fitting the cores of *any* such network to a given dense weight.

The dense weight is one contraction of the cores (opt_einsum, so any number of indices works).
Fitting is alternating least squares (``tnspec.fit.als``), from an SVD or Graph-in start, with
basin hops for loopy networks; a zero weight is fitted by cores that can still train.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

import opt_einsum
import torch
from torch import Tensor

from ..errors import SpecError
from ..progress import now
from ..ir import Network, Role, without_units
from ..progress import Progress
from ..shapes import geometry
from ..analysis.init import core_inits
from . import als

logger = logging.getLogger("tnspec")


@dataclass(frozen=True)
class DenseLayout:
    """The dense weight of a conv-like or linear-like network: ``target`` names the index of
    each mode (groups, outputs, inputs, kernels; sizes ``modes``), ``shape`` is the weight's
    shape as ``nn.ConvNd`` / ``nn.Linear`` hold it."""

    target: tuple[str, ...]
    modes: tuple[int, ...]
    shape: tuple[int, ...]


def layout(net: Network) -> DenseLayout:
    """The dense layout of ``net``; a SpecError for a network that is neither conv-like nor
    linear-like."""
    geo = geometry(net)
    if geo is None:
        raise SpecError(f"{net.spec!r} is not a conv or linear layer, so it has no dense "
                        "weight", hint="a dense weight needs x[b, C, spatial...] -> "
                        "y[b, O, spatial...] with zero-padded convolutions")
    sizes = net.sizes
    ins = [i for i in geo.inputs if i not in geo.groups]
    outs = [i for i in geo.outputs if i not in geo.groups]
    kernels = [str(c.kernel) for c in geo.convs if c.kernel is not None]
    target = (*geo.groups, *outs, *ins, *kernels)
    shape = [math.prod(sizes[i] for i in (*geo.groups, *outs)), math.prod(sizes[i] for i in ins)]
    shape += [sizes[str(c.kernel)] if c.kernel is not None else 1 for c in geo.convs]
    return DenseLayout(target, tuple(sizes[i] for i in target), tuple(shape))


def dense_weight(net: Network, cores: Mapping[str, Tensor]) -> Tensor:
    """The dense weight of ``net`` with ``cores`` (by name), differentiable in them."""
    plain = without_units(net)  # the cores' unit axes are no index of the contraction
    if plain is not net:
        cores = {c.name: cores[c.name].reshape([plain.sizes[i] for i in c.indices])
                 for c in plain.cores}
        net = plain
    lay = layout(net)
    operands: list = []
    for core in net.cores:
        operands += [_unflipped(net, core.name, cores[core.name]), list(core.indices)]
    return opt_einsum.contract(*operands, list(lay.target)).reshape(lay.shape)


def lookup_table(net: Network, cores: Mapping[str, Tensor]) -> Tensor:
    """The ``(rows of the modes, output size)`` table of a network with an index input."""
    operands: list = []
    for core in net.cores:
        operands += [cores[core.name], list(core.indices)]
    table = opt_einsum.contract(*operands, [*net.input.axes[-1], *net.embedded])
    return table.reshape(net.table_rows, -1)


def _unflipped(net: Network, name: str, tensor: Tensor) -> Tensor:
    """A core as the network reads it: kernel indices it reads in reverse are flipped (the same
    operation undoes itself)."""
    core = next(c for c in net.cores if c.name == name)
    if not core.flipped:
        return tensor
    return tensor.flip([core.indices.index(k) for k in sorted(core.flipped)])


def relative_error(approx: Tensor, weight: Tensor) -> float:
    """``||approx - weight|| / ||weight||`` in float64 (0 for two zero weights)."""
    a, w = approx.detach().double(), weight.detach().to(approx.device).double()
    norm = torch.linalg.vector_norm(w).item()
    diff = torch.linalg.vector_norm(a - w).item()
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def output_error(approx: Tensor, weight: Tensor, metric: Tensor) -> float:
    """``||(approx - weight) L|| / ||weight L||`` for the metric factor ``L`` (``(groups, P,
    q)``): the relative error of the outputs on the data ``L`` was measured on."""
    groups = metric.shape[0]
    a, w = (t.detach().double().reshape(groups, t.shape[0] // groups, -1)
            for t in (approx, weight.to(approx.device)))
    m = metric.to(a)
    norm = torch.linalg.vector_norm(w @ m).item()
    diff = torch.linalg.vector_norm((a - w) @ m).item()
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def fit(net: Network, weight: Tensor, *, max_iter: int = 200, tol: float = 1e-7,
        starts: int = 4, hops: int = 64, max_seconds: float | None = None,
        metric: Tensor | None = None, sweeps: int | None = None) -> dict[str, Tensor]:
    """Cores (float64 on the weight's device, by name, as the layer stores them) whose dense
    weight approximates ``weight`` (the ``nn.ConvNd``/``nn.Linear`` layout of :func:`layout`).

    ALS with extrapolation from an SVD/Graph-in start: at most ``max_iter`` sweeps, stopping when
    a sweep lowers the relative error by less than ``tol`` times it. When some cores start
    random, ``starts`` random starts are fitted and the best kept (ALS finds local minima;
    hyperedge formats such as block-term reach the global one from about half the starts);
    where they end more than 1% apart (or there was one), up to ``hops`` basin hops
    (:func:`tnspec.fit.als.hop`) try to leave the best one's minimum. ``max_seconds`` (None: no
    limit) bounds the whole fit: sweeps, starts and hops stop once it is spent, and the best
    fit so far is returned (the first start always runs at least one sweep).

    ``metric`` (``(groups, P, q)`` from :func:`tnspec.fit.moments.factor`, P the input channels
    per group times the kernel) fits the outputs instead: ``||(W_fit - W) L||`` (damped as
    :func:`refit` damps it) is minimized. Where one core holds the whole input index and
    there is no kernel (a linear layer, a 1x1 conv: low-rank, CP, Tucker-2 factors) that is a
    weight-only fit of ``W S`` for the metric's square root ``S``, the input core then
    multiplied by ``S^-1``: for a low-rank layer the truncated SVD in the inputs' metric, the
    optimum (SVD-LLM's and ASVD's fit). Otherwise it is refined from the weight-only fit
    (:func:`refit`, in the weight's precision, float32 at least).
    ``sweeps`` then bounds that start's ALS sweeps (default ``max_iter``): the refit moves
    the cores further than the last sweeps would, so a few are enough where time counts
    (``tnspec.compress`` runs 5)."""
    plain = without_units(net)
    if plain is not net:  # fitted without its cores' unit axes, which are put back
        fitted = fit(plain, weight, max_iter=max_iter, tol=tol, starts=starts, hops=hops,
                     max_seconds=max_seconds, metric=metric, sweeps=sweeps)
        return {c.name: fitted[c.name].reshape([net.sizes[i] for i in c.indices])
                for c in net.cores}
    lay = layout(net)
    if tuple(weight.shape) != lay.shape:
        raise SpecError(f"the weight has shape {tuple(weight.shape)}, the layer's dense weight "
                        f"{lay.shape}", hint="pass the nn.Conv/nn.Linear weight this layer "
                        "stands for (layer.dense_weight().shape)")
    if not torch.isfinite(weight).all():
        raise SpecError("the weight to fit has NaN or infinite entries")
    check_options(max_iter=max_iter, tol=tol, starts=starts, hops=hops,
                  max_seconds=max_seconds, sweeps=sweeps)
    whitening = None if metric is None else _whitening(net, lay, metric)
    if whitening is not None:  # the data-aware fit is a weight-only fit, whitened
        root, inverse, core, axis = whitening
        w2 = weight.detach().to(torch.float64).reshape(lay.shape[0], -1) @ root
        cores = fit(net, w2.reshape(lay.shape), max_iter=max_iter, tol=tol, starts=starts,
                    hops=hops, max_seconds=max_seconds)
        moved = torch.tensordot(cores[core], inverse, dims=([axis], [0]))
        cores[core] = moved.movedim(-1, axis).contiguous()
        return cores
    precision = torch.promote_types(weight.dtype, torch.float32)
    refit_iter, max_iter = max_iter, max_iter if metric is None or sweeps is None else sweeps
    began = now()
    deadline = math.inf if max_seconds is None else began + max_seconds
    w = weight.detach().to(torch.float64).reshape(lay.modes)
    labels = {c.name: c.indices for c in net.cores}
    sizes = net.sizes
    norm2 = float((w * w).sum())
    stds = {c.core: c.std(sizes) for c in core_inits(net, "graph-in")}  # the start's, the scale's
    if norm2 == 0:
        return _trainable_zero(net, w, stds)
    if len(labels) == 1 and sorted(next(iter(labels.values()))) == sorted(lay.target):
        (name, own), = labels.items()  # one core holding the whole weight: exact, no ALS
        core = w.permute([list(lay.target).index(i) for i in own]).contiguous()
        return {name: _unflipped(net, name, core)}
    problems = {n: als.Problem(n, labels, lay, sizes) for n in labels}
    whole = als.expression([list(ix) for ix in labels.values()], list(lay.target), sizes)
    best: tuple[float, dict[str, Tensor]] = (math.inf, {})
    ends = []
    progress = Progress(f"fit {net.name or 'layer'} ({len(labels)} cores)")
    for seed in range(starts):
        if seed and now() > deadline:
            break
        progress.update(f"start {seed + 1}/{starts}, best error {best[0]:.4g}")
        cores, seeded = als.start(net, w, problems, stds, seed)
        order = [n for n in labels if n not in seeded] + [n for n in labels if n in seeded]
        run = als.run(stds, problems, order, whole, w, cores, max_iter, tol, deadline)
        ends.append(run[0])
        best = min(best, run, key=lambda r: r[0])
        if seed == 0 and len(labels) - len(seeded) <= 1:
            break  # one random core at most, solved first: another start ends the same
    else:
        # starts that all end within 1% of each other found one minimum (a chain, a ring):
        # hops would only spend time; where they disagree, or there was one start, hop
        if hops and (len(ends) == 1 or max(ends) > 1.01 * min(ends)):
            progress.update(f"basin hops from error {best[0]:.4g}")
            best = als.hop(stds, problems, whole, w, best, hops, max_iter, tol, deadline)
    progress.close()
    spent = now() - began
    if now() > deadline:
        logger.info("fit of %s stopped by max_seconds=%g after %.1f s at relative error %.4g",
                    net.spec, max_seconds, spent, best[0])
    else:
        logger.log(logging.INFO if spent > 1 else logging.DEBUG,
                   "fit of %s: %d als.start(s), relative error %.4g in %.1f s", net.spec,
                   len(ends), best[0], spent)
    cores = {n: _unflipped(net, n, t) for n, t in best[1].items()}
    if metric is None:
        return cores
    return refit(net, w.reshape(lay.shape), cores, metric, max_iter=refit_iter, tol=tol,
                 deadline=deadline, dtype=precision)


def refit(net: Network, weight: Tensor, cores: Mapping[str, Tensor], metric: Tensor, *,
          max_iter: int = 200, tol: float = 1e-7, deadline: float = math.inf,
          damping: float = 0.01, dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
    """``cores`` refined to minimize ``||(W_fit - weight) L||^2 + damping * m ||W_fit -
    weight||^2`` for the metric factor ``L`` (``(groups, P, q)``), ``m`` the metric's mean
    eigenvalue: L-BFGS on all cores at once, from ``cores`` (the weight-only fit). The damping
    (1%, as GPTQ's) anchors the directions the sample inputs do not reach, which a fit to
    few samples would otherwise leave free. It runs in ``dtype`` (float32 is about twice as
    fast as float64 and reached the same errors to 3 digits) and returns float64 cores. ALS
    is not used here, because in the data metric a core's input and kernel indices no longer
    separate and its normal equations grow by the kernel size squared (measured 10-60x
    slower than the weight-only fit)."""
    groups, per, _ = metric.shape
    w = weight.detach().to(dtype).reshape(groups, -1, per)
    if w.shape[1] * groups * per != weight.numel():
        raise SpecError(f"the metric has shape {tuple(metric.shape)}, which does not fit a "
                        f"weight of shape {tuple(weight.shape)}",
                        hint="build it with tnspec.fit.moments for this layer")
    m = metric.to(w)
    ridge = damping * float(m.square().sum()) / (groups * per)
    total = float((w @ m).square().sum()) + ridge * float(w.square().sum())
    params = {n: c.detach().to(w).clone().requires_grad_(True) for n, c in cores.items()}
    if total == 0:
        return {n: p.detach().double() for n, p in params.items()}
    # the loss is tr(d M d^T) for M = L L^T + ridge I: with M built once, an evaluation takes
    # one product by it and hands its gradient 2 d M to autograd, where autograd through d L
    # took two (forward and back); kept where L is much thinner than M (fewer samples)
    gram = m @ m.mT + ridge * torch.eye(per, dtype=w.dtype, device=w.device) \
        if 2 * m.shape[2] >= per else None
    opt = torch.optim.LBFGS(list(params.values()), lr=1, max_iter=max_iter, history_size=20,
                            tolerance_grad=1e-12, tolerance_change=tol,
                            line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        if now() > deadline:  # L-BFGS stops on a zero gradient
            return torch.zeros((), dtype=w.dtype, requires_grad=True)
        built = dense_weight(net, params).reshape(w.shape)
        if gram is None:
            d = built - w
            loss = ((d @ m).square().sum() + ridge * d.square().sum()) / total
            loss.backward()
            return loss
        d = built.detach() - w
        dm = d @ gram
        built.backward(dm * (2 / total))
        return (d * dm).sum() / total
    with torch.enable_grad():
        opt.step(closure)
    return {n: p.detach().double() for n, p in params.items()}


def _whitening(net: Network, lay: DenseLayout, metric: Tensor, damping: float = 0.01
               ) -> tuple[Tensor, Tensor, str, int] | None:
    """``(S, S^-1, core, axis)`` with ``S S^T = L L^T + ridge I`` (the metric, damped as
    :func:`refit` damps it) where the whole input index is on one axis of one core and there
    is no kernel and no group: then ``W_fit S`` is the network with that core times ``S``, and
    the data-aware fit is a weight-only one. None otherwise."""
    geo = geometry(net)
    ins = [i for i in geo.inputs if i not in geo.groups]
    holders = [c for c in net.cores if ins and ins[0] in c.indices]
    if geo.groups or len(ins) != 1 or len(holders) != 1 or any(k != 1 for k in lay.shape[2:]) \
            or metric.shape[0] != 1 or metric.shape[1] != lay.shape[1]:
        return None
    key = (metric, damping)
    if _ROOTS.get("key", (None,))[0] is not metric or _ROOTS["key"][1] != damping:
        m = metric[0].to(torch.float64)
        ridge = damping * float(m.square().sum()) / m.shape[0]
        if not ridge > 0:
            return None
        values, vectors = torch.linalg.eigh(m @ m.T + ridge * torch.eye(
            m.shape[0], dtype=m.dtype, device=m.device))
        values = values.clamp_min(ridge)
        _ROOTS.update(key=key, value=((vectors * values.sqrt()) @ vectors.T,
                                      (vectors * values.rsqrt()) @ vectors.T))
    root, inverse = _ROOTS["value"]
    return root, inverse, holders[0].name, list(holders[0].indices).index(ins[0])


#: the last metric's square roots: compress fits many candidates of a layer in a row
_ROOTS: dict[str, Any] = {}


def output_core(net: Network) -> str:
    """The core a zero weight is fitted by zeroing: the last one carrying an output mode (the
    last core where none does). The dense weight is linear in each core, so it is zero."""
    outs = set(net.with_role(Role.OUTPUT_MODE))
    return next((c.name for c in reversed(net.cores) if outs & set(c.indices)),
                net.cores[-1].name)


def _trainable_zero(net: Network, w: Tensor, stds: Mapping[str, float]) -> dict[str, Tensor]:
    """Cores whose dense weight is zero and that can still train: every core drawn at its
    Graph-in scale (from a generator of its own), the output-side core zeroed. All cores zero
    would be a saddle where every gradient is zero (a zero-initialized conv as in ControlNet,
    a zero-init residual branch); this way the zeroed core's gradient is not, as for a zero
    dense layer."""
    gen = torch.Generator().manual_seed(0)
    zeroed = output_core(net)
    cores = {}
    for core in net.cores:
        shape = [net.sizes[i] for i in core.indices]
        draw = torch.randn(shape, generator=gen, dtype=torch.float64) * stds[core.name]
        cores[core.name] = draw.to(w.device) * (core.name != zeroed)
    logger.info("fit of %s: the weight is all zero; cores drawn at their Graph-in scale with "
                "%s zeroed, so that the layer is zero and still trains", net.spec, zeroed)
    return cores


def check_options(*, max_iter: int = 200, tol: float = 1e-7, starts: int = 4, hops: int = 64,
                  max_seconds: float | None = None,
                  sweeps: int | None = None) -> None:
    """Raise :class:`SpecError` unless these are options :func:`fit` takes."""
    if not (isinstance(max_iter, int) and max_iter >= 1 and isinstance(starts, int) and
            starts >= 1 and isinstance(hops, int) and hops >= 0 and tol >= 0):
        raise SpecError(f"max_iter={max_iter!r}, starts={starts!r}, hops={hops!r} and "
                        f"tol={tol!r} must be ints >= 1, an int >= 0 and a number >= 0")
    if max_seconds is not None and (isinstance(max_seconds, bool) or
                                    not isinstance(max_seconds, (int, float)) or
                                    not max_seconds > 0):
        raise SpecError(f"max_seconds={max_seconds!r} must be a positive number of seconds, "
                        "or None for no limit")
    if sweeps is not None and (isinstance(sweeps, bool) or not isinstance(sweeps, int) or
                               sweeps < 1):
        raise SpecError(f"sweeps={sweeps!r} must be an int >= 1, or None for max_iter")
