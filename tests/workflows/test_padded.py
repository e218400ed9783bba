"""Convs whose own forward pads "same" or standardizes the weight, as checkpoints ported from
TensorFlow (EfficientNet-PyTorch, timm's ``Conv2dSame``) and BiT hold them: read as the plain
conv they compute, by every workflow, with the pad kept around the new layer. The local
definitions below follow those libraries' forwards."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tnspec
from tnspec.workflows.dense_layers import check_forward
from tnspec.workflows.padded import Padded

from ..model_state import snapshot, unchanged


def _tf_same(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    pads = []
    for n, k, s, d in zip(reversed(x.shape[-2:]), reversed(conv.kernel_size),
                          reversed(conv.stride), reversed(conv.dilation)):
        total = max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads)


def _standardized(conv: nn.Conv2d) -> torch.Tensor:
    """timm's ``StdConv2d``: a batch norm over each output channel's weights."""
    return F.batch_norm(conv.weight.reshape(1, conv.out_channels, -1), None, None,
                        training=True, momentum=0.0, eps=conv.eps).reshape_as(conv.weight)


class DynamicSame(nn.Conv2d):
    """timm's ``Conv2dSame``: TensorFlow's "same" worked out for each input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(_tf_same(x, self), self.weight, self.bias, self.stride, 0,
                        self.dilation, self.groups)


class StaticSame(nn.Conv2d):
    """EfficientNet-PyTorch's ``Conv2dStaticSamePadding``: "same" worked out once, for
    ``image_size``, as a ``ZeroPad2d`` module."""

    def __init__(self, i: int, o: int, k: int, stride: int = 1, image_size: int = 224,
                 **kwargs) -> None:
        super().__init__(i, o, k, stride, **kwargs)
        k, s, d = self.kernel_size[0], self.stride[0], self.dilation[0]
        total = max((math.ceil(image_size / s) - 1) * s + (k - 1) * d + 1 - image_size, 0)
        half = (total // 2, total - total // 2)
        self.static_padding = nn.ZeroPad2d((*half, *half)) if total else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(self.static_padding(x), self.weight, self.bias, self.stride,
                        self.padding, self.dilation, self.groups)


class StdConv(nn.Conv2d):
    """timm's ``StdConv2d``."""

    def __init__(self, *args, eps: float = 1e-6, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, _standardized(self), self.bias, self.stride, self.padding,
                        self.dilation, self.groups)


class BitConv(nn.Conv2d):
    """BiT's ``StdConv2d``: its own variance, epsilon 1e-10, no ``eps`` attribute."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v, m = torch.var_mean(self.weight, dim=[1, 2, 3], keepdim=True, unbiased=False)
        return F.conv2d(x, (self.weight - m) / torch.sqrt(v + 1e-10), self.bias, self.stride,
                        self.padding, self.dilation, self.groups)


class StdSame(StdConv):
    """timm's ``StdConv2dSame``: both."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(_tf_same(x, self), _standardized(self), self.bias, self.stride, 0,
                        self.dilation, self.groups)


class Gained(nn.Conv2d):
    """A learned gain per output channel in forward: no reading known, skipped."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.rand(self.out_channels, 1, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight * self.gain, self.bias)


@pytest.mark.parametrize("make, pad, standardized", [
    (lambda: DynamicSame(6, 8, 3, stride=2), "TensorFlow's 'same' pad", False),
    (lambda: DynamicSame(6, 8, 2), "a fixed pad (0, 1, 0, 1)", False),  # even kernel, stride 1
    (lambda: StaticSame(6, 8, 3, stride=2), "a fixed pad (0, 1, 0, 1)", False),
    (lambda: StaticSame(6, 8, 5, stride=2), "a fixed pad (1, 2, 1, 2)", False),
    (lambda: StaticSame(6, 8, 5, stride=2, image_size=7), None, False),  # symmetric: (2, 2)
    (lambda: StdConv(6, 8, 3, padding=1), None, True),
    (lambda: BitConv(6, 8, 3, stride=2, padding=1), None, True),
    (lambda: StdSame(6, 8, 3, stride=2, eps=1e-8), "TensorFlow's 'same' pad", True),
])
def test_each_known_forward_is_read_as_the_plain_conv_it_computes(make, pad, standardized):
    """The reading is found on inputs of two sizes and holds on sizes it never saw."""
    torch.manual_seed(0)
    conv = make()
    read = check_forward(conv)
    assert type(read.layer) is nn.Conv2d and read.standardized == standardized
    assert (read.pad is None) == (pad is None) and (pad is None or str(read.pad).startswith(pad))
    assert (read.layer.weight is conv.weight) != standardized  # a copy only where standardized
    plain = read.base(conv) if read.pad is None else read.around(read.layer)
    for size in (11, 24, 31):
        x = torch.randn(2, 6, size, size + 3)
        with torch.no_grad():
            want = conv(x)
            got = read.around(read.layer)(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert plain(x).shape == want.shape


def test_a_forward_no_reading_computes_is_skipped_saying_so():
    with pytest.raises(tnspec.SpecError, match=r"Gained overrides forward: a layer of its weight "
                       r"would not compute what it does \(no 'same' pad or weight "
                       r"standardization found that computes it\)"):
        check_forward(Gained(6, 8, 3, padding=1))
    net = nn.Sequential(Gained(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    _, report = tnspec.tensorize(net, "tucker2", rank=0.5)
    assert "Gained overrides forward" in dict(report.skipped)["0"]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(DynamicSame(3, 16, 3, stride=2), nn.ReLU(),
                         StaticSame(16, 16, 3, stride=2), nn.ReLU(),
                         StdConv(16, 16, 3, padding=1), nn.ReLU(),
                         StdSame(16, 16, 3, stride=2), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))


def _x(size: int = 17) -> torch.Tensor:
    return torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(1))


def test_tensorize_keeps_the_pad_around_the_new_layer():
    net = _net()
    x, other = _x(), _x(20)  # the dynamic pad differs between odd and even sizes
    with torch.no_grad():
        want, want_other = net(x), net(other)
    with warnings.catch_warnings():  # rank 16: full rank, more parameters than some layers
        warnings.simplefilter("ignore")
        model, report = tnspec.tensorize(copy.deepcopy(net), "low_rank", rank=16,
                                         weights="fit")
    assert [r.name for r in report.replaced] == ["0", "2", "4", "6", "10"]
    assert all(isinstance(model[i], Padded) and isinstance(model[i].layer, tnspec.Layer)
               for i in (0, 2, 6))
    assert isinstance(model[4], tnspec.Layer)
    notes = {r.name: r.note for r in report.replaced}
    assert "a DynamicSame that pads in its forward (TensorFlow's 'same' pad" in notes["0"]
    assert "a StaticSame that pads in its forward (a fixed pad (0, 1, 0, 1))" in notes["2"]
    assert "a StdConv that standardizes its weight in its forward" in notes["4"]
    with torch.no_grad():  # full rank: the outputs, at both sizes
        torch.testing.assert_close(model(x), want, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(model(other), want_other, rtol=1e-3, atol=1e-4)


def test_adapt_is_exact_and_merges_loads_and_refuses_a_lora_export():
    net = _net()
    x, other = _x(), _x(20)
    with torch.no_grad():
        want = net(x)
    adapted, report = tnspec.adapt(copy.deepcopy(net), "tucker2", rank=0.5,
                                   include=["0", "2", "4", "6"])
    assert [a.name for a in report.adapted] == ["0", "2", "4", "6"]
    assert isinstance(adapted[0].base, Padded) and type(adapted[4].base) is StdConv
    with torch.no_grad():  # the zero core: bit for bit where the base holds the weight
        h = x
        for i, (mine, theirs) in enumerate(zip(adapted, net)):
            got, h = mine(h), theirs(h)
            if i == 6:  # padded and standardized: a Padded plain conv of the standardized copy
                torch.testing.assert_close(got, h, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(got, h), i
        for p in adapted.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
        trained, trained_other = adapted(x), adapted(other)
        assert not torch.allclose(trained, want)
    merged = tnspec.merge_adapters(adapted)
    assert isinstance(merged[0], Padded) and type(merged[0].layer) is nn.Conv2d
    assert type(merged[4]) is nn.Conv2d  # the standardized weight, plus the adapter's
    with torch.no_grad():
        torch.testing.assert_close(merged(x), trained, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(merged(other), trained_other, rtol=1e-4, atol=1e-5)
    loaded = tnspec.load_adapters(copy.deepcopy(net), tnspec.adapter_state_dict(adapted),
                                  tnspec.adapter_config(adapted))
    with torch.no_grad():
        assert torch.equal(loaded(x), trained)
    with pytest.raises(tnspec.SpecError, match=r"layer '0' pads its input in its forward "
                       r"\(TensorFlow's 'same' pad for each input's size\): PEFT's LoRA conv "
                       "would read it unpadded"):
        tnspec.export_lora(adapted, rank=4)


def test_compress_keeps_the_pad_and_puts_back_what_stays_dense():
    net = _net()
    originals = {i: net[i] for i in (0, 2, 4, 6)}
    data = [_x(), _x(16)]
    with torch.no_grad():
        want = net(data[0])
    model, report = tnspec.compress(net, 0.6, ("low_rank", "tucker2"), data=data,
                                    sequential=True, heal=5, fit={"max_iter": 10})
    names = [c.name for c in report.choices]
    assert names == ["0.layer", "2.layer", "4", "6.layer", "10"]  # inside its Padded
    assert all(c.sensitivity > 0 for c in report.choices)  # its inputs were seen
    for c, i in zip(report.choices, (0, 2, 4, 6)):
        if c.chosen.format == "dense":
            assert model[i] is originals[i]
        else:
            assert isinstance(model[i], Padded if ".layer" in c.name else tnspec.Layer)
    assert any(c.chosen.format != "dense" for c in report.choices[:4])
    with torch.no_grad():
        got = model(data[0])
    assert float((got - want).norm() / want.norm()) < 0.5


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_compress_that_raises_puts_every_subclass_back(error):
    net = _net()
    before = snapshot(net)

    def run(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        if any(isinstance(m, tnspec.Layer) for m in model.modules()):
            raise error("stop")
        return model(batch)
    with pytest.raises(error, match="stop"):
        tnspec.compress(net, 0.5, ("low_rank",), data=[_x()], run=run, sequential=True,
                        fit={"max_iter": 10})
    assert unchanged(before, net)
    assert type(net[0]) is DynamicSame and type(net[4]) is StdConv


def test_efficientnet_pytorch_convs_are_all_read():
    """The library's own classes (EfficientNet-PyTorch, whose checkpoints are ported from
    TensorFlow): every conv of EfficientNet-B0, static "same" padding at image size 224, is
    adapted exactly at init, the stride-2 stem keeps its (0, 1, 0, 1) pad when tensorized, and
    the dynamic variant is read as TensorFlow's pad per input size. (The architecture only:
    its pretrained weights are downloaded, and these machines have no internet.)"""
    efficientnet = pytest.importorskip("efficientnet_pytorch")
    torch.manual_seed(0)
    net = efficientnet.EfficientNet.from_name("efficientnet-b0").eval()
    net.set_swish(memory_efficient=False)
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 81 and {type(m).__name__ for m in convs} == {"Conv2dStaticSamePadding"}
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        want = net(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapted, report = tnspec.adapt(copy.deepcopy(net), "low_rank", rank=4)
    assert not report.skipped and len(report.adapted) == 82  # and the classifier
    with torch.no_grad():
        assert torch.equal(adapted(x), want)
    stem = tnspec.tensorize(nn.Sequential(net._conv_stem), "tucker2", rank=0.5)[0][0]
    assert isinstance(stem, Padded) and stem.pad.fixed == (0, 1, 0, 1)
    dynamic = efficientnet.utils.get_same_padding_conv2d(image_size=None)(16, 32, 3, stride=2)
    assert type(dynamic).__name__ == "Conv2dDynamicSamePadding"
    read = check_forward(dynamic)
    assert read.pad is not None and read.pad.fixed is None


def test_loading_adapters_that_do_not_fit_leaves_a_padded_model_as_it_was():
    """load_adapters reads each subclass as adapt did before it changes anything: a state
    with a tensor no adapter holds raises, and the model (the subclasses, their parameters,
    flags and ties) is as it was."""
    net = _net()
    adapted, _ = tnspec.adapt(copy.deepcopy(net), "tucker2", rank=0.5, include=["0", "4", "6"])
    state = {**tnspec.adapter_state_dict(adapted), "6.adapters.default.stray": torch.zeros(1)}
    target = copy.deepcopy(net)
    before = snapshot(target)
    with pytest.raises(tnspec.SpecError, match="layer '6': the state has 'stray'"):
        tnspec.load_adapters(target, state, tnspec.adapter_config(adapted))
    assert unchanged(before, target)
    assert type(target[0]) is DynamicSame and type(target[6]) is StdSame
