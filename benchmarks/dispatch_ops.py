"""Ops dispatched per training step (forward and backward), counted with a
``TorchDispatchMode``: on a GPU every op is host time, so a step of small layers is bound by how
many ops it dispatches. The count does not depend on the device, so it is measured here, on the
CPU, at batch 2.

    python benchmarks/dispatch_ops.py            # seconds

A ResNet-18 of torchvision's architecture (100 classes, 64x64 input; defined here, since
torchvision's CPU wheel does not install beside torch's) dense, with every 3x3 conv but the stem
and the downsampling ones written by hand as three convs (1x1, 3x3, 1x1) at the ranks tnspec
gives it, and tensorized with ``tucker2`` at 25% of their parameters; then one 64-channel layer
per format against the hand-written Tucker-2. Channel mixing is forced to 1x1 convolutions (the
op a GPU is expected to choose) and calibration is off, so that the count does not depend on
this machine's measurements.
"""

from __future__ import annotations

import collections
import copy
import os

os.environ.setdefault("TNSPEC_CALIBRATE", "0")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import tnspec  # noqa: E402


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class BasicBlock(nn.Module):
    def __init__(self, c: int, o: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, o, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(o)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(o, o, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(o)
        self.downsample = None
        if stride != 1 or c != o:
            self.downsample = nn.Sequential(nn.Conv2d(c, o, 1, stride, bias=False),
                                            nn.BatchNorm2d(o))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + identity)


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` architecture (module names included)."""

    def __init__(self, classes: int = 100) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c = 64
        for i, (o, stride) in enumerate(((64, 1), (128, 2), (256, 2), (512, 2))):
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(c, o, stride),
                                                         BasicBlock(o, o, 1)))
            c = o
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def step_ops(module: nn.Module, x: torch.Tensor) -> int:
    """Ops of one forward and backward, gradients unset as ``zero_grad()`` leaves them, the
    gradient contiguous as a next layer gives it; after a warm-up step."""
    y = module(x)
    g = torch.randn_like(y)
    y.backward(g)
    module.zero_grad(set_to_none=True)
    with Count() as counted:
        module(x).backward(g)
    module.zero_grad(set_to_none=True)
    return sum(counted.ops.values())


def by_hand(layer: tnspec.Layer) -> nn.Module:
    """A tucker2 layer written as three convs at its ranks."""
    s = layer.sizes
    return nn.Sequential(nn.Conv2d(s["c"], s["r0"], 1, bias=False),
                         nn.Conv2d(s["r0"], s["r1"], layer.kernel_size, layer.stride,
                                   layer.padding, bias=False),
                         nn.Conv2d(s["r1"], s["o"], 1, bias=layer.bias is not None))


def main() -> int:
    calibration = tnspec.planning.calibration
    chooser = calibration.chooser
    calibration.chooser = lambda *a, **k: lambda step: "conv1x1"
    try:
        table()
    finally:
        calibration.chooser = chooser
    return 0


def flattened_1x1(model: nn.Module) -> nn.Module:
    """``model`` with its tnspec layers running the form ``torch.compile`` traces, eagerly: 1x1
    convs 1-D over the flattened spatial axes, as every eager call ran before issue 58."""
    for m in model.modules():
        if isinstance(m, tnspec.Layer):
            m._class = lambda shape, last=False, m=m: tnspec.emit.runtime.layer_class(
                m.network, m.plan(shape), last, compiled=True)
    return model


def table() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    dense = ResNet18()

    def chosen(name: str, m: nn.Module) -> bool:  # stem, downsampling and fc stay dense
        return isinstance(m, nn.Conv2d) and name != "conv1" and "downsample" not in name
    tensorized, _ = tnspec.tensorize(ResNet18(), "tucker2", rank=0.25, include=chosen)
    hand = ResNet18()
    for name, m in tensorized.named_modules():
        if isinstance(m, tnspec.Layer):
            parent, _, child = name.rpartition(".")
            setattr(hand.get_submodule(parent), child, by_hand(m))
    print(f"torch {torch.__version__}, tnspec {tnspec.__version__}; batch 2, 64x64, "
          "channel mixing by 1x1 convs, calibration off\n")
    print("| ResNet-18 (100 classes) | parameters | ops per fwd+bwd |\n|---|---|---|")
    flat = flattened_1x1(copy.deepcopy(tensorized))
    for label, model in (("dense", dense), ("3 convs by hand (tucker2's ranks)", hand),
                         ("tnspec tucker2 at 25%", tensorized),
                         ("tnspec tucker2 at 25%, 1x1 convs flattened (before)", flat)):
        print(f"| {label} | {sum(p.numel() for p in model.parameters()):,} | "
              f"{step_ops(model, x):,} |")
    x = torch.randn(2, 64, 16, 16)
    layer = tnspec.formats.tucker2(64, 64, 3, rank=0.1, padding=1).layer()
    hand_ops = step_ops(by_hand(layer), x)
    print("\n| one 64->64 3x3 layer at 10% | ops per fwd+bwd | / by hand |\n|---|---|---|")
    print(f"| tucker2 by hand (3 convs) | {hand_ops} | 1.00 |")
    for fmt in ("low_rank", "cp", "tucker2", "tt", "tr"):
        ops = step_ops(tnspec.formats.build(fmt, 64, 64, 3, padding=1, rank=0.1).layer(), x)
        print(f"| tnspec {fmt} | {ops} | {ops / hand_ops:.2f} |")


if __name__ == "__main__":
    raise SystemExit(main())
