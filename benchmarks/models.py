"""Whole networks for the speed benchmark, written here because torchvision's CPU wheel is not
available: a ResNet-18 and a MobileNetV2 of the CIFAR kind (32x32 inputs, 10 classes, the
stems adapted to small images as is usual), each dense and tensorized with ``tnspec.tensorize``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import tnspec


class BasicBlock(nn.Module):
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


def resnet18(classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU()]
    c = 64
    for o, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(c, o, stride), BasicBlock(o, o, 1)]
        c = o
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    def __init__(self, c: int, o: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(c, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()]
        layers += [nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
                   nn.BatchNorm2d(hidden), nn.ReLU6(),
                   nn.Conv2d(hidden, o, 1, bias=False), nn.BatchNorm2d(o)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and c == o

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


def mobilenet_v2(classes: int = 10) -> nn.Module:
    # (expansion, channels, repeats, stride) as in the paper, strides of the first two stages
    # set to 1 for 32x32 inputs
    settings = ((1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1))
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32),
                               nn.ReLU6()]
    c = 32
    for t, o, n, s in settings:
        for i in range(n):
            layers.append(InvertedResidual(c, o, s if i == 0 else 1, t))
            c = o
    layers += [nn.Conv2d(c, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6(),
               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, classes)]
    return nn.Sequential(*layers)


class TorchvisionBlock(nn.Module):
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
            setattr(self, f"layer{i + 1}", nn.Sequential(TorchvisionBlock(c, o, stride),
                                                         TorchvisionBlock(o, o, 1)))
            c = o
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def by_hand(layer: tnspec.Layer) -> nn.Module:
    """A tucker2 layer written as three convs at its ranks."""
    s = layer.sizes
    return nn.Sequential(nn.Conv2d(s["c"], s["r0"], 1, bias=False),
                         nn.Conv2d(s["r0"], s["r1"], layer.kernel_size, layer.stride,
                                   layer.padding, bias=False),
                         nn.Conv2d(s["r1"], s["o"], 1, bias=layer.bias is not None))


def written_by_hand(tensorized: nn.Module, dense: nn.Module) -> nn.Module:
    """A copy of ``dense`` with each layer that ``tensorized`` holds as a tucker2
    :class:`tnspec.Layer` written by hand as three convs at its ranks."""
    hand = copy.deepcopy(dense)
    for name, m in tensorized.named_modules():
        if isinstance(m, tnspec.Layer):
            parent, _, child = name.rpartition(".")
            setattr(hand.get_submodule(parent), child, by_hand(m))
    return hand


def _spatial(name: str, module: nn.Module) -> bool:
    """3x3 convolutions past the stem: the layers tensorized in ResNets."""
    return isinstance(module, nn.Conv2d) and module.kernel_size == (3, 3) and \
        module.in_channels > 3 and module.groups == 1


def _pointwise(name: str, module: nn.Module) -> bool:
    """1x1 convolutions: where MobileNetV2's parameters and most of its FLOPs are."""
    return isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1) and \
        module.groups == 1 and module.in_channels >= 64 and module.out_channels >= 64


def pair(name: str, share: float = 0.25, **options: Any) -> tuple[nn.Module, nn.Module, str]:
    """(dense, tensorized, what was tensorized) for ``name`` ("resnet18" or "mobilenet_v2"):
    each selected layer at ``share`` of its parameters, Tucker-2 for ResNet-18's 3x3 convs and
    low-rank for MobileNetV2's 1x1 convs (the same init seed). ``options`` go to
    ``tnspec.tensorize`` (``memory_format="auto", example=...``: its layout line is in
    "what")."""
    build, fmt, select = {"resnet18": (resnet18, "tucker2", _spatial),
                          "mobilenet_v2": (mobilenet_v2, "low_rank", _pointwise)}[name]
    torch.manual_seed(0)
    dense = build()
    torch.manual_seed(0)
    tensorized, report = tnspec.tensorize(build(), fmt, rank=share, include=select, **options)
    before = sum(p.numel() for p in dense.parameters())
    after = sum(p.numel() for p in tensorized.parameters())
    multiple = options.get("rank_multiple", 1)
    rounded = f", ranks rounded down to a multiple of {multiple}" if multiple > 1 else ""
    return dense, tensorized, (f"{fmt} at {share:.0%} of the params of each selected layer"
                               f"{rounded}: {before:,} -> {after:,} params" +
                               ("" if report.layout is None else f"\n{report.layout}"))
