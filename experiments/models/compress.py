"""Compressing trained models to a parameter budget: ``tnspec.compress`` (with and without data)
against one format for every layer (``tensorize(..., weights="fit")``) and TensorLy-Torch's
``FactorizedConv.from_conv``, on scikit-learn's digits.

Two models are trained on the digits (Adam, lr 1e-3, 15 epochs): the CNN of
``experiments.models.decompose`` (conv 1->32, 32->64, pool, 64->64, linear 1024->10; 0.07 M
parameters) and a ResNet-18-like net at half width (the ResNet-18 layout, 32-64-128-256
channels, batch norm, for 1-channel 8x8 images; 2.8 M parameters). Every conv and linear layer
but the stem is then compressed to 10%, 25% and 50% of its parameters:

- ``compress``: formats tucker2, tt, tr, cp at shares 5-75% per layer, chosen per layer;
  "data": fitted to the layers' outputs on 256 training images, "no data": to the weights;
- uniform: one format at the budget's share in every layer, fitted to the weights;
- TensorLy-Torch: ``FactorizedConv.from_conv(rank=budget, factorization="cp"/"tucker")`` for
  the convs (the linear head stays dense, so these hold slightly more parameters).

Test accuracy right after, and after one epoch of fine-tuning (Adam, lr 1e-3; the same for
all). Also, per layer of the CNN: the held-out output error of a data-aware fit against a
weight-only one (tucker2 at 25%, fitted on training activations, measured on test ones).

    python -m experiments.models.compress            # about 75 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
from torch import nn

import tnspec
from tnspec.workflows.convert.compress import SHARES

from ..common import digits, markdown_table, save, train
from .decompose import accuracy, cnn

BUDGETS = (0.1, 0.25, 0.5)
FORMATS = ("tucker2", "tt", "tr", "cp")


class Block(nn.Module):
    def __init__(self, c: int, o: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, o, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(o)
        self.conv2 = nn.Conv2d(o, o, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(o)
        self.shortcut = nn.Sequential()
        if stride != 1 or c != o:
            self.shortcut = nn.Sequential(nn.Conv2d(c, o, 1, stride, bias=False),
                                          nn.BatchNorm2d(o))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet18_half() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(1, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32),
                               nn.ReLU()]
    c = 32
    for o, stride in ((32, 1), (64, 2), (128, 2), (256, 2)):
        layers += [Block(c, o, stride), Block(o, o, 1)]
        c = o
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10)]
    return nn.Sequential(*layers)


def params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def tensorly(model: nn.Module, budget: float, factorization: str) -> nn.Module:
    import tltorch
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Conv2d) and name != "0":
            new = tltorch.FactorizedConv.from_conv(module, rank=budget,
                                                   factorization=factorization)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
    return model


def output_errors(model: nn.Module, data: tuple[torch.Tensor, ...]) -> list[tuple]:
    """Per layer: held-out output error of a weight-only and of a data-aware tucker2 fit."""
    def inputs_of(x: torch.Tensor) -> dict[str, torch.Tensor]:
        seen = {}
        hooks = [m.register_forward_pre_hook(
            lambda m, a, n=n: seen.__setitem__(n, a[0].detach()))
            for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        with torch.no_grad():
            model.eval()
            model(x)
        for h in hooks:
            h.remove()
        return seen
    train_in, test_in = inputs_of(data[0][:256]), inputs_of(data[2])
    rows = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Conv2d, nn.Linear)) or name == "0":
            continue
        errors = []
        for inputs in (None, train_in[name]):
            new = tnspec.formats.build(
                "tucker2", *((module.in_features, module.out_features, ())
                             if isinstance(module, nn.Linear) else
                             (module.in_channels, module.out_channels, module.kernel_size)),
                rank=0.25, **({} if isinstance(module, nn.Linear) else
                              {"padding": module.padding})).layer()
            new.fit_(module.weight.detach(), inputs=inputs)
            with torch.no_grad():
                x = test_in[name]
                y = module(x) - (0 if module.bias is None else
                                 module.bias.view(-1, *[1] * (x.dim() - 2)))
                y_fit = new(x)
            errors.append(float((y_fit - y).norm() / y.norm()))
        rows.append((name, f"{errors[0]:.4f}", f"{errors[1]:.4f}",
                     f"{errors[1] / errors[0]:.2f}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version (tests)")
    args = parser.parse_args(argv)
    started = time.time()
    data = digits(images=True)
    epochs, budgets = (15, BUDGETS) if not args.smoke else (1, (0.25,))
    fmts, shares = (FORMATS, SHARES) if not args.smoke else (("tucker2",), (0.25,))
    if args.smoke:
        data = tuple(t[:200] for t in data[:2]) + tuple(t[:100] for t in data[2:])
    models = (("CNN", cnn), ("ResNet-18-like (half width)", resnet18_half))
    text = ["# Compressing trained models to a budget (digits)\n",
            "Accuracy on the test digits right after compressing, and after one epoch of "
            "fine-tuning (Adam, lr 1e-3); parameters of the whole model; the time "
            "`compress` took.\n"]

    def adam(ps):
        return torch.optim.Adam(ps, lr=1e-3)
    for model_name, make in models[:1] if args.smoke else models:
        torch.manual_seed(0)
        dense = make()
        train(dense, data, adam, epochs=epochs, batch=64, seed=0)
        base = accuracy(dense, data)
        rows = []
        for budget in budgets:
            variants = {}
            for label, sample in (("compress, data", data[0][:256]), ("compress, no data", None)):
                began = time.time()
                model, report = tnspec.compress(copy.deepcopy(dense), budget, fmts,
                                                data=sample, exclude=["0"], shares=shares)
                variants[label] = (model, time.time() - began)
            for fmt in fmts:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model, _ = tnspec.tensorize(copy.deepcopy(dense), fmt, rank=budget,
                                                weights="fit", exclude=["0"],
                                                fit={"starts": 1, "hops": 0})
                variants[f"uniform {fmt}"] = (model, None)
            for factorization in ("cp", "tucker")[:1 if args.smoke else 2]:
                try:
                    model = tensorly(copy.deepcopy(dense), budget, factorization)
                    variants[f"TensorLy-Torch {factorization}"] = (model, None)
                except Exception as exc:  # where from_conv does not run, say why
                    print(f"TensorLy-Torch {factorization} at {budget}: {exc}")
            for label, (model, seconds) in variants.items():
                before = accuracy(model, data)
                after = train(model, data, adam, epochs=1, batch=64, seed=1).final_acc
                rows.append((f"{budget:.0%}", label, f"{params(model):,}", f"{before:.3f}",
                             f"{after:.3f}", "" if seconds is None else f"{seconds:.0f} s"))
                print(" | ".join(rows[-1]), flush=True)  # what is done, should a later part fail
        text += [f"\n## {model_name}: dense {params(dense):,} parameters, accuracy "
                 f"{base:.3f}\n",
                 markdown_table(["budget", "model", "parameters", "accuracy",
                                 "after 1 epoch", "compress time"], rows)]
        print("\n".join(text), flush=True)  # what is done so far, should a later part fail
        if model_name == "CNN":
            text += ["\nHeld-out output error per layer, tucker2 at 25%, fitted to the weight "
                     "or to 256 training images' activations:\n",
                     markdown_table(["layer", "weight-only fit", "data-aware fit", "ratio"],
                                    output_errors(dense, data))]
    out = "\n".join(text)
    print(out)
    if not args.smoke:
        save("compress", out, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
