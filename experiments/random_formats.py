"""Random formats (paper section 4.1.2): Conv-4 nets whose four layers come from the random
generator, trained on the digits with each initialization.

Every round draws four layers with ``tnspec.formats.random`` (4-8 vertices, random rank edges,
a hyperedge phi with probability 1/2), chained (1) -> (4 x 4) -> (4 x 4) -> (4 x 4) -> (2 x 5)
channels (the first layer has a single input mode: the digits are grayscale), 3 x 3 kernels,
'same' padding, tanh, then a global average pool gives the 10 logits. Each net is trained with
Graph-in, Graph-out, Xavier per core and orthogonal per core; Adam, lr 1e-4, batch 128. The
paper: MNIST 28 x 28, 20 epochs (9,380 steps); here 8 x 8 digits, 60 epochs (720 steps).

    python -m experiments.random_formats   # 30 rounds x 4 inits (minutes)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

from tnspec import formats

from .common import RESULTS, digits, markdown_table, plt, progress, save, train

INITS = ("graph-in", "graph-out", "xavier", "orthogonal")
CHANNELS = ((1,), (4, 4), (4, 4), (4, 4), (2, 5))


class Conv4(nn.Sequential):
    """Four random tensorial conv layers, tanh between them, global average pool."""

    def __init__(self, round: int, init: str) -> None:
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(CHANNELS, CHANNELS[1:])):
            last = i == len(CHANNELS) - 2
            fmt = formats.random(1000 * round + i, in_modes=a, out_modes=b)
            layers.append(fmt.layer(init=init, activation="linear" if last else "tanh"))
            layers.append(nn.Flatten(2) if last else nn.Tanh())
        super().__init__(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).mean(-1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output at every position, before the pool."""
        return super().forward(x)


def init_std(round: int, init: str, x: torch.Tensor) -> float:
    """The std of the last layer's output at init, over the test images (input std 1)."""
    torch.manual_seed(round)
    with torch.no_grad():
        return Conv4(round, init).features(x).std().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--smoke", action="store_true", help="init statistics of 3 rounds")
    args = parser.parse_args(argv)
    started = time.time()
    data = digits(images=True)
    rounds = 3 if args.smoke else args.rounds
    stds = {init: [init_std(r, init, data[2]) for r in range(rounds)] for init in INITS}
    acc: dict[str, list[float]] = {init: [] for init in INITS}
    curves: dict[str, list[list[float]]] = {init: [] for init in INITS}
    if not args.smoke:
        for r in progress(range(rounds), "rounds"):
            for init in INITS:
                torch.manual_seed(r)
                hist = train(Conv4(r, init), data, lambda p: torch.optim.Adam(p, lr=1e-4),
                             epochs=args.epochs, batch=128, seed=r)
                acc[init].append(hist.final_acc)
                curves[init].append(hist.train_loss)
    rows = []
    for init in INITS:
        s = np.array(stds[init])
        row = [init, f"{np.median(s):.3g} [{s.min():.2g}, {s.max():.2g}]"]
        if acc[init]:
            a = np.array(acc[init])
            row += [f"{a.mean():.3f} ± {a.std():.3f}", f"{np.median(a):.3f}", f"{a.min():.3f}",
                    int((a > 0.5).sum())]
        rows.append(row)
    header = ["init", "last layer std at init: median [min, max]"]
    header += [] if args.smoke else ["final test acc: mean ± std", "median", "worst",
                                     f"nets > 50% (of {rounds})"]
    text = markdown_table(header, rows)
    print(text)
    if not args.smoke:
        _plot(acc, curves)
        print(save("random_formats", f"# Random formats: Conv-4 on digits, {rounds} random nets "
                   f"x 4 inits\n\nAdam, lr 1e-4, batch 128, {args.epochs} epochs.\n\n{text}\n\n"
                   "![accuracy and loss](random_formats.png)", started))
    return 0


def _plot(acc, curves) -> None:
    pyplot = plt()
    fig, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4))
    left.boxplot([acc[i] for i in INITS], tick_labels=list(INITS))
    left.set_title("final test accuracy per random net")
    for k, init in enumerate(INITS):
        loss = np.array(curves[init], dtype=float)
        right.plot(np.arange(1, loss.shape[1] + 1), np.nanmedian(loss, 0), f"C{k}", label=init)
        right.fill_between(np.arange(1, loss.shape[1] + 1), np.nanpercentile(loss, 25, 0),
                           np.nanpercentile(loss, 75, 0), color=f"C{k}", alpha=0.2)
    right.set_title("training loss: median and quartiles over nets")
    right.set_xlabel("epoch")
    right.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "random_formats.png", dpi=80)


if __name__ == "__main__":
    raise SystemExit(main())
