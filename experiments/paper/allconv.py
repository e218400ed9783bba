"""Tensorial All-Conv without batch norm (paper Table 1 / Table 8 style), on the 8x8 digits or
on Fashion-MNIST (28x28).

Nine convolutions, ReLU after the first eight, no normalization, a global average pool:
3x3 1->C, 3x3 C->C, 3x3 stride 2, 3x3, 3x3, 3x3 stride 2, 3x3, 1x1, 1x1 C->10, with C = 24
channels as (4 x 3 x 2) modes for TT/TR and (6 x 4) for Odd; every layer, the first included,
is tensorized (input modes of size 1 where there is one channel). Formats: low-rank, CP,
Tucker-2, HTK2 (phi = 4), TT, TR, the Odd-like network (phi = 4, rank 3), three random formats;
ranks 6. Each is initialized with per-core Kaiming-in/-out (torch's fan rule on every core)
and Graph-in/-out; a dense All-Conv with torch's Kaiming is the reference. SGD, lr 5e-3,
momentum 0.9, weight decay 5e-4, batch 128, no learning-rate schedule. The paper: CIFAR-10,
96 channels, ranks 10, 270 epochs with the rate cut at 100, 180 and 230; here 24 channels and
ranks 6 (3 for Odd), and on

- the digits: 40 epochs of 1,437 images (480 steps);
- Fashion-MNIST: 600 steps (1.3 epochs of 60,000 images; 28 -> 14 -> 7 pixels).

    python -m experiments.paper.allconv                   # digits: 11 nets x 4 inits (~6 min)
    python -m experiments.paper.allconv --data fashion    # (see README for the time)
    python -m experiments.paper.allconv --data fashion --smoke
"""

from __future__ import annotations

import argparse
import time
from functools import partial
import warnings

import torch
from torch import nn

from tnspec import formats

from ..common import RESULTS, digits, fashion, markdown_table, plt, progress, save, train, \
    train_steps

C = 24
LAYERS = ((3, 1), (3, 1), (3, 2), (3, 1), (3, 1), (3, 2), (3, 1), (1, 1), (1, 1))  # kernel, stride
FORMATS = ("dense", "low_rank", "cp", "tucker2", "htk2", "tt", "tr", "odd",
           "random-1", "random-2", "random-3")
INITS = ("kaiming-in", "kaiming-out", "graph-in", "graph-out")
MODES = {"tt": 3, "tr": 3, "odd": 2}


def layer(fmt: str, i: int, init: str) -> nn.Module:
    """Layer ``i`` of the net in format ``fmt``."""
    (k, s), cin, cout = LAYERS[i], 1 if i == 0 else C, 10 if i == len(LAYERS) - 1 else C
    act = "linear" if i == len(LAYERS) - 1 else "relu"
    pad = k // 2
    if fmt == "dense":
        conv = nn.Conv2d(cin, cout, k, stride=s, padding=pad)
        nn.init.kaiming_normal_(conv.weight, nonlinearity="relu" if act == "relu" else "linear")
        nn.init.zeros_(conv.bias)
        return conv
    if fmt.startswith("random"):
        spec = formats.random(100 * int(fmt[-1]) + i, kernel=k, stride=s,
                              in_modes=_random_modes(cin), out_modes=_random_modes(cout))
    else:
        n = MODES.get(fmt, 1)
        # the 10 classes have two factors: more modes are padded with size-1 modes, explicitly
        outs = (5, 2) + (1,) * (n - 2) if cout == 10 and n > 2 else n
        spec = formats.build(fmt, cin, cout, k, rank=3 if fmt == "odd" else 6, stride=s,
                             padding=pad, in_modes=n, out_modes=outs,
                             phi=4 if fmt in ("htk2", "odd") else None)
    return spec.layer(init=init, activation=act)


def _random_modes(channels: int) -> tuple[int, ...]:
    return {1: (1,), 10: (2, 5)}.get(channels, (4, 6))


class AllConv(nn.Sequential):
    def __init__(self, fmt: str, init: str) -> None:
        mods: list[nn.Module] = []
        with warnings.catch_warnings():
            # the fixed ranks give some small layers more parameters than dense: the point is
            # the initialization, so tnspec's warning about it would repeat on every net
            warnings.filterwarnings("ignore", ".* with rank=.* parameters, more than")
            for i in range(len(LAYERS)):
                mods += [layer(fmt, i, init)] + ([nn.ReLU()] if i < len(LAYERS) - 1 else [])
        super().__init__(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).mean((2, 3))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The last convolution's output, before the pool."""
        return super().forward(x)


def init_scale(fmt: str, init: str, x: torch.Tensor, seed: int = 0) -> float:
    """RMS of the last convolution's output over RMS of the input, at init."""
    torch.manual_seed(seed)
    with torch.no_grad():
        y = AllConv(fmt, init).features(x)
    return (y.pow(2).mean() / x.pow(2).mean()).sqrt().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=("digits", "fashion"), default="digits")
    parser.add_argument("--epochs", type=int, default=40, help="digits only")
    parser.add_argument("--steps", type=int, default=600, help="Fashion-MNIST only")
    parser.add_argument("--smoke", action="store_true",
                        help="init scales of TR and Odd (fashion: on a slice, and 10 steps)")
    args = parser.parse_args(argv)
    started = time.time()
    on_digits = args.data == "digits"
    if on_digits:
        data = digits(images=True)
    else:
        data = fashion(600, 300) if args.smoke else fashion()
    fmts = ("tr", "odd") if args.smoke else FORMATS
    steps = 10 if args.smoke else args.steps
    rows, curves = [], {}
    for fmt in progress(fmts, "formats"):
        inits = ("kaiming-in",) if fmt == "dense" else INITS
        scales = {i: init_scale(fmt, i, data[2][:1000]) for i in inits}
        accs = {}
        for init in inits if not (args.smoke and on_digits) else ():
            torch.manual_seed(0)
            net = AllConv(fmt, init)
            sgd = partial(torch.optim.SGD, lr=5e-3, momentum=0.9, weight_decay=5e-4)
            if on_digits:
                hist = train(net, data, sgd, epochs=args.epochs, batch=128, seed=0)
            else:
                hist = train_steps(net, data, sgd, steps=steps, batch=128, seed=0,
                                   evals=min(20, steps))
            accs[init] = hist.final_acc
            curves[(fmt, init)] = hist.test_acc
        params = sum(p.numel() for p in AllConv(fmt, inits[0]).parameters())
        rows.append([fmt, f"{params:,}"] + [
            f"{accs[i]:.3f}" if i in accs else ("-" if i not in scales else "")
            for i in INITS] + [f"{scales[i]:.2g}" if i in scales else "-" for i in INITS])
    header = ["format", "params"] + [f"acc {i}" for i in INITS] + \
        [f"scale at init, {i}" for i in INITS]
    text = markdown_table(header, rows)
    print(text)
    if not args.smoke:
        name = "allconv" + ("" if on_digits else "_fashion")
        if on_digits:
            title, setup = "digits", f"{args.epochs} epochs"
        else:
            title = "Fashion-MNIST (28 x 28)"
            setup = f"{steps:,} steps ({steps * 128 / 60000:.1f} epochs of 60,000 images)"
        _plot(curves, name, "epoch" if on_digits else f"step / {steps // 20}")
        print(save(name, f"# Tensorial All-Conv without batch norm, {title}\n\n"
                   f"SGD lr 5e-3, momentum 0.9, weight decay 5e-4, batch 128, {setup}; test "
                   "accuracy at the end (chance is 0.1). Scale at init: "
                   "RMS of the last convolution's output over the input's. The dense row uses "
                   f"torch's Kaiming (fan-in).\n\n{text}\n\n![test accuracy]"
                   f"({name}.png)", started))
    return 0


def _plot(curves: dict[tuple[str, str], list[float]], name: str, xlabel: str) -> None:
    pyplot = plt()
    fmts = [f for f in FORMATS if f != "dense"]
    fig, axes = pyplot.subplots(2, 5, figsize=(15, 5.5), sharex=True, sharey=True)
    for ax, fmt in zip(axes.flat, fmts):
        ax.plot(curves[("dense", "kaiming-in")], color="grey", lw=0.8, label="dense, Kaiming")
        for k, init in enumerate(INITS):
            ax.plot(curves[(fmt, init)], f"C{k}", label=init)
        ax.set_title(fmt)
    axes[0, 0].set_ylabel("test accuracy")
    axes[1, 0].set_ylabel("test accuracy")
    axes[0, 0].legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel(xlabel)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=80)


if __name__ == "__main__":
    raise SystemExit(main())
