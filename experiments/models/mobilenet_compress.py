"""MobileNetV2's 1x1 convs compressed to 25%, 50% and 75% of their parameters: ``tnspec.compress``
with data (by default every layer at the budget's share; and with ``shares=SHARES``, a rank
per layer by its sensitivity, the default before) against per-layer
truncated SVD (weight-only) and activation-aware SVD (the SVD of
``W`` whitened by the inputs' second moment, as SVD-LLM and ASVD do), each at the same
parameters, in one run. Measured by the accuracy of a logistic-regression probe on the frozen
pooled features (Fashion-MNIST at 96x96: 3,000 training images, the 10,000 test images, so that
a point is about 25 of the 1,000 images a 3-sigma difference needs; ``mobilenet_fashion`` used
1,000). The data-aware methods see the first 256 training images (8 batches of 32), and
``compress`` keeps the pooled features (``run=``), which the probe reads.

    python -m experiments.models.mobilenet_compress          # ~16 min on 2 cores
    python -m experiments.models.mobilenet_compress --smoke
    python -m experiments.models.mobilenet_compress --heal --budgets 0.5   # healing: ~6 min
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import tnspec

from .. import assets
from . import mobilenet
from .mobilenet_fashion import _pooled, params_of, pointwise, probe
from ..common import formats_chosen, markdown_table, save, svd_factors

FORMATS = ("low_rank", "cp", "tucker2", "tt", "tr")
SHARES = tnspec.workflows.convert.compress.SHARES  # the grid that was the default before


def second_moments(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per 1x1 conv: the second moment of the channels that reach it, summed over pixels."""
    sums: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(_: nn.Module, args: tuple) -> None:
            x = args[0].double()
            sums[name] = sums.get(name, 0) + torch.einsum("bchw,bdhw->cd", x, x)
        return record
    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
               if pointwise(n, m)]
    try:
        with torch.no_grad():
            for x in batches:
                model(x)
    finally:
        for h in handles:
            h.remove()
    return sums


def svd(model: nn.Module, budget: float, moments: dict[str, torch.Tensor] | None) -> nn.Module:
    """A copy of ``model`` with each 1x1 conv two 1x1 convs at the rank that holds ``budget``
    of its parameters: the truncated SVD of its weight, or with ``moments``, of its weight
    whitened by its inputs' second moment ``S`` (``W S`` truncated, then ``S^-1`` folded back:
    activation-aware SVD). Written here from scratch, apart from tnspec."""
    model = copy.deepcopy(model)
    for name, conv in list(model.named_modules()):
        if not pointwise(name, conv):
            continue
        out, inp = conv.out_channels, conv.in_channels
        rank = max(1, int(budget * out * inp // (out + inp)))
        a, b = svd_factors(conv.weight.detach().reshape(out, inp),
                           None if moments is None else moments[name], rank)
        first = nn.Conv2d(inp, rank, 1, bias=False)
        second = nn.Conv2d(rank, out, 1, bias=conv.bias is not None)
        with torch.no_grad():
            first.weight.copy_(a.reshape(rank, inp, 1, 1))
            second.weight.copy_(b.reshape(out, rank, 1, 1))
            if conv.bias is not None:
                second.bias.copy_(conv.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, nn.Sequential(first, second))
    return model


def replaced_params(model: nn.Module) -> int:
    """Parameters of the layers standing where the 1x1 convs were."""
    def standing(name: str, m: nn.Module) -> bool:
        return isinstance(m, tnspec.Layer) or (
            pointwise(name, m) and not isinstance(m, nn.Sequential))
    return params_of(model, standing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version")
    parser.add_argument("--budgets", type=float, nargs="+", default=(0.25, 0.5, 0.75))
    parser.add_argument("--heal", action="store_true",
                        help="compress by default, and with sequential=True and heal=200, "
                             "written to results/mobilenet_compress_heal.md")
    args = parser.parse_args(argv)
    started = time.time()
    n_train, n_test, size = (64, 64, 32) if args.smoke else (3000, 10000, 96)
    images, labels = assets.fashion_mnist("train", n_train)
    test_images, test_labels = assets.fashion_mnist("test", n_test)
    data = (mobilenet.fashion_inputs(images, size), labels,
            mobilenet.fashion_inputs(test_images, size), test_labels)
    model = mobilenet.pretrained()
    batches = [data[0][i:i + 32] for i in range(0, min(256, n_train), 32)]
    moments = second_moments(model, batches)
    rows = [("original", "-", f"{params_of(model):,}", f"{probe(model, data):.4f}", "-")]
    notes = []
    formats = FORMATS[:2] if args.smoke else FORMATS
    for budget in args.budgets:
        methods = {"truncated SVD (weight-only)": None, "activation-aware SVD": None,
                   "tnspec.compress with data (default: each layer at the budget)": {},
                   "tnspec.compress with data, shares=SHARES (a rank per layer)":
                   {"shares": SHARES}}
        if args.heal:
            methods = {"tnspec.compress with data (default)": {},
                       "tnspec.compress with data, sequential, healed (200 steps)":
                       {"sequential": True, "heal": 2 if args.smoke else 200}}
        for label, more in methods.items():
            t = time.time()
            if more is not None:
                small, report = tnspec.compress(copy.deepcopy(model), budget, data=batches,
                                                include=pointwise, formats=formats,
                                                run=_pooled, max_seconds=240, **more)
                notes.append(f"- {label}, {budget:.0%}: {report.unfitted} candidates left "
                             f"unfitted; chose {formats_chosen(report)}"
                             + "".join(f"; {line.strip()}" for line in str(report).splitlines()
                                       if line.strip().startswith(("sequential:", "healed:"))))
            else:
                small = svd(model, budget, moments if label.startswith("activation") else None)
            seconds = time.time() - t
            rows.append((label, f"{budget:.0%}", f"{replaced_params(small):,}",
                         f"{probe(small, data):.4f}", f"{seconds:.0f}"))
            print(rows[-1], flush=True)
    text = ("# MobileNetV2 compressed: Fashion-MNIST probe at three budgets\n\n"
            f"ImageNet MobileNetV2, its 34 1x1 convs compressed; {n_train:,} training / "
            f"{n_test:,} test images at {size}x{size}; a logistic-regression probe on the "
            "standardized pooled features; the data-aware methods see the first 256 training "
            "images. Parameters: the layers standing where the 1x1 convs were.\n\n"
            + markdown_table(["method", "budget", "parameters", "probe accuracy",
                              "seconds to compress"], rows)
            + "\n\ncompress (max_seconds=240, keeping the pooled features):\n"
            + "\n".join(notes))
    print(text)
    if not args.smoke:
        name = "mobilenet_compress_heal" if args.heal else "mobilenet_compress"
        print(f"wrote {save(name, text, started)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
