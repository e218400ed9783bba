"""MobileNetV2 (Sandler et al., 2018) with torchvision's module names, so that torchvision's
ImageNet weights load into it key for key (torchvision from the package index does not import
with the CPU build of torch used here, so the architecture is written out)."""

from __future__ import annotations

import torch
from torch import nn

#: (expansion t, output channels c, repeats n, first stride s), as in the paper's Table 2
SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
            (6, 160, 3, 2), (6, 320, 1, 1))


def conv_bn_relu(cin: int, cout: int, kernel: int = 3, stride: int = 1,
                 groups: int = 1) -> nn.Sequential:
    """torchvision's ``Conv2dNormActivation``: conv (no bias), BatchNorm, ReLU6."""
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups,
                                   bias=False), nn.BatchNorm2d(cout), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise (3x3), project (1x1, linear); a skip where shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers = [conv_bn_relu(cin, hidden, 1)] if expand != 1 else []
        layers += [conv_bn_relu(hidden, hidden, 3, stride, groups=hidden),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)
        self.use_res_connect = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return x + y if self.use_res_connect else y


class MobileNetV2(nn.Module):
    """``features`` (the 19 blocks), global average pooling, ``classifier`` (dropout, linear)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        blocks: list[nn.Module] = [conv_bn_relu(3, 32, 3, 2)]
        cin = 32
        for t, c, n, s in SETTINGS:
            for i in range(n):
                blocks.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        blocks.append(conv_bn_relu(cin, 1280, 1))
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, classes))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The pooled 1,280 features."""
        return self.features(x).mean((2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.embed(x))


def pretrained() -> MobileNetV2:
    """MobileNetV2 with torchvision's ImageNet weights (every key matched), in eval mode."""
    from ..assets import mobilenet_weights
    model = MobileNetV2()
    model.load_state_dict(mobilenet_weights(), strict=True)
    return model.eval()


#: ImageNet's channel means and stds, as torchvision normalizes
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def fashion_inputs(images: torch.Tensor, size: int = 96) -> torch.Tensor:
    """Fashion-MNIST's uint8 ``(N, 28, 28)`` as the network's inputs: resized to ``size``,
    repeated to 3 channels, normalized as for ImageNet."""
    x = images.float().div(255).unsqueeze(1)
    x = nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = x.expand(-1, 3, -1, -1)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    return (x - mean) / std
