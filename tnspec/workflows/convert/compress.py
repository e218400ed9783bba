"""``tnspec.compress``: a trained model at a parameter budget, with the format and rank of each
layer chosen to lose the least, each candidate fitted to the data the layer sees.

For every replaceable layer (as :func:`tnspec.tensorize` selects them) candidates (each format
at the budget's share of the layer's parameters by default, or at each of ``shares``) are fitted
to the trained weight: to the layer's outputs on the inputs that
reach it where ``data`` is given (:meth:`Layer.fit_` with ``inputs``; for a low-rank, CP or
Tucker-2 linear layer in closed form, the truncated SVD in the inputs' metric), to the weight
otherwise. The formats are fitted one after the other over all layers, so that a time budget
leaves every layer the cheap ones; a format beaten before (at a layer's two smallest shares, far
behind at the first two layers of a kind and shape) is not fitted there again (``allocate``). Each
candidate has a relative error ``e`` (of the outputs,
or of the weight) and a parameter count. The allocation then solves

    minimize  sum_l  s_l^2 e_l^2   over one choice per layer (a candidate, or the dense layer)
    subject to  sum_l params_l <= budget * sum_l dense params_l

exactly, as a multiple-choice knapsack (dynamic programming over parameter counts rounded up to
a unit of at most 1/2000 of the budget, so that the budget holds without rounding error).
``s_l`` is the layer's sensitivity: with ``data``, how much the model's output moves, relative to
its size, when what a random weight computes from the layer's input (random signs on its
channels for each sample), at 1% of the output's size, is added to the layer's output: a fit's
error has that form, correlated over positions and tokens as the inputs are (the errors of
independent layers add in variance); without data, 1. With ``latency=True`` no layer is slower
than its dense one, as served (forward, no autograd, at the data's batch and at batch 1).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from ...errors import SpecError
from ...fit.decompose import check_options as check_fit_options
from ...progress import Progress, now
from ...nn.module import Layer
from ..adapted import adapted_parts
from ..dense_layers import check_forward, is_dense, never_replaced
from ..feeding import Runner
from ..left_alone import read_directly, tied
from ..model_tree import Selector, first_skipped, selected, set_all, set_where_other
from . import arguments
from . import heal as healing
from . import observe
from . import sequential as sequential_fit
from . import threads as threads_
from .plain_convs import put_back, stand_in
from .allocate import LAYERS, Pruning, allocate, beaten as is_beaten
from .report import Candidate, Choice, CompressReport
from .timing import Clock, Timer, drop_slower, latency_timer
from .tensorize import _replacement, fitted

FORMATS = ("low_rank", "cp", "tucker2", "tt", "tr")  # the cheaper fits first
SHARES = (0.05, 0.1, 0.2, 0.35, 0.5, 0.75)
FIT = {"starts": 1, "hops": 0, "max_iter": 30, "tol": 1e-4, "max_seconds": 10.0,
       "sweeps": 5}


def compress(model: nn.Module, budget: float = 0.25, formats: Sequence[str] = FORMATS, *,
             data: torch.Tensor | Iterable[Any] | None = None, include: Selector = None,
             exclude: Selector = None, latency: bool | str = False,
             shares: Sequence[float] | None = None, fit: Mapping[str, Any] | None = None,
             max_batches: int = 8,
             run: Runner | None = None, max_seconds: float | None = None,
             prune: bool = True, timer: Timer | None = None, sequential: bool = False,
             heal: int = 0, heal_lr: float = 1e-4, threads: int | str | None = "auto"
             ) -> tuple[nn.Module, CompressReport]:
    """Replace, in place, the selected ``nn.Linear`` / ``nn.Conv1d/2d/3d`` layers of ``model``
    (``include``/``exclude`` as :func:`tnspec.tensorize`) by tnspec layers of one of
    ``formats`` at one of ``shares`` of their parameters, or keep them dense, so that the
    replaced layers hold at most ``budget`` times their dense parameters (exactly, biases
    included) and the predicted loss is least (the module docstring gives the rule).

    ``shares=None`` (the default): every layer at ``budget`` of its parameters, in the format
    that fits it best (or dense where the budget leaves room); only where that cannot hold the
    budget (a layer no format fits within the share, one left dense by ``latency``, biases
    kept whole) are the smaller of ``SHARES`` fitted too, one at a time from the largest, until
    it holds. A tuple of shares lets the
    allocation give each layer its own rank by its sensitivity: closer to the original's
    outputs (MiniLM's embeddings at 50%: cosine 0.826 against 0.788 by default) but worse for
    a head trained afresh on the features (with ``SHARES``, a probe up to 1.7 points lower on
    MiniLM and MobileNetV2: the cuts below the budget are what costs).

    ``data``: what the model is fed: a tensor, a dict, or an iterable of batches, each a tensor
    (``model(x)``), a tuple (``model(*batch)``) or a dict (``model(**batch)``, as a Hugging Face
    tokenizer returns it); ``run(model, batch)`` feeds any other kind (an ``(inputs, labels)``
    pair: ``run=lambda model, batch: model(batch[0])``). At most ``max_batches`` are run (eval
    mode, no grad) to record what reaches each layer; each candidate is then fitted to the
    layer's outputs, and each layer's sensitivity measured. ``fit``: options of
    :meth:`Layer.fit_` (by default one start, no hops, at most 30 sweeps stopping at a gain
    under 0.01%, 10 s a fit; with ``data``, 5 ALS sweeps before the refit, ``sweeps`` of
    :func:`tnspec.fit.decompose.fit`). ``latency=True`` (needs ``data``) times the candidates the
    allocation picks and their dense layers as a served model runs them (forward under
    ``no_grad``, on the input shape the layer saw and on it at batch 1) and allocates again
    without those slower than dense at either; ``latency="training"`` times forward and
    backward at the data's shape (a model trained after); ``timer(module, shape) -> seconds``
    replaces the clock.
    ``max_seconds`` bounds the whole call: the formats are fitted one after the other over all
    layers, cheapest first, and the candidates left when the time is spent are not fitted (the
    report says how many); recording the inputs (a forward per batch) reads no further batch
    past a tenth of it, the first sensitivity measure (a forward per layer and batch) none
    past a fifth, and the layers that measure did not reach get the median sensitivity.
    ``prune``: a format beaten (another format's candidate at that share has no larger
    error) at a layer's two smallest shares is not fitted at its larger ones, and one with 1.5
    times another's error at the first two layers of a kind and weight shape is not fitted at
    the others of it (``tnspec.workflows.convert.allocate``): the fits it saves are the slowest
    (TT and TR on a transformer's MLP).

    ``sequential=True`` (needs ``data``): the sensitivities are measured again on the model as
    allocated and the allocation redone with them; then each replaced layer is fitted again,
    in the order the model calls them, to give the original layer's outputs from the inputs
    the compressed layers before it produce (``tnspec.workflows.convert.sequential``).
    ``heal=steps`` (needs ``data``): then at most that many Adam steps (learning rate
    ``heal_lr``) train the new layers toward the original model's outputs on ``data``
    (``tnspec.workflows.convert.heal``), kept only where they lower that distance. Under
    ``max_seconds`` each of the two takes up to a fifth of the time, the fits the rest.

    ``threads``: torch's intra-op threads while it runs: "auto" caps them at the CPUs other
    processes leave free (``tnspec.workflows.convert.threads``), a number sets them, None
    leaves them; put back after.

    Returns ``(model, report)``; ``print(report)`` shows a row per layer, ``report.plot()``
    the candidates. Nothing in the model changes until every fit is done (but for a conv
    that pads "same" or standardizes its weight in its forward, which the plain conv it
    computes stands in for while the call runs, and whose pad stays around its new layer), and
    an error or Ctrl-C at any point, the refits and healing included, leaves the model as it
    was."""
    started = now()
    arguments.check_budget_and_formats(budget, formats)
    times_of = latency_timer(latency, timer)  # an unknown latency is refused here
    for flag, given in ((f"latency={latency!r}", latency), ("sequential=True", sequential),
                        (f"heal={heal!r}", heal)):
        if given and data is None:
            raise SpecError(f"{flag} needs data= (what the model is fed)")
    options = arguments.fit_options(fit, heal, FIT)
    grid, lower = arguments.shares_to_fit(shares, budget, SHARES)
    threads_.check(threads)
    other = never_replaced(model)
    left_alone = {**read_directly(model), **tied(model), **adapted_parts(model)}
    layers, skipped, stand_ins = [], [], {}
    for name, module in model.named_modules():
        if not is_dense(module) or isinstance(module, Layer) or \
                not selected(name, module, include, exclude):
            continue
        try:
            if name in left_alone:
                raise SpecError(left_alone[name])
            read = check_forward(module)
        except SpecError as exc:
            skipped.append((name, exc.message))
            continue
        if read.layer is not module:  # a conv that pads or standardizes in its forward
            inner = name if read.pad is None else f"{name}.layer"  # inside its Padded
            stand_ins[name] = (module, read, inner)
            name = inner
        layers.append((name, read.layer))
    called = dict(layers)  # what the model calls while this runs: the plain layers
    if not layers:
        why = f": {first_skipped(skipped)}" if skipped else ""
        raise SpecError(f"no layer to compress{why}",
                        hint="check include= and exclude=" if not skipped else None)
    check_fit_options(max_seconds=max_seconds)  # None, or a positive number of seconds
    if run is not None and data is None:
        raise SpecError("run= needs data= (the batches it feeds the model)")
    if data is not None:  # read once: a generator would be empty the second time
        data = observe.batches(data, max_batches, run)
        if not data:
            raise SpecError("data= holds no batch", hint="give a tensor, or an iterable of "
                            "batches with at least one")
    torch_threads = torch.get_num_threads()
    # while it runs, the model calls the plain conv each such subclass computes
    stand_in(model, stand_ins)
    try:
        on_threads = threads_.use(threads, model)
        progress = Progress("compress")
        if on_threads:
            progress.line(f"runs on {on_threads}")
        # under max_seconds, recording the inputs (a forward per batch, the first always run)
        # and the first measure together take up to a fifth of it; a layer the measure does not
        # reach gets the median of those it did (the passes are a forward per layer and batch)
        clock = Clock(started)
        inputs_end = math.inf if max_seconds is None else started + 0.1 * max_seconds
        measure_end = math.inf if max_seconds is None else started + 0.2 * max_seconds
        seen, read = observe.inputs(model, layers, data, max_batches, run, called,
                                    lambda: clock.left(inputs_end)) \
            if data is not None else ({}, 0)
        if data is not None and read < len(data):
            progress.line(f"inputs recorded from {read} of {len(data)} batch(es): max_seconds "
                          "left no time for more")
        sensitivity, missing = observe.filled(observe.sensitivities(
            model, layers, data, run, called=called, left=lambda: clock.left(measure_end)),
            layers) if data is not None else ({}, 0)
        if missing:
            progress.line(f"{missing} layer(s) given the median sensitivity: max_seconds left "
                          "no time to measure them")
        targets = observe.outputs(model, data, run) if heal else []
        progress.line(f"{len(layers)} layer(s) to fit"
                      + (f", inputs recorded ({now() - started:.0f} s)" if data else ""))
        end = math.inf if max_seconds is None else started + max_seconds
        # the refits and the healing pass each take up to a fifth of max_seconds
        deadline = end - (0.2 * bool(sequential) + 0.2 * bool(heal)) * (max_seconds or 0)
        choices, unfitted = [], 0
        for name, module in layers:
            dense_params = sum(p.numel() for p in module.parameters())
            shape = seen.get(name, (None, None))[0]
            # latency: timed on the input shape the layer saw; one the data never reached (an
            # auxiliary head) has none, and is left untimed
            dense_seconds = times_of(module, shape)
            choices.append((name, dense_params,
                            [(Candidate("dense", 1.0, dense_params, 0.0,
                                        dense_seconds[0] if dense_seconds else None), None)],
                            sensitivity.get(name, 1.0), dense_seconds))
        networks: dict[str, set] = {name: set() for name, _ in layers}

        def candidate(name: str, module: nn.Module, options_here: list, dense_params: int,
                      dense_seconds: tuple[float, ...], fmt: str, share: float, left: float
                      ) -> Candidate | None:
            """``fmt`` at ``share`` fitted to the layer and added to its options; None where it
            is no candidate (no rank within the share, fitted before, or not smaller)."""
            shape, metric = seen.get(name, (None, None))
            try:
                new = _replacement(module, fmt, share, "graph-in", "linear", {})
            except SpecError:
                return None  # no rank within that share, or a layer this format cannot be
            net = new.network  # two formats can be one network (CP and low-rank linears)
            same = (tuple(c.indices for c in net.cores), tuple(sorted(net.sizes.items())))
            if same in networks[name]:
                return None
            networks[name].add(same)
            cand = fitted(module, new, fmt, share, metric,
                          {**options, "max_seconds": min(options["max_seconds"] or math.inf,
                                                         left)})
            if cand.params >= dense_params:
                return None
            options_here.append((cand, new))
            return cand

        # first, every layer's smallest candidate of the first format (seconds for a whole
        # encoder in low rank): an allocation within the budget exists however soon max_seconds
        # ends (by default that share is only allocated where the budget's does not hold it)
        for (name, module), (_, dense_params, options_here, _, dense_seconds) in \
                zip(layers, choices):
            left = clock.left(deadline)
            if left > 0:
                candidate(name, module, options_here, dense_params, dense_seconds, formats[0],
                          min((*grid, *lower)), left)
        pruned, fitting, pruning = 0, clock.read, Pruning(prune)

        def fit_grid(grid: Sequence[float]) -> None:
            """Format by format over all layers, each at ``grid``'s shares: under a time budget
            every layer has the first formats' candidates before any has the last's."""
            nonlocal unfitted, pruned
            pairs = len(formats) * len(layers)
            for f, fmt in enumerate(formats):
                for j, ((name, module), (_, dense_params, options_here, _, dense_seconds)) in \
                        enumerate(zip(layers, choices)):
                    beaten, fitted_here = 0, []
                    if pruning.skips_layer(fmt, module):
                        if clock.left(deadline) <= 0:  # the time, not the rule, left them out
                            unfitted += len(grid)
                            continue
                        pruned += len(grid)
                        progress.line(f"{name}: {fmt} not fitted: far behind at the first "
                                      f"{LAYERS} layers of its kind and shape")
                        continue
                    for k, share in enumerate(sorted(grid)):
                        left = clock.left(deadline)
                        if left <= 0:
                            unfitted += 1
                            continue
                        if pruning.skips_rest(beaten, k):
                            pruned += len(grid) - k
                            break
                        cand = candidate(name, module, options_here, dense_params,
                                         dense_seconds, fmt, share, left)
                        if cand is not None:  # None: fitted before (the floor) or failed
                            beaten += is_beaten(cand, options_here)
                            fitted_here.append(cand)
                    pruning.record(fmt, module, fitted_here, options_here)
                    count = sum(c.format == fmt and c.share in grid for c, _ in options_here)
                    done = f * len(layers) + j + 1
                    # at the pace so far (a ring's later fits are often slower), capped by
                    # max_seconds
                    clock.left(deadline)  # read only while there is time left
                    at = clock.read
                    ahead = min((at - fitting) * (pairs - done) / done, max(deadline - at, 0))
                    progress.line(f"{name}: {count} {fmt} candidate(s) fitted "
                                  f"({at - started:.0f} s so far"
                                  + (f", about {ahead:.0f} s left)" if done < pairs else ")"))

        fit_grid(grid)

        shapes = {name: seen.get(name, (None, None))[0] for name, _ in layers}

        def allocated(sensitivities: Mapping[str, float] | None, tier: Sequence[float]
                      ) -> tuple[list[int], bool]:
            """The picks per layer among the dense layer and the candidates at ``tier``'s
            shares, and whether they are over the budget. With ``latency``, the picks are timed
            and the allocation redone without those slower than dense."""
            slower = 0
            while True:
                among = [[k for k, (c, _) in enumerate(opts) if k == 0 or c.share in tier]
                         for _, _, opts, _, _ in choices]
                items = [[(opts[k][0].params,
                           ((sensitivities or {}).get(name, s) * opts[k][0].error) ** 2)
                          for k in ks] for ks, (name, _, opts, s, _) in zip(among, choices)]
                try:
                    picks = [ks[k] for ks, k in zip(among, allocate(items, budget))]
                except SpecError as exc:
                    if slower:  # latency left too few candidates
                        raise SpecError(exc.message, hint=f"latency={latency!r} left out "
                                        f"{slower} candidate(s) slower than their dense layer: "
                                        "give a larger budget, or latency=False") from None
                    if max_seconds is None or unfitted == 0:
                        raise  # the budget is below what the formats can do, not what time
                    # bounded by time: the smallest fitted candidate of each layer, over it
                    return [ks[min(range(len(layer)), key=lambda k: layer[k][0])]
                            for ks, layer in zip(among, items)], True
                dropped, untimed = drop_slower(choices, picks, times_of, shapes,
                                               lambda: clock.left(end)) if latency else (0, 0)
                if not dropped:
                    if untimed:
                        progress.line(f"{untimed} pick(s) not timed: max_seconds was spent")
                    return picks, False
                slower += dropped
                progress.line(f"{dropped} picked candidate(s) slower than their dense layer: "
                              "allocated again without them")

        def chosen(picks: list[int]) -> dict[str, nn.Module]:
            return {name: opts[k][1] for (name, _, opts, _, _), k in zip(choices, picks)
                    if opts[k][1] is not None}

        try:
            picks, over_budget = allocated(None, grid)
        except SpecError:
            if not lower:  # shares given, or none below the budget
                raise
            over_budget = True
        # one smaller share at a time, the largest first: the knapsack uses every share it is
        # offered, and a layer cut far below the budget costs more downstream than its error says
        for k, share in enumerate(sorted(lower, reverse=True) if over_budget else ()):
            progress.line(f"the budget does not hold with every layer at {min(grid):g} of its "
                          f"parameters or more: fitting {share:g} too")
            fitting, grid = clock.read, (*grid, share)
            fit_grid((share,))
            try:
                picks, over_budget = allocated(None, grid)
            except SpecError:
                if k == len(lower) - 1:
                    raise
                continue
            if not over_budget:
                break
        new = chosen(picks)
        set_all(model, new)
        refits, healed = (), None
        try:
            if sequential:
                refits_end = end - 0.2 * bool(heal) * (max_seconds or 0)
                again = observe.sensitivities(model, layers, data, run, called={**called, **new},
                                              left=lambda: clock.left(refits_end))
                picks, over_budget = allocated(again, grid)
                set_where_other(model, {**called, **chosen(picks)})
                new = chosen(picks)
                for i, (name, dense_params, opts, s, seconds) in enumerate(choices):
                    choices[i] = (name, dense_params, opts, again.get(name, s), seconds)
                refits = tuple(sequential_fit.refit(
                    model, list(seen), dict(layers), called, new, data, run, options,
                    lambda: clock.left(refits_end),
                    lambda name, a, b: progress.line(f"{name}: refitted on the compressed "
                                                     f"model's inputs, error {a:.4f} -> {b:.4f}")))
            if heal:
                healed = healing.heal(model, list(new.values()), data, targets, run, heal,
                                      heal_lr, lambda: clock.left(end))
                progress.line(f"healed: {healed.steps} step(s), distance to the original "
                              f"{healed.before:.4g} -> {healed.after:.4g}")
        except BaseException:
            set_where_other(model, called)
            raise
        report_rows = [Choice(name, dense_params, opts[k][0], tuple(c for c, _ in opts), s,
                              dense_seconds[0] if dense_seconds else None)
                       for (name, dense_params, opts, s, dense_seconds), k in zip(choices, picks)]
    except BaseException:
        put_back(model, stand_ins, set())
        raise
    finally:
        torch.set_num_threads(torch_threads)
    put_back(model, stand_ins, {name for (name, _, opts, _, _), k in zip(choices, picks)
                                if opts[k][1] is not None})
    progress.close()
    return model, CompressReport(budget, tuple(report_rows), tuple(skipped), data is not None,
                                 now() - started, unfitted=unfitted, other=other,
                                 pruned=pruned, over_budget=over_budget, refits=refits,
                                 healed=healed, threads=on_threads)
