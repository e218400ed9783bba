"""Tensorizing a trained CNN from its weights: ``tensorize(..., weights="fit")`` against a fresh
Graph-in init and against the dense model, on scikit-learn's digits.

A small CNN (conv 1->32, conv 32->64, 2x2 max-pool, conv 64->64, linear 1024->10, ReLUs) is
trained dense (Adam, 15 epochs). Its three 32/64-channel layers and the classifier are then
tensorized (the 1-channel stem stays dense) at 50% and 25% of their parameters, in Tucker-2, CP,
tensor-train and tensor-ring format, either fitted to the trained weights or freshly Graph-in
initialized.
Test accuracy right after the swap and after one epoch of fine-tuning (Adam, lr 1e-3), the dense
model fine-tuned one more epoch as the reference; three seeds, mean (min-max).

    python -m experiments.models.decompose            # about 8 minutes (plot: results/decompose.png)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import tnspec

from ..common import digits, markdown_table, plt, save, train

FORMATS = ("tucker2", "cp", "tt", "tr")
SHARES = (0.5, 0.25)


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64 * 4 * 4, 10))


def accuracy(model: nn.Module, data: tuple[torch.Tensor, ...]) -> float:
    model.eval()
    with torch.no_grad():
        return (model(data[2]).argmax(1) == data[3]).float().mean().item()


def run(seed: int, epochs: int, data: tuple[torch.Tensor, ...], fmts: tuple[str, ...] = FORMATS,
        shares: tuple[float, ...] = SHARES) -> dict[str, tuple]:
    """{variant: (accuracy after the swap, after one epoch, mean fit error or None)}."""
    def adam(params):
        return torch.optim.Adam(params, lr=1e-3)
    torch.manual_seed(seed)
    dense = cnn()
    train(dense, data, adam, epochs=epochs, batch=64, seed=seed)
    out = {}
    tuned = copy.deepcopy(dense)
    out["dense"] = (accuracy(dense, data),
                    train(tuned, data, adam, epochs=1, batch=64, seed=seed + 100).final_acc, None,
                    sum(p.numel() for p in dense.parameters()))
    for fmt in fmts:
        for share in shares:
            for weights in ("fit", "init"):
                torch.manual_seed(seed)
                model, report = tnspec.tensorize(copy.deepcopy(dense), fmt, rank=share,
                                                 exclude=["0"], weights=weights)
                before = accuracy(model, data)
                after = train(model, data, adam, epochs=1, batch=64, seed=seed + 100).final_acc
                errors = [r.fit_error for r in report.replaced if r.fit_error is not None]
                params = report.params_after
                out[f"{fmt} {share:.0%} {weights}"] = (
                    before, after, statistics.mean(errors) if errors else None, params)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version (tests)")
    args = parser.parse_args(argv)
    started = time.time()
    data = digits(images=True)
    seeds, epochs = ((0,), 1) if args.smoke else ((0, 1, 2), 15)
    if args.smoke:
        data = tuple(t[:300] for t in data[:2]) + data[2:]
    fmts, shares = (("tucker2",), (0.5,)) if args.smoke else (FORMATS, SHARES)
    runs = [run(seed, epochs, data, fmts, shares) for seed in seeds]

    def summary(values: list[float]) -> str:
        return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"
    rows = []
    for key in runs[0]:
        before = [r[key][0] for r in runs]
        after = [r[key][1] for r in runs]
        err = runs[0][key][2]
        params = runs[0][key][3]
        rows.append((key, f"{params:,}", summary(before), summary(after),
                     "-" if err is None else f"{statistics.mean(r[key][2] for r in runs):.3f}"))
    text = ("# Tensorizing a trained CNN from its weights (digits)\n\n"
            f"Seeds {', '.join(map(str, seeds))}; dense training {epochs} epochs; accuracy on "
            "the 360 test digits, mean (min-max) over the seeds. 'fit': "
            "`tensorize(..., weights=\"fit\")`; 'init': the same format freshly Graph-in "
            "initialized. The fit error is the mean relative error of the replaced layers' "
            "weights.\n\n"
            + markdown_table(["model", "params", "accuracy after the swap",
                              "after 1 epoch fine-tuning", "fit error"], rows))
    print(text)
    if not args.smoke:
        fig, ax = plt().subplots(figsize=(8, 3.8))
        keys = list(runs[0])
        xs = range(len(keys))
        for offset, (index, label) in zip((-0.2, 0.2), ((0, "after the swap"),
                                                        (1, "after 1 epoch"))):
            ax.bar([x + offset for x in xs],
                   [statistics.mean(r[k][index] for r in runs) for k in keys], 0.4,
                   label=label)
        ax.set_xticks(list(xs), keys, rotation=35, ha="right", fontsize=8)
        ax.set(ylabel="test accuracy", ylim=(0, 1))
        ax.legend(loc="lower left")
        fig.tight_layout()
        fig.savefig(save("decompose", text, started).with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
