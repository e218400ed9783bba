"""tnspec.tensorize: the replaced layers keep the dense layers' interface (the standard format
reproduces them exactly), read the activation that follows them, and skip what they cannot
express with a reason."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tnspec
from tnspec.workflows.convert.tensorize import TensorizedConv, TensorizedLinear

from ..model_state import snapshot, unchanged

pytestmark = pytest.mark.usefixtures("float64")

LAYERS = {  # a dense layer, and an input for it
    "conv1d": (lambda: nn.Conv1d(6, 4, 4, stride=3, padding=2), (2, 6, 11)),
    "conv2d-nonsquare": (lambda: nn.Conv2d(6, 8, (3, 5), stride=(2, 1), padding=(1, 2),
                                           dilation=(1, 2)), (2, 6, 9, 10)),
    "conv2d-same-grouped": (lambda: nn.Conv2d(6, 9, 3, padding="same", groups=3,
                                              bias=False), (2, 6, 7, 7)),
    "conv2d-valid": (lambda: nn.Conv2d(4, 4, 2, padding="valid"), (2, 4, 6, 6)),
    "conv3d": (lambda: nn.Conv3d(4, 6, (3, 1, 3), stride=(1, 2, 2), padding=1), (2, 4, 5, 6, 7)),
    "linear": (lambda: nn.Linear(12, 10), (2, 12)),
    "linear-3d-input": (lambda: nn.Linear(12, 10, bias=False), (2, 5, 12)),
    "conv2d-unbatched": (lambda: nn.Conv2d(4, 6, 3, padding=1), (4, 6, 6)),
}


@pytest.mark.parametrize("case", LAYERS)
def test_the_standard_format_reproduces_the_dense_layer(case):
    make, shape = LAYERS[case]
    dense = make().double()
    model, report = tnspec.tensorize(nn.Sequential(copy.deepcopy(dense)), "standard")
    layer = model[0]
    assert isinstance(layer, TensorizedLinear if isinstance(dense, nn.Linear) else TensorizedConv)
    with torch.no_grad():  # the dense weight is (o, c, k...) per group; W is [g, o, c, k...]
        layer.W.copy_(dense.weight.reshape(layer.W.shape))
        if dense.bias is not None:
            layer.bias.copy_(dense.bias.reshape(layer.bias.shape))
    x = torch.randn(shape)
    assert torch.allclose(layer(x), dense(x), rtol=1e-10, atol=1e-12)
    assert report.params_before == report.params_after
    assert (layer.bias is None) == (dense.bias is None)


@pytest.mark.parametrize("fmt", ["low_rank", "cp", "tucker", "tucker2", "htk2", "tt", "tr",
                                 "block_term", "hypernet", "depthwise_separable"])
@pytest.mark.parametrize("case", LAYERS)
def test_every_format_keeps_the_interface(fmt, case):
    make, shape = LAYERS[case]
    dense = make().double()
    model, report = tnspec.tensorize(nn.Sequential(copy.deepcopy(dense)), fmt, rank=2)
    x = torch.randn(shape)
    if report.skipped:  # only the formats that cannot take this layer, and they say why
        assert fmt == "depthwise_separable" and ("groups" in report.skipped[0][1] or
                                                 "kernel" in report.skipped[0][1])
        return
    assert model[0](x).shape == dense(x).shape
    assert report.replaced[0].params_after == sum(p.numel() for p in model[0].parameters())


class Functional(nn.Module):
    """Activations written in forward(), read through torch.fx."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)
        self.d = nn.Linear(8, 2)

    def forward(self, x):
        x = F.leaky_relu(self.a(x), 0.2)
        x = torch.tanh(self.drop(self.b(x)))
        x = self.c(x).relu()
        return self.d(x)


def test_the_activation_after_each_layer_is_read_from_the_model():
    seq = nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3),
                        nn.GELU(), nn.Conv2d(4, 4, 1), nn.Flatten(), nn.LazyLinear(3))
    seq = nn.Sequential(*list(seq)[:-1], nn.Linear(4 * 9, 3))
    _, report = tnspec.tensorize(seq, "cp", rank=2)
    acts = {r.name: (r.activation, r.activation_from) for r in report.replaced}
    assert acts["0"] == ("relu", "read from the model")
    assert acts["3"] == ("gelu", "read from the model")
    assert acts["5"] == ("linear", "no activation found after it")
    _, report = tnspec.tensorize(Functional(), "low_rank", rank=2)
    acts = {r.name: r.activation for r in report.replaced}
    assert acts == {"a": "leaky_relu(0.2)", "b": "tanh", "c": "relu", "d": "linear"}
    _, report = tnspec.tensorize(Functional(), "low_rank", rank=2, activation="tanh")
    assert {r.activation_from for r in report.replaced} == {"given"}


class WithConstant(nn.Module):
    """A tensor made in forward, which fx stores as ``_tensor_constant0`` on what it traces."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.a(x) * torch.tensor(2.0))


class StopsTracing(WithConstant):
    """fx stores the constant, then fails at the branch on a traced value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x) * torch.tensor(2.0)
        return torch.relu(y) if y.sum() > 0 else y


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mid = nn.Embedding(12, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def test_reading_the_activations_adds_nothing_to_the_model():
    """fx leaves ``_tensor_constant0`` on a traced module, a tensor deepcopy refuses once
    autograd made it a non-leaf: tracing restores every module's attributes."""
    model = nn.Sequential(WithConstant(), nn.Linear(4, 2))
    before = [set(vars(model)), set(vars(model[0]))]
    new, report = tnspec.tensorize(model, "cp", rank=0.5)
    assert {r.name: r.activation for r in report.replaced}["0.a"] == "linear"
    assert [set(vars(new)), set(vars(new[0]))] == before
    copy.deepcopy(new)
    model = nn.Sequential(StopsTracing(), nn.Linear(4, 2))  # a trace that raises, too
    before = [set(vars(model)), set(vars(model[0]))]
    new, _ = tnspec.tensorize(model, "cp", rank=0.5)
    assert [set(vars(new)), set(vars(new[0]))] == before
    tied, _ = tnspec.tensorize(TiedLM(), "cp", rank=0.5)
    tnspec.tensorize(tied, "tucker2", rank=0.5)  # traces the tensorized table's head
    copy.deepcopy(tied)


def test_the_init_follows_the_activation():
    """Graph-in for relu draws twice the variance it draws for a linear layer."""
    def var(model):
        cores = model[0].network.cores
        return torch.stack([getattr(model[0], c.name).var() for c in cores]).prod().item()
    torch.manual_seed(0)
    relu, _ = tnspec.tensorize(nn.Sequential(nn.Linear(400, 400), nn.ReLU()), "tucker2", rank=20)
    torch.manual_seed(0)
    plain, _ = tnspec.tensorize(nn.Sequential(nn.Linear(400, 400)), "tucker2", rank=20)
    assert var(relu) / var(plain) == pytest.approx(2, rel=0.15)


def test_a_deep_plain_relu_net_keeps_its_scale():
    """Twelve tensorized TR convs with ReLU and no normalization: Graph-in keeps the output
    scale (median of 5 draws) within 3x of what Kaiming keeps in the dense net (zero padding
    shrinks both); per-core Kaiming loses it."""
    def stack():
        layers = []
        for _ in range(12):
            conv = nn.Conv2d(32, 32, 3, padding=1)
            nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
            nn.init.zeros_(conv.bias)
            layers += [conv, nn.ReLU()]
        return nn.Sequential(*layers)

    def scale(model):
        with torch.no_grad():
            return (model(x).pow(2).mean() / x.pow(2).mean()).sqrt().item()

    def median(make):
        values = []
        for seed in range(5):
            torch.manual_seed(seed)
            values.append(scale(make()))
        return sorted(values)[2]
    x = torch.randn(8, 32, 12, 12)
    dense = median(stack)
    graph = median(lambda: tnspec.tensorize(stack(), "tr", rank=6)[0])
    kaiming = median(lambda: tnspec.tensorize(stack(), "tr", rank=6, init="kaiming-in")[0])
    assert 1 / 3 < graph / dense < 3, (graph, dense)
    assert kaiming / dense < 0.05


def test_layers_that_cannot_be_expressed_are_skipped_with_a_reason():
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"),
                          nn.Conv2d(4, 4, 2, padding="same"),
                          nn.Conv2d(4, 4, 3, groups=4),
                          nn.Conv2d(4, 4, 3),
                          nn.Linear(4, 4))
    model.append(nn.MultiheadAttention(4, 2))
    _, report = tnspec.tensorize(model, "tucker2", rank=0.01)
    reasons = dict(report.skipped)
    assert "padding_mode='reflect'" in reasons["0"]
    assert "pads one side more" in reasons["1"]
    assert "depthwise" in reasons["2"]
    assert "even rank 1 has" in reasons["3"]
    assert "MultiheadAttention reads" in reasons["5.out_proj"]
    assert not report.replaced
    assert "skipped 1 x Conv2d (0): padding_mode='reflect'" in str(report)


def test_rank_multiple_rounds_each_layers_share_and_needs_a_share():
    model = nn.Sequential(nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(128, 256, 3, padding=1))
    model, report = tnspec.tensorize(model, "tucker2", rank=0.25, rank_multiple=16)
    assert [(m.sizes["r0"], m.sizes["r1"]) for m in (model[0], model[2])] == [(48, 48), (64, 64)]
    assert len(report.replaced) == 2
    with pytest.raises(tnspec.SpecError, match="(?s)rank_multiple=16 with rank=8.*give rank=0.25"):
        tnspec.tensorize(nn.Sequential(nn.Conv2d(8, 8, 3)), "tucker2", rank=8, rank_multiple=16)


def test_include_and_exclude_select_layers():
    def model():
        inner = nn.Sequential(nn.Conv2d(8, 8, 3), nn.Linear(8, 8))
        return nn.Sequential(nn.Conv2d(8, 8, 3), inner)

    def names(report):
        return [r.name for r in report.replaced]
    assert names(tnspec.tensorize(model(), "cp", rank=2, include="1.*")[1]) == ["1.0", "1.1"]
    assert names(tnspec.tensorize(model(), "cp", rank=2, exclude=["1.*"])[1]) == ["0"]
    linear_only = tnspec.tensorize(model(), "cp", rank=2,
                                   include=lambda name, m: isinstance(m, nn.Linear))[1]
    assert names(linear_only) == ["1.1"]
    model_, report = tnspec.tensorize(model(), "cp", rank=2)
    assert len(report.replaced) == 3 and "tensorize: 3 layer(s) to cp" in str(report)
    _, again = tnspec.tensorize(model_, "cp", rank=2)  # tnspec layers are not re-tensorized
    assert not again.replaced


@pytest.mark.parametrize("rank", [0, -1, 1.5, (2, 0), "8"])
def test_a_rank_that_is_no_rank_is_one_error_before_anything_changes(rank):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Conv2d(4, 4, 3))
    before = snapshot(model)
    with pytest.raises(tnspec.SpecError, match="is no rank"):
        tnspec.tensorize(model, "cp", rank=rank)
    assert unchanged(before, model)


@pytest.mark.parametrize("rank_multiple", [0, 1.5, "16"])
def test_a_rank_multiple_that_is_no_size_is_one_error(rank_multiple):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    before = snapshot(model)
    with pytest.raises(tnspec.SpecError, match="rank_multiple=.* must be a positive int"):
        tnspec.tensorize(model, "cp", rank=0.5, rank_multiple=rank_multiple)
    assert unchanged(before, model)


def test_the_report_says_unchanged_or_more_and_why_an_embedding_has_no_such_format():
    _, report = tnspec.tensorize(nn.Sequential(nn.LayerNorm(4)), "cp")
    assert "model parameters 8 -> 8 (unchanged)" in str(report)
    _, report = tnspec.tensorize(nn.Sequential(nn.Linear(4, 4)), "cp", rank=6)
    assert "x more)" in str(report)
    _, report = tnspec.tensorize(nn.Sequential(nn.Embedding(100, 8)), "tucker2")
    assert report.skipped == (("0", "tucker2 has no embedding form: an embedding's formats are "
                               "tt, tr, cp, tucker"),)


def test_an_excluded_embedding_is_not_called_a_kind_tensorize_does_not_replace():
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    _, report = tnspec.tensorize(model, "cp", rank=0.5, exclude=["0"])
    assert report.other == (("LayerNorm", 1, "a normalization: a few parameters per channel"),)


def test_an_unknown_format_is_refused():
    with pytest.raises(tnspec.SpecError, match="unknown format 'tucker3'"):
        tnspec.tensorize(nn.Linear(4, 4), "tucker3")


def test_a_tensorized_model_trains_and_round_trips():
    torch.manual_seed(0)
    model, _ = tnspec.tensorize(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                              nn.Flatten(), nn.Linear(8 * 16, 2)), "tt", rank=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 3, 4, 4), torch.randint(0, 2, (16,))
    first = F.cross_entropy(model(x), y).item()
    for _ in range(20):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert F.cross_entropy(model(x), y).item() < first
    clone = copy.deepcopy(model)
    clone.load_state_dict(model.state_dict())
    assert torch.equal(clone(x), model(x))


def test_tied_weights_stay_tied_and_skipped_kinds_are_counted():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mid = nn.Embedding(100, 64), nn.Linear(64, 64)
            self.head = nn.Linear(64, 100, bias=False)
            self.head.weight = self.emb.weight  # as language models tie them
            self.up = nn.ConvTranspose2d(4, 4, 3)
            self.dw1, self.dw2 = nn.Conv2d(8, 8, 3, groups=8), nn.Conv2d(8, 8, 3, groups=8)
            self.shared = nn.Linear(64, 64)
            self.again = self.shared  # one module under two names

        def forward(self, x):
            return self.head(self.again(self.shared(self.mid(self.emb(x)))))

    model, report = tnspec.tensorize(Tied(), "tucker2", rank=0.5)
    assert model.head.weight is model.emb.weight and isinstance(model.head, nn.Linear)
    assert model.shared is model.again and isinstance(model.shared, nn.Linear)
    assert [r.name for r in report.replaced] == ["mid"]
    text = str(report)
    # tucker2 has no embedding form: the embedding stays, and its tied head with it
    assert "skipped 1 x Linear (head): tied to 'emb', which stays as it is" in text
    assert "skipped 1 x Linear (shared): its parameters are shared with 'again'" in text
    assert "skipped 2 x Conv2d (dw1, dw2): a depthwise conv" in text
    assert "skipped 1 x Embedding (emb): tucker2 has no embedding form" in text
    assert "left alone 1 x ConvTranspose2d: a transposed conv: no tnspec format stands for it " \
        "yet\n" in text + "\n"
    x = torch.randint(0, 100, (3,))
    assert model(x).shape == (3, 100)


class _Conv2dSame(nn.Conv2d):
    """TensorFlow's "same" padding made in forward, as checkpoints ported from TensorFlow hold
    every conv (timm's ``Conv2dSame``, EfficientNet-PyTorch's static-same padding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = []
        for n, k, s, d in zip(reversed(x.shape[-2:]), reversed(self.kernel_size),
                              reversed(self.stride), reversed(self.dilation)):
            total = max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
            pads += [total // 2, total - total // 2]
        return F.conv2d(F.pad(x, pads), self.weight, self.bias, self.stride, 0, self.dilation,
                        self.groups)


def test_convs_that_pad_same_in_their_forward_are_the_plain_convs_they_compute():
    """A conv subclass padding "same" in its own forward was skipped by tensorize, adapt and
    compress ("overrides forward"). At stride 1 it computes a plain conv, checked on random
    inputs of two sizes: that conv (holding the same parameters) is what they work on, and
    the report says so. At stride 2 the pad depends on the input size: it stays in front of
    the new layer (tests/workflows/test_padded.py)."""
    torch.manual_seed(0)
    net = nn.Sequential(_Conv2dSame(3, 16, 3, stride=2), nn.ReLU(), _Conv2dSame(16, 16, 1),
                        nn.ReLU(), _Conv2dSame(16, 16, 5), nn.ReLU(),
                        _Conv2dSame(16, 8, 3, dilation=2))
    x = torch.randn(2, 3, 17, 17)
    with torch.no_grad():
        want = net(x)
    adapted, report = tnspec.adapt(copy.deepcopy(net), "tucker2", rank=0.5, include=["4", "6"])
    assert [a.name for a in report.adapted] == ["4", "6"]
    assert all("_Conv2dSame that pads in its forward" in a.note for a in report.adapted)
    with torch.no_grad():
        assert torch.equal(adapted(x), want)  # exact at init
        merged = tnspec.merge_adapters(adapted)
        torch.testing.assert_close(merged(x), want)
    assert type(merged[4]) is nn.Conv2d and merged[4].padding == (2, 2)
    assert merged[6].padding == (2, 2) and merged[6].dilation == (2, 2)
    with warnings.catch_warnings():  # rank 16: full rank, more parameters than layer 6 has
        warnings.simplefilter("ignore")
        tensorized, report = tnspec.tensorize(copy.deepcopy(net), "low_rank", rank=16,
                                              weights="fit")
    assert [r.name for r in report.replaced] == ["0", "2", "4", "6"]
    assert type(tensorized[0]).__name__ == "Padded"
    with torch.no_grad():
        torch.testing.assert_close(tensorized(x), want, rtol=1e-3, atol=1e-4)
    # compress sees each layer's inputs and sensitivity where the model calls it (a hook on
    # the plain conv, which the model never calls, saw nothing: every sensitivity was 0)
    _, report = tnspec.compress(copy.deepcopy(net), 0.5, data=[x], include=["2", "4", "6"])
    assert [c.name for c in report.choices] == ["2", "4", "6"]
    assert all(c.sensitivity > 0.1 for c in report.choices), [c.sensitivity for c in report.choices]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_in_a_later_fit_puts_every_replaced_layer_back(monkeypatch, error):
    """``tensorize(weights="fit")`` replaces layer by layer; an error or Ctrl-C in the second
    layer's fit leaves the model exactly as it was (the first layer, already replaced, put
    back; a frozen layer still frozen; the head still tied to its embedding; the values, by
    hash), and torch's thread count as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.ReLU(),
                          nn.Linear(32, 32), nn.Linear(32, 50, bias=False))
    model[4].weight = model[0].weight  # a head tied to its embedding
    model[1].requires_grad_(False)
    before, threads = snapshot(model), torch.get_num_threads()
    fit, calls = tnspec.Layer.fit_, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise error("the second fit fails")
        return fit(self, *args, **kwargs)
    monkeypatch.setattr(tnspec.Layer, "fit_", failing)
    with pytest.raises(error, match="the second fit fails"):
        tnspec.tensorize(model, "low_rank", rank=0.5, weights="fit", include=["1", "3"],
                         fit={"max_iter": 3})
    assert len(calls) == 2 and unchanged(before, model)
    assert model[4].weight is model[0].weight and torch.get_num_threads() == threads
