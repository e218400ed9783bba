"""Random formats (paper section 4.1.2): Conv-4 nets whose four layers come from the random
generator, trained with each initialization, on the 8x8 digits or on Fashion-MNIST (28x28).

Every round draws four layers with ``tnspec.formats.random`` (4-8 vertices, random rank edges,
a hyperedge phi with probability 1/2), chained (1) -> (4 x 4) -> (4 x 4) -> (4 x 4) -> (2 x 5)
channels (the first layer has a single input mode: the images are grayscale), 3 x 3 kernels,
'same' padding, tanh, then a global average pool gives the 10 logits. Each net is trained with
Graph-in, Graph-out, Xavier per core and orthogonal per core; Adam, lr 1e-4, batch 128, as the
paper. The paper: MNIST 28 x 28, 20 epochs (9,380 steps), 150 rounds.

- digits: stride 1 throughout, 60 epochs of 1,437 images (720 steps), 30 rounds;
- Fashion-MNIST: the first two layers with stride 2 (28 -> 14 -> 7: 2.5x cheaper, and the pool
  sees 7 x 7 features), the paper's 9,380 steps (20 epochs of 60,000), 10 rounds.

    python -m experiments.paper.random_formats                  # digits: 30 rounds x 4 inits (~13 min)
    python -m experiments.paper.random_formats --data fashion   # 10 rounds x 4 inits (see README)
    python -m experiments.paper.random_formats --data fashion --smoke
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

from tnspec import formats

from ..common import RESULTS, digits, fashion, markdown_table, plt, progress, save, train, \
    train_steps

INITS = ("graph-in", "graph-out", "xavier", "orthogonal")
CHANNELS = ((1,), (4, 4), (4, 4), (4, 4), (2, 5))


class Conv4(nn.Sequential):
    """Four random tensorial conv layers, tanh between them, global average pool."""

    def __init__(self, round: int, init: str, strides: tuple[int, ...] = (1, 1, 1, 1)) -> None:
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(CHANNELS, CHANNELS[1:])):
            last = i == len(CHANNELS) - 2
            fmt = formats.random(1000 * round + i, in_modes=a, out_modes=b, stride=strides[i])
            layers.append(fmt.layer(init=init, activation="linear" if last else "tanh"))
            layers.append(nn.Flatten(2) if last else nn.Tanh())
        super().__init__(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).mean(-1)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output at every position, before the pool."""
        return super().forward(x)


def init_std(round: int, init: str, x: torch.Tensor,
             strides: tuple[int, ...] = (1, 1, 1, 1)) -> float:
    """The std of the last layer's output at init, over the test images (input std 1)."""
    torch.manual_seed(round)
    with torch.no_grad():
        return Conv4(round, init, strides).features(x).std().item()


STRIDES = {"digits": (1, 1, 1, 1), "fashion": (2, 2, 1, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=("digits", "fashion"), default="digits")
    parser.add_argument("--rounds", type=int, help="random nets (digits 30, fashion 10)")
    parser.add_argument("--epochs", type=int, default=60, help="digits only")
    parser.add_argument("--steps", type=int, default=9380, help="Fashion-MNIST only")
    parser.add_argument("--smoke", action="store_true",
                        help="init statistics of 3 rounds (fashion: a slice, and 20 steps)")
    args = parser.parse_args(argv)
    started = time.time()
    on_digits = args.data == "digits"
    strides = STRIDES[args.data]
    if on_digits:
        data = digits(images=True)
    else:
        data = fashion(600, 300) if args.smoke else fashion()
    rounds = 3 if args.smoke else args.rounds or (30 if on_digits else 10)
    steps = 20 if args.smoke else args.steps
    probe = data[2][:1000]
    stds = {init: [init_std(r, init, probe, strides) for r in range(rounds)] for init in INITS}
    acc: dict[str, list[float]] = {init: [] for init in INITS}
    curves: dict[str, list[list[float]]] = {init: [] for init in INITS}
    trained = [] if args.smoke and on_digits else range(1 if args.smoke else rounds)
    for r in progress(trained, "rounds"):
        for init in INITS:
            torch.manual_seed(r)
            net, adam = Conv4(r, init, strides), lambda p: torch.optim.Adam(p, lr=1e-4)
            if on_digits:
                hist = train(net, data, adam, epochs=args.epochs, batch=128, seed=r)
            else:
                hist = train_steps(net, data, adam, steps=steps, batch=128, seed=r,
                                   evals=min(20, steps))
            acc[init].append(hist.final_acc)
            curves[init].append(hist.train_loss)
    text = markdown_table(*_table(stds, acc, rounds))
    print(text)
    if not args.smoke:
        name = "random_formats" + ("" if on_digits else "_fashion")
        if on_digits:
            title, setup = "digits", f"Adam, lr 1e-4, batch 128, {args.epochs} epochs."
        else:
            title = "Fashion-MNIST (28 x 28)"
            setup = (f"Adam, lr 1e-4, batch 128, {steps:,} steps ({steps * 128 / 60000:.0f} "
                     "epochs of 60,000 images); strides 2, 2, 1, 1; test accuracy on the 10,000 "
                     "test images.")
        _plot(acc, curves, name, "epoch" if on_digits else f"step / {steps // 20}")
        print(save(name, f"# Random formats: Conv-4 on {title}, {rounds} random nets x 4 inits"
                   f"\n\n{setup}\n\n{text}\n\n![accuracy and loss]({name}.png)", started))
    return 0


def _table(stds: dict[str, list[float]], acc: dict[str, list[float]], rounds: int):
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
    if any(acc.values()):
        header += ["final test acc: mean ± std", "median", "worst",
                   f"nets > 50% (of {len(acc[INITS[0]])})"]
    return header, rows


def _plot(acc, curves, name: str, xlabel: str) -> None:
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
    right.set_xlabel(xlabel)
    right.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=80)


if __name__ == "__main__":
    raise SystemExit(main())
