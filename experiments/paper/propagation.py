"""Activation propagation (paper section 4.1.1, Fig. 6): Linear-5 against Odd-5.

Five tanh layers on the digits (64 = 8 x 8 features -> 100 -> 100 -> 100 -> 100 -> 10): Linear-5
is dense with Xavier; Odd-5 tensorizes every layer as the Odd-like network of
examples/odd.tn ((8 x 8) -> (10 x 10) -> ... -> (2 x 5), every rank 5), with a hyperedge phi = 1
(none) or 4, initialized with Xavier per core, orthogonal per core, Graph-in or Graph-out. The
paper's scale: MNIST, 784 -> 500 hidden units, 80 epochs; here 100 hidden units, 60 epochs.

    python -m experiments.paper.propagation      # histograms at init, training curves (minutes)
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from tnspec import formats

from ..common import RESULTS, History, digits, markdown_table, plt, progress, save, train

MODES = ((8, 8), (10, 10), (10, 10), (10, 10), (10, 10), (2, 5))
INITS = ("xavier", "orthogonal", "graph-in", "graph-out")


def linear5(width: int = 100) -> nn.Sequential:
    """The dense baseline, Xavier-normal weights and zero biases."""
    sizes = [64] + [width] * 4 + [10]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        lin = nn.Linear(a, b)
        nn.init.xavier_normal_(lin.weight)
        nn.init.zeros_(lin.bias)
        layers += [lin] + ([nn.Tanh()] if i < 4 else [])
    return nn.Sequential(*layers)


def odd5(init: str, phi: int, rank: int = 5, modes=MODES) -> nn.Sequential:
    """Five Odd-like tensorized linear layers with tanh between them."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(modes, modes[1:])):
        fmt = formats.odd(a[0] * a[1], b[0] * b[1], (), in_modes=a, out_modes=b, rank=rank,
                          phi=phi if phi > 1 else None)
        last = i == len(modes) - 2
        layers.append(fmt.layer(init=init, activation="linear" if last else "tanh"))
        layers += [] if last else [nn.Tanh()]
    return nn.Sequential(*layers)


def activations(model: nn.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    """The output of every tanh, in order."""
    out = []
    with torch.no_grad():
        for module in model:
            x = module(x)
            if isinstance(module, nn.Tanh):
                out.append(x.flatten())
    return out


def saturation(acts: list[torch.Tensor], threshold: float = 0.99) -> list[float]:
    """Per layer, the fraction of tanh outputs with |a| > threshold."""
    return [(a.abs() > threshold).float().mean().item() for a in acts]


def models(phi: int, seed: int, **kw) -> dict[str, nn.Sequential]:
    out = {}
    torch.manual_seed(seed)
    out["Xavier (Linear-5)"] = linear5()
    for init in INITS:
        torch.manual_seed(seed)
        out[f"{init} (Odd-5)"] = odd5(init, phi, **kw)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--smoke", action="store_true", help="init statistics only")
    args = parser.parse_args(argv)
    started = time.time()
    data = digits()
    rows, curves, hists = [], {}, {}
    for phi in (1, 4):
        for name, model in models(phi, seed=0).items():
            if phi == 4 and name.startswith("Xavier (Linear"):
                continue
            acts = activations(model, data[2])
            hists[(phi, name)] = acts
            sat = saturation(acts)
            hist = History()
            if not args.smoke:
                for _ in progress(range(1), f"phi={phi} {name}"):
                    torch.manual_seed(1)
                    hist = train(model, data, lambda p: torch.optim.Adam(p, lr=1e-4),
                                 epochs=args.epochs, batch=20, seed=1)
                curves[(phi, name)] = hist
            rows.append([name, phi, max(sat), acts[-1].std().item(),
                         hist.final_acc if hist.test_acc else "-",
                         max(hist.test_acc) if hist.test_acc else "-"])
    text = markdown_table(["model (init)", "phi", "saturated share, worst layer",
                           "std of layer 4's tanh", "final test acc", "best test acc"], rows)
    print(text)
    if not args.smoke:
        _plot(hists, curves)
        print(save("propagation", "# Activation propagation, Linear-5 vs Odd-5 (tanh)\n\n"
                   "Saturated share: the fraction of tanh outputs with |a| > 0.99 at init "
                   f"(test set).\nAdam, lr 1e-4, batch 20, {args.epochs} epochs.\n\n{text}\n\n"
                   "![histograms](propagation_hist.png)\n![curves](propagation_curves.png)",
                   started))
    return 0


def _plot(hists, curves) -> None:
    pyplot = plt()
    keys = list(hists)
    fig, axes = pyplot.subplots(len(keys), 4, figsize=(12, 1.6 * len(keys)), sharex=True)
    for row, key in zip(axes, keys):
        for layer, ax in enumerate(row):
            ax.hist(hists[key][layer].numpy(), bins=50, range=(-1, 1), color="C0")
            ax.set_yticks([])
            if layer == 0:
                ax.set_ylabel(f"{key[1]}\nphi={key[0]}", fontsize=7, rotation=0, ha="right")
    for layer, ax in enumerate(axes[0]):
        ax.set_title(f"tanh {layer + 1}")
    fig.tight_layout()
    fig.savefig(RESULTS / "propagation_hist.png", dpi=80)
    fig, axes = pyplot.subplots(1, 2, figsize=(11, 4))
    for phi, ax in zip((1, 4), axes):
        for (p, name), hist in curves.items():
            if p == phi or name.startswith("Xavier (Linear"):
                ax.plot(range(1, len(hist.test_acc) + 1), hist.test_acc, label=name)
        ax.set_title(f"test accuracy, phi = {phi}")
        ax.set_xlabel("epoch")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "propagation_curves.png", dpi=80)


if __name__ == "__main__":
    raise SystemExit(main())
