"""Every adapter format at every rate PEFT's LoRA uses, with and without the step rule.

The digits CNN of ``experiments.models.adapters`` (pretrained on upright digits, adapted to digits
rotated by 90 degrees; 0.100 before adapting), adapters on every linear and conv layer but the
stem at a share of each layer's parameters. tnspec's formats as ``adapt`` builds them and with
``step_rule="spectral"`` (where it bounds a core: tucker2, tt, tr, tt_lora) and with
``init="offset"`` (every core drawn, the initial adapter subtracted by a frozen copy) and
``init="principal"`` (the cores fitted to the base weight, subtracted likewise); PEFT's
LoRA, PiSSA (LoRA from the principal part; PEFT builds it for linear layers only: a method the
library does not build for the network is left out and named), DoRA, LoHa and LoKr at the
largest rank within the same share. Adam at 1e-3, 3e-3 and 1e-2 (no
per-format tuning), 10 epochs of batch 64 (230 steps), seeds 0, 1, 2. A run *diverges* when a
loss is not finite or its final accuracy is not above the model's before adapting.

Reported per method: the mean test accuracy at each rate (min over seeds), the best rate, the
gap of each single rate to each method's best; one training step at batch 256 (2% adapters)
against the frozen base's forward and backward (interleaved rounds, medians). The runs go to
``--workers`` processes of one thread each; the step times are measured in the main process
after them.

    python -m experiments.models.adapter_rates                  # every method: about an hour
    python -m experiments.models.adapter_rates --shares 0.02 --methods tt "tt +rule"
    python -m experiments.models.adapter_rates --out adapter_rates_offset --methods \
        "low_rank offset" "cp offset" "tucker2 offset" "tt offset" "tr offset" \
        "tt_lora offset" "tt offset +rule" "tr offset +rule" cp "tt_lora +rule" \
        peft-lora peft-loha peft-lokr                     # the init="offset" table
    python -m experiments.models.adapter_rates --model cnn --out adapter_rates_cnn_peft \
        --methods "low_rank default" "cp default" "tucker2 default" "tt default" \
        "tr default" "tt_lora default" "low_rank principal" "cp principal" \
        "tucker2 principal" "tt principal" "tr principal" "tt_lora principal" \
        peft-lora peft-pissa peft-dora peft-loha peft-lokr   # both starts against PEFT's five
    python -m experiments.models.adapter_rates --smoke
"""

from __future__ import annotations

import argparse
import copy
import math
import multiprocessing
import statistics
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

import torch
from torch import nn

import tnspec
from tnspec.workflows.adapters import step_rule

from . import adapters as base_experiment
from ..common import digits, markdown_table, save

RATES = (1e-3, 3e-3, 1e-2)
SHARES = (0.005, 0.02)
SEEDS = (0, 1, 2)
# (name, format, what is done): "spectral" is the step rule (only where it bounds a core:
# low_rank's and cp's cores have one bond each), "offset" is adapt(init="offset"), "raw" the
# trial that lost (the bounded cores' originals at their Graph-in scale instead of unit RMS:
# the same function, a faster turn per step); joined by "+"
TNSPEC = (("low_rank", "low_rank", ""), ("cp", "cp", ""),
          ("tucker2", "tucker2", ""), ("tucker2 +rule", "tucker2", "spectral"),
          ("tt", "tt", ""), ("tt +rule", "tt", "spectral"),
          ("tr", "tr", ""), ("tr +rule", "tr", "spectral"),
          ("tt_lora", "tt_lora", ""), ("tt_lora +rule", "tt_lora", "spectral"),
          ("tt +rule, raw at init", "tt", "spectral+raw"),
          ("tr +rule, raw at init", "tr", "spectral+raw"),
          ("tt_lora +rule, raw at init", "tt_lora", "spectral+raw"),
          ("low_rank offset", "low_rank", "offset"), ("cp offset", "cp", "offset"),
          ("tucker2 offset", "tucker2", "offset"), ("tt offset", "tt", "offset"),
          ("tr offset", "tr", "offset"), ("tt_lora offset", "tt_lora", "offset"),
          ("tt offset +rule", "tt", "spectral+offset"),
          ("tr offset +rule", "tr", "spectral+offset"),
          ("low_rank principal", "low_rank", "principal"), ("cp principal", "cp", "principal"),
          ("tucker2 principal", "tucker2", "principal"), ("tt principal", "tt", "principal"),
          ("tr principal", "tr", "principal"), ("tt_lora principal", "tt_lora", "principal"),
          *((f"{f} default", f, "default") for f in ("low_rank", "cp", "tucker2", "tt", "tr",
                                                     "tt_lora")))
PEFT = ("peft-lora", "peft-pissa", "peft-dora", "peft-loha", "peft-lokr")


def build(base: nn.Module, method: str, share: float) -> nn.Module:
    """``base`` (copied) with ``method``'s adapters at ``share`` of each layer."""
    spec = {name: (fmt, rule) for name, fmt, rule in TNSPEC}
    if method not in spec:
        return base_experiment.adapted(base, method, share)
    fmt, done = spec[method]
    steps = set(done.split("+")) - {""}
    model = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # modes of small channel counts
        init = {} if "default" in steps else {  # "default": what adapt does unasked
            "init": "principal" if "principal" in steps else
            "offset" if "offset" in steps else "zero"}
        model = tnspec.adapt(model, fmt, rank=share, include=base_experiment._targets(model),
                             step_rule="spectral" if "spectral" in steps else None,
                             **init)[0]
    if "raw" in steps:
        raw_at_init(model)
    return model


def raw_at_init(model: nn.Module) -> None:
    """The trial: every bounded core's original scaled from unit RMS to the RMS of the values
    the network reads (its Graph-in std at init); the network reads the same values."""
    for module in model.modules():
        if isinstance(module, tnspec.Adapted):
            for layer in module.adapters.values():
                for name in step_rule.bounds(layer):
                    original = getattr(layer.parametrizations, name).original
                    with torch.no_grad():
                        original.mul_(getattr(layer, name).pow(2).mean().sqrt())


def train(model: nn.Module, data: tuple[torch.Tensor, ...], lr: float, epochs: int,
          seed: int) -> tuple[float, bool]:
    """Adam on the trainable parameters, batch 64; (test accuracy, every loss finite). It
    stops at the first loss that is not finite."""
    x_tr, y_tr, x_te, y_te = data
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    finite = True
    for _ in range(epochs):
        for idx in torch.randperm(len(x_tr), generator=gen).split(64):
            loss = nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx])
            if not torch.isfinite(loss):
                finite = False
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
        if not finite:
            break
    return base_experiment.accuracy(model, x_te, y_te), finite


def _job(job: tuple) -> tuple:
    """One run in a worker process: ``(method, share, lr, seed, base state, smoke, "cnn" or
    "mlp")``."""
    method, share, lr, seed, state, smoke, kind = job
    torch.set_num_threads(1)
    task = base_experiment.rotated(_images(smoke))
    base = getattr(base_experiment, kind)()
    base.load_state_dict(state)
    base.requires_grad_(False)
    torch.manual_seed(seed)
    model = build(base, method, share)
    acc, finite = train(model, task, lr, 1 if smoke else 10, seed)
    return method, share, lr, seed, acc, finite, base_experiment.trainable(model)


def _images(smoke: bool) -> tuple[torch.Tensor, ...]:
    images = digits(images=True)
    if smoke:
        images = (images[0][:200], images[1][:200], images[2][:100], images[3][:100])
    return images


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version (tests)")
    parser.add_argument("--shares", type=float, nargs="+", default=list(SHARES))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=None,
                        help="the results file's name (default: adapter_rates[_shares])")
    parser.add_argument("--model", choices=("cnn", "mlp"), default="cnn",
                        help="the digits CNN (3 adapted layers) or MLP (3 linear layers)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="a subset of the methods (names as in the table)")
    args = parser.parse_args(argv)
    started = time.time()
    images = _images(args.smoke)
    torch.manual_seed(0)
    base = getattr(base_experiment, args.model)()
    base_experiment.fit(base.requires_grad_(True), images, 1e-3, 1 if args.smoke else 20, 0)
    base.requires_grad_(False)
    task = base_experiment.rotated(images)
    before = base_experiment.accuracy(base, task[2], task[3])
    methods = args.methods or [name for name, *_ in TNSPEC] + \
        (list(PEFT) if base_experiment.peft_available() else [])
    refused = {}  # methods the library does not build for this network, and why
    for method in methods:
        try:
            build(base, method, min(args.shares))
        except (ValueError, TypeError, NotImplementedError) as exc:
            refused[method] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    methods = [m for m in methods if m not in refused]
    seeds, rates = ((0,), (1e-2,)) if args.smoke else (SEEDS, RATES)
    state = base.state_dict()
    jobs = [(m, s, lr, seed, state, args.smoke, args.model) for s in args.shares
            for m in methods
            for lr in rates for seed in seeds]
    results = {}
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) \
            as pool:
        for method, share, lr, seed, acc, finite, params in pool.map(_job, jobs):
            results[(method, share, lr, seed)] = (acc, finite, params)
            print(f"{method:>16} {share:.1%} lr {lr:g} seed {seed}: {acc:.3f}"
                  + ("" if finite else " (loss not finite)"), flush=True)
    total = sum(p.numel() for p in base.parameters())
    text = ["# Adapters at every rate, with and without the step rule (digits "
            f"{args.model.upper()}, rotated 90 degrees)\n",
            f"Adam, 10 epochs of batch 64, seeds {', '.join(map(str, seeds))}; test accuracy "
            "on the 360 rotated test digits, mean over seeds (the lowest seed in brackets); "
            f"{before:.3f} before adapting. Diverged: runs with a loss that is not finite or "
            "a final accuracy not above the model's before adapting. +rule: "
            "`adapt(step_rule=\"spectral\")`.\n"]
    text += [f"Not run: {m}, which the library does not build for this network ({why}).\n"
             for m, why in refused.items()]
    for share in args.shares:
        rows, means = [], {}
        for method in methods:
            cells, diverged = [], 0
            for lr in rates:
                runs = [results[(method, share, lr, s)] for s in seeds]
                accs = [a for a, _, _ in runs]
                diverged += sum(1 for a, f, _ in runs if not f or a <= before)
                means[(method, lr)] = statistics.mean(accs)
                cells.append(f"{means[(method, lr)]:.3f} ({min(accs):.3f})")
            params = results[(method, share, rates[0], seeds[0])][2]
            best = max(rates, key=lambda lr: means[(method, lr)])
            rows.append((method, f"{params:,} ({100 * params / total:.2f}%)", *cells,
                         f"{best:g}", f"{diverged} of {len(rates) * len(seeds)}"))
        text += [f"\n## Adapters at {share:.1%} of each layer\n",
                 markdown_table(["method", "trainable", *(f"lr {lr:g}" for lr in rates),
                                 "best lr", "diverged"], rows),
                 "\nOne rate for all: each rate's largest gap to a method's best rate, in "
                 "points of accuracy (tnspec methods as `adapt` builds them, and with the "
                 "rule where it applies):\n"]
        gaps = []
        for lr in rates:
            worst = {m: max(means[(m, r)] for r in rates) - means[(m, lr)] for m in methods}
            name = max(worst, key=worst.get)
            gaps.append((f"{lr:g}", f"{100 * worst[name]:.1f}", name))
        text.append(markdown_table(["lr", "largest gap (points)", "method"], gaps))
    models = {"frozen base": base}
    models.update({m: build(base, m, 0.02) for m in methods})
    x = task[0][:256]
    times = base_experiment.step_times(models, x, task[1][:len(x)], 2 if args.smoke else 30)
    text += ["\nOne training step at batch 256 (adapters at 2%), median of interleaved rounds, "
             f"{torch.get_num_threads()} thread(s):\n",
             markdown_table(["method", "ms", "x frozen base fwd+bwd"],
                            [(n, f"{t * 1e3:.1f}", f"{t / times['frozen base']:.2f}")
                             for n, t in times.items()])]
    out = "\n".join(text)
    print(out)
    if not args.smoke:
        save(args.out or "adapter_rates" + ("" if args.shares == list(SHARES) else "_" + "_".join(
            f"{s:g}" for s in args.shares)), out, started)
    return 0 if all(math.isfinite(a) for a, _, _ in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
