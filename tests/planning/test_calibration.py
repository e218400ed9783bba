"""Calibration: the cost model fitted to steps timed on this device, kept in a cache file;
channel-mixing steps run by the op measured faster. No test asserts on a time."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import tnspec
from tnspec.cli import main
from tnspec.planning import cache, calibration, measure
from tnspec.emit import runtime
from tnspec.nn import autotune
from tnspec.nn.autotune import Timing
from tnspec.planning.cost import CostModel, Mixing
from tnspec.planning.plan import plan
from tnspec.shapes import bind_shape, lookup_shape

from ..conftest import IDLE, idle_samples, quiet

TUCKER2 = "x[b, c, h+kh-1, w+kw-1], U[c, r0], G[r0, r1, kh, kw], V[r1, o] -> y[b, o, h, w]"
SIZES = dict(c=6, o=5, r0=3, r1=2, kh=3, kw=3)


def test_the_cache_round_trips_and_a_warm_cache_times_nothing(calibrated, monkeypatch):
    first = tnspec.calibrate()
    assert calibrated.exists() and first.samples == len(measure.CONVS) + len(
        measure.EINSUMS)
    assert first.model.conv_rate > 0 and first.model.overhead >= 0 and first.error >= 1
    assert "float32" in first.key and f"{torch.get_num_threads()} threads" in first.key

    def no_timing(*args, **kwargs):
        raise AssertionError("a warm cache must not time anything")
    monkeypatch.setattr(calibration, "measure", no_timing)
    monkeypatch.setattr(calibration, "time_mixing", no_timing)
    calibration.forget()
    again = tnspec.calibrate()
    assert again == first
    assert calibration.cost_model() == first.model
    assert [c.key for c in calibration.cached()] == [first.key]


def test_refresh_measures_again_and_drops_the_devices_choices(calibrated, monkeypatch):
    tnspec.calibrate()
    monkeypatch.setattr(calibration, "time_mixing",
                        lambda step, device, dtype, repeats, **k: {"conv1x1": 2.0, "einsum": 1.0})
    choose = calibration.chooser()
    assert choose(Mixing(4, 1, 8, 8, (16, 16))) == "einsum"
    assert json.loads(calibrated.read_text())["choices"]
    tnspec.calibrate(refresh=True)
    assert json.loads(calibrated.read_text())["choices"] == {}


def test_opting_out_uses_the_built_in_constants_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.ENV_SWITCH, "0")
    monkeypatch.setenv(calibration.ENV_DIR, str(tmp_path))
    calibration.forget()
    layer = tnspec.layer(TUCKER2, **SIZES)
    layer(torch.randn(2, 6, 8, 8))
    assert calibration.cost_model() == CostModel()
    assert calibration.cost_model(dtype=torch.float64).scale == 2.0
    assert calibration.chooser() is None
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("content", [
    "{not json", f'{{"format": {calibration.FORMAT}, "devices": {{"k": 3}}}}',
    f'{{"format": {calibration.FORMAT}, "devices": {{}}, "choices": '
    '{"k": {"op": "bmm", "seconds": {}}}}', "[1, 2]", b'\xff\xfe{"format": \xe9'])
def test_a_corrupt_cache_is_ignored_with_a_warning_and_rebuilt(calibrated, content):
    if isinstance(content, bytes):  # not UTF-8
        calibrated.write_bytes(content)
    else:
        calibrated.write_text(content)
    with pytest.warns(UserWarning, match="(corrupt calibration cache|corrupt cached "
                                         "calibration k|dropping the calibration cache "
                                         "entry 'k').*measured again"):
        found = tnspec.calibrate()
    data = json.loads(calibrated.read_text())
    assert data["format"] == calibration.FORMAT and found.key in data["devices"]


def test_an_older_format_is_measured_again_silently(calibrated, recwarn):
    calibrated.write_text(json.dumps({"format": 0, "devices": {"x": {}}}))
    tnspec.calibrate()
    assert json.loads(calibrated.read_text())["format"] == calibration.FORMAT
    assert not [w for w in recwarn if "calibration" in str(w.message)]


def test_an_unwritable_cache_warns_and_keeps_the_calibration_in_memory(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(calibration.ENV_SWITCH, "1")
    monkeypatch.setenv(calibration.ENV_DIR, str(blocker / "sub"))  # a file is in the way
    monkeypatch.setattr(calibration, "others_running", lambda: 0)
    monkeypatch.setattr(calibration, "measure", idle_samples)
    calibration.forget()
    with pytest.warns(UserWarning, match="cannot write the calibration cache"):
        model = calibration.cost_model()
    assert model.conv_rate > 0
    calibration.forget()


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "frozen"])
def test_measuring_leaves_rng_grad_mode_and_frozen_cores_alone(calibrated, context):
    torch.manual_seed(0)
    layer = tnspec.layer(TUCKER2, **SIZES)
    x = torch.randn(3, 6, 10, 10)
    if context == "frozen":
        layer.requires_grad_(False)
    state = torch.get_rng_state()
    mode = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(
        context, torch.enable_grad)
    with mode():
        y = layer(x)
    assert torch.equal(torch.get_rng_state(), state)
    assert json.loads(calibrated.read_text())["devices"]  # it did measure
    expected = F.conv2d(x, layer.dense_weight().detach(), padding=layer.padding)
    torch.testing.assert_close(y.detach(), expected, rtol=1e-4, atol=1e-5)
    assert y.requires_grad is (context not in ("no_grad", "inference_mode", "frozen"))


def test_the_chooser_decides_channel_mixing_and_both_ops_compute_the_same():
    sizes = dict(c=16, o=12, r0=4, r1=3, kh=3, kw=3)
    net = bind_shape(tnspec.compile(TUCKER2, **sizes), (8, 16, 12, 12))
    seen = []

    def choose(step: Mixing) -> str:
        seen.append(step)
        return "einsum"
    as_einsum = plan(net, choose=choose)
    as_conv = plan(net, choose=lambda step: "conv1x1")
    assert [s.op for s in as_einsum.steps] == ["einsum", "conv", "einsum"]
    assert [s.op for s in as_conv.steps] == ["conv1x1", "conv", "conv1x1"]
    assert seen == [Mixing(8, 1, 16, 4, (12, 12)), Mixing(8, 1, 3, 12, (12, 12))]
    layer = tnspec.layer(TUCKER2, **sizes)
    cores = {k: v.detach() for k, v in layer.named_parameters() if k != "bias"}
    x = torch.randn(8, 16, 12, 12)
    expected = F.conv2d(x, layer.dense_weight().detach(), padding=layer.padding)
    for p in (as_einsum, as_conv):
        module = SimpleNamespace(sizes=p.network.sizes, bias=None, **cores)
        y = runtime.layer_class(p.network, p).forward(module, x)
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-5)


LOW_RANK_1X1 = "x[b, c, h+kh, w+kw], U[r, c, kh, kw], V[o, r] -> y[b, o, h, w]"  # valid conv


@pytest.mark.parametrize("contiguous", [True, False])
def test_a_unit_kernel_conv_is_channel_mixing_the_chooser_decides(contiguous):
    """A 1x1 conv's core (a kernel of 1, stride 1, no padding) makes a conv step that is
    channel mixing: the chooser is asked, and as an einsum it runs as a matmul of the core
    without its unit axes (batched over contiguous data, of the stored matrix of channels-last
    data), computing what the conv does, forward and backward."""
    sizes = dict(c=16, o=12, r=5, kh=1, kw=1)
    net = bind_shape(tnspec.compile(LOW_RANK_1X1, **sizes), (8, 16, 9, 9))
    seen = []

    def choose(step: Mixing) -> str:
        seen.append(step)
        return "einsum"
    assert [s.op for s in plan(net, planner="greedy", choose=choose).steps] == \
        ["einsum", "einsum"]
    assert Mixing(8, 1, 16, 5, (9, 9)) in seen
    assert [s.op for s in plan(net, planner="greedy", choose=lambda step: "conv1x1").steps] \
        == ["conv", "conv1x1"]
    layer = tnspec.layer(LOW_RANK_1X1, **sizes, planner="greedy")
    x = torch.randn(8, 16, 9, 9)
    if not contiguous:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    ran = {}
    for op in ("conv1x1", "einsum"):
        model = copy.deepcopy(layer)
        model._class = lambda shape, last=False, m=model, op=op: runtime.layer_class(
            m.network, plan(bind_shape(m.network, shape), planner="greedy",
                            choose=lambda step: op), last)
        y = model(x)
        y.backward(torch.ones_like(y))
        ran[op] = (y, x.grad, model.U.grad, model.V.grad)
        x.grad = None
        source = runtime.source_of(model._class(tuple(x.shape), not contiguous).forward)
        assert ("torch.bmm(U_m_e" in source or "torch.mm(x_r, U_m_p)" in source) is \
            (op == "einsum")
        assert "torch.einsum" not in source
    for a, b in zip(ran["conv1x1"], ran["einsum"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ran["einsum"][0], F.conv2d(
        x, layer.dense_weight().detach()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("relation", ["2*h+kh", "h+kh-1", "h+2*kh"])
def test_a_unit_kernel_with_a_stride_padding_or_dilation_stays_a_conv(relation):
    """Only the identity relation is channel mixing: a stride, a padding or a dilation keeps
    the conv (a dilated unit kernel is the identity too, but rare enough to leave as it is)."""
    spec = LOW_RANK_1X1.replace("h+kh", relation)
    net = bind_shape(tnspec.compile(spec, c=16, o=12, r=5, kh=1, kw=1), (8, 16, 9, 9))
    steps = plan(net, planner="greedy", choose=lambda step: "einsum").steps
    assert any(s.op == "conv" for s in steps)


def test_served_mixing_is_timed_forward_alone_and_kept_apart(calibrated, monkeypatch):
    """A layer called without autograd is served: its mixing steps are timed forward alone
    and kept under their own key, and it runs a class of its own; the same layer training
    runs the op timed forward and backward. Both compute the same."""
    tnspec.calibrate()
    seen = []

    def fake(step, device, dtype, repeats, backward=True, **k):  # einsum wins served
        seen.append(backward)
        return {"conv1x1": 1.0, "einsum": 2.0 if backward else 0.5}
    monkeypatch.setattr(calibration, "time_mixing", fake)
    step = Mixing(4, 1, 8, 8, (16, 16))
    assert calibration.chooser(training=False)(step) == "einsum" and seen == [False]
    assert calibration.chooser()(step) == "conv1x1" and seen == [False, True]
    keys = [k for k in json.loads(calibrated.read_text())["choices"] if "mixing" in k]
    assert sum(k.endswith(", served") for k in keys) == 1 and len(keys) == 2
    layer = tnspec.layer(TUCKER2, c=16, o=16, r0=4, r1=4, kh=3, kw=3, autotune=False)
    x = torch.randn(4, 16, 8, 8)
    trained = layer(x)
    with torch.no_grad():
        served = layer(x)
        source = runtime.source_of(layer._running(x).forward)
    assert "torch.bmm" in source and len(layer._classes) == 2
    assert "torch.bmm" not in runtime.source_of(layer._running(x).forward)
    torch.testing.assert_close(served, trained.detach(), rtol=1e-5, atol=1e-6)


def test_a_served_layer_times_its_orders_forward_alone_and_keeps_them_apart(
        calibrated, monkeypatch):
    """Called without autograd, a layer's candidate orders are timed without a backward and
    the winner is kept under its own key; trained, the same shape is timed again with one."""
    tnspec.calibrate()
    monkeypatch.setattr(calibration, "time_mixing",
                        lambda step, device, dtype, repeats, **k: {"conv1x1": 1.0, "einsum": 2.0})
    modes = []
    real = autotune.time_orders

    def spy(layer, classes, *args, **kwargs):
        modes.append(torch.is_grad_enabled())
        return real(layer, classes, *args, **kwargs)
    monkeypatch.setattr(autotune, "time_orders", spy)
    backward = []
    layer = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)
    layer.G.register_hook(lambda g: backward.append(1))
    x = torch.randn(4, 16, 8, 8)
    with torch.no_grad():
        served = layer(x)
    assert modes and not any(modes) and not backward
    keys = [k for k in json.loads(calibrated.read_text())["choices"] if "order of" in k]
    assert len(keys) == 1 and keys[0].endswith(" served")
    torch.testing.assert_close(layer(x).detach(), served)
    assert any(modes) and backward  # trained: timed with a backward, under its own key
    keys = [k for k in json.loads(calibrated.read_text())["choices"] if "order of" in k]
    assert len(keys) == 2


def test_time_mixing_times_the_forward_alone_where_asked():
    seconds = measure.time_mixing(Mixing(2, 1, 3, 4, (5, 5)), "cpu", torch.float64,
                                  repeats=1, backward=False)
    assert set(seconds) == {"conv1x1", "einsum"} and all(t > 0 for t in seconds.values())


def test_time_mixing_times_the_product_as_lowering_emits_it():
    """The einsum is timed as the lowering emits it, views included: over contiguous data a
    batched matmul of its (b, c, positions) view, over channels-last data a matmul of the
    matrix it is stored as; each computes the 1x1 conv, in the layout it came in."""
    x = torch.randn(2, 6, 5, 4, dtype=torch.float64)
    w = torch.randn(3, 6, dtype=torch.float64)
    last = x.contiguous(memory_format=torch.channels_last)
    for mixed, data in ((measure._mixed, x), (measure._mixed_last, last)):
        y = mixed(data, w)
        torch.testing.assert_close(y, F.conv2d(x, w[:, :, None, None]))
        assert y.is_contiguous(memory_format=torch.channels_last if data is last else
                               torch.contiguous_format)
    for groups in (1, 2):
        seconds = measure.time_mixing(Mixing(2, groups, 3, 4, (5, 5)), "cpu", torch.float64,
                                      repeats=1, channels_last=True)
        assert set(seconds) == {"conv1x1", "einsum"} and all(t > 0 for t in seconds.values())


def test_channels_last_mixing_is_timed_on_channels_last_data_and_kept_apart(
        calibrated, monkeypatch):
    """A layer fed channels-last data asks the chooser for that layout: its mixing steps are
    timed on such data and kept under their own key, and the op that wins there runs."""
    tnspec.calibrate()
    seen = []

    def fake(step, device, dtype, repeats, backward=True, channels_last=False):
        seen.append(channels_last)  # the einsum wins on channels-last data alone
        return {"conv1x1": 1.0, "einsum": 0.5 if channels_last else 2.0}
    monkeypatch.setattr(calibration, "time_mixing", fake)
    layer = tnspec.layer(TUCKER2, c=16, o=16, r0=4, r1=4, kh=3, kw=3, autotune=False)
    x = torch.randn(4, 16, 8, 8)
    y = layer(x)
    assert "torch.mm" not in runtime.source_of(layer._running(x).forward)
    last = x.contiguous(memory_format=torch.channels_last)
    y_last = layer(last)
    assert True in seen and "torch.mm(" in runtime.source_of(layer._running(last).forward)
    keys = [k for k in json.loads(calibrated.read_text())["choices"] if "mixing" in k]
    assert any(k.endswith(", channels_last") for k in keys)
    assert any(not k.endswith(", channels_last") for k in keys)
    torch.testing.assert_close(y_last, y, rtol=1e-5, atol=1e-6)


def test_a_measured_choice_is_kept_and_a_nearby_batch_is_not_timed_again(
        calibrated, monkeypatch):
    timed = []

    def fake(step, device, dtype, repeats, **k):
        timed.append(step)
        return {"conv1x1": 1.0, "einsum": 3.0}
    monkeypatch.setattr(calibration, "time_mixing", fake)
    layer = tnspec.layer(TUCKER2, c=64, o=64, r0=4, r1=4, kh=3, kw=3, autotune=False)
    before = len(timed)  # construction planned (and timed) the example shape
    layer(torch.randn(32, 64, 10, 10))
    mixing = [s.op for s in layer.plan((32, 64, 10, 10)).steps if s.data_side and not s.convs]
    count = len(timed)
    assert count - before == len(mixing) >= 1 and set(mixing) == {"conv1x1"}
    assert {s.batch for s in timed} == {32}
    layer(torch.randn(30, 64, 10, 10))  # the same size class: planned, but nothing timed
    assert len(timed) == count
    calibration.forget()  # a new process reads the choices from the file
    layer(torch.randn(33, 64, 10, 10))
    assert len(timed) == count
    choices = json.loads(calibrated.read_text())["choices"]
    assert len(choices) == count and all(c["op"] == "conv1x1" for c in choices.values())


def test_the_einsum_is_chosen_only_when_clearly_faster(calibrated, monkeypatch):
    """Within the margin (timings of one op vary that much) the 1x1 conv, which keeps the data
    contiguous and can add the bias, is kept."""
    tnspec.calibrate()
    for einsum, op in ((0.95, "conv1x1"), (0.85, "einsum")):
        monkeypatch.setattr(calibration, "time_mixing", lambda step, device, dtype, repeats,
                            e=einsum, **k: {"conv1x1": 1.0, "einsum": e})
        calibration.forget()
        calibrated.unlink()
        assert calibration.chooser()(Mixing(4, 1, 8, 8, (16, 16))) == op


def test_layers_time_their_candidate_orders_once_and_keep_the_fastest_in_the_cache(
        calibrated, monkeypatch):
    """Where calibration is on, a layer's first call for a shape times its candidate orders
    (autotune's default); a new process recalls the winner and times nothing; autotune=False
    and calibration off time no order."""
    tnspec.calibrate()
    monkeypatch.setattr(calibration, "time_mixing",
                        lambda step, device, dtype, repeats, **k: {"conv1x1": 1.0, "einsum": 2.0})
    timed = []
    layouts = []

    def count(self, classes, shape, repeats, channels_last=False):
        # one entry per layer and layout that timed; the model's order is fastest, so that
        # a new process has nothing to re-check (see the fake-clock tests below for that)
        if (self, channels_last) not in [(s, c) for s, c, _ in timed]:
            timed.append((self, channels_last, len(classes)))
            layouts.append(channels_last)
        return quiet([1.0] + [1.5] * (len(classes) - 1))
    monkeypatch.setattr(tnspec.Layer, "_time", count)
    x = torch.randn(4, 16, 8, 8)
    layer = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)
    y = layer(x)
    assert timed and timed[0][2] >= 2  # several distinct orders were timed
    orders = [v for v in json.loads(calibrated.read_text())["choices"].values()
              if "order" in v]
    assert len(orders) == 1 and orders[0]["seconds"] > 0
    calibration.forget()  # as a new process: the order comes from the file
    again = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)
    again.load_state_dict(layer.state_dict())
    torch.testing.assert_close(again(x), y)
    assert len(timed) == 1
    tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=4, kh=3, kw=3, autotune=False)(x)
    assert len(timed) == 1
    # a channels_last input is another layout: its orders are timed on such an input
    last = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)
    last.load_state_dict(layer.state_dict())
    torch.testing.assert_close(last(x.contiguous(memory_format=torch.channels_last)), y)
    assert len(timed) == 2 and layouts == [False, True]
    # so is the same shape in the other layout on a layer that has run the first one
    fresh = tnspec.layer(TUCKER2, c=16, o=16, r0=3, r1=3, kh=3, kw=3)
    fresh(x)
    fresh(x.contiguous(memory_format=torch.channels_last))
    fresh(x.contiguous(memory_format=torch.channels_last))
    assert layouts == [False, True, False, True] and len(fresh._classes) == 2
    monkeypatch.setenv(calibration.ENV_SWITCH, "0")
    tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=5, kh=3, kw=3)(x)
    assert len(timed) == 4


def test_an_order_timed_among_other_code_is_timed_again(calibrated, monkeypatch):
    """A remembered order is recalled only for the code it was timed with: a cache written by
    a build of tnspec that lowered the candidates differently (or before choices carried a
    fingerprint) is timed again and overwritten, not trusted."""
    tnspec.calibrate()
    monkeypatch.setattr(calibration, "time_mixing",
                        lambda step, device, dtype, repeats, **k: {"conv1x1": 1.0, "einsum": 2.0})
    timed = []

    def count(self, classes, *args):
        if not any(layer is self for layer in timed):
            timed.append(self)
        return quiet([1.0] + [1.5] * (len(classes) - 1))  # the model's order: no re-check
    monkeypatch.setattr(tnspec.Layer, "_time", count)
    x = torch.randn(4, 16, 8, 8)
    tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)(x)
    data = json.loads(calibrated.read_text())
    (key, choice), = [(k, v) for k, v in data["choices"].items() if "order" in v]
    assert len(choice["code"]) == 16 and len(timed) == 1
    unmarked = {"order": choice["order"], "seconds": choice["seconds"]}  # an older cache
    for stale in ({**choice, "code": "another build"}, unmarked):
        data["choices"][key] = stale
        calibrated.write_text(json.dumps(data))
        calibration.forget()
        tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)(x)
        assert json.loads(calibrated.read_text())["choices"][key]["code"] == choice["code"]
    assert len(timed) == 3
    calibration.forget()
    tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)(x)  # the same code: recalled
    assert len(timed) == 3


def test_a_choice_is_timed_at_a_capped_batch():
    big = Mixing(4096, 1, 512, 512, (128, 128))
    assert measure.batch_class(big) == 1
    assert measure.batch_class(Mixing(48, 1, 8, 8, (8, 8))) == 64
    assert measure.batch_class(Mixing(40, 1, 8, 8, (8, 8))) == 32


def test_time_mixing_times_both_ops_on_small_sizes():
    seconds = measure.time_mixing(Mixing(2, 2, 3, 4, (5,)), "cpu", torch.float64)
    assert set(seconds) == {"conv1x1", "einsum"} and all(t > 0 for t in seconds.values())


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "grad"])
def test_measuring_for_real_times_every_step_and_leaves_rng_and_grad_mode_alone(context):
    """The fixture's calibrations fit ``idle_samples``; this one times the device. Whether
    its fit is plausible depends on the machine's load, so only what does not is asserted."""
    state = torch.get_rng_state()
    mode = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(
        context, torch.enable_grad)
    with mode():
        samples = measure.measure("cpu", torch.float32)
        enabled, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    assert torch.equal(torch.get_rng_state(), state)
    assert (enabled, inference) == (context == "grad", context == "inference_mode")
    assert len(samples) == len(measure.CONVS) + len(measure.EINSUMS)
    assert all(s.seconds > 0 and s.spread >= 1 for s in samples)
    model, error = measure.fit(samples)
    assert model.conv_rate > 0 and error >= 1


def test_the_fixtures_idle_machine_is_plausible_and_fitted_back():
    model, error = measure.fit(idle_samples())
    assert measure.doubts(model, error, 1.0, "cpu") == []
    assert math.isclose(model.conv_rate, IDLE.conv_rate, rel_tol=1e-6)


def test_the_fit_recovers_a_known_model():
    truth = CostModel(conv_rate=4e10, einsum_rate=8e10, channels=8, bandwidth=5e9,
                      overhead=2e-4, grouped=2.0, einsum_bandwidth=3e9)
    samples = idle_samples(truth=truth)
    model, error = measure.fit(samples)
    assert error == pytest.approx(1.0, abs=1e-6)
    for attr in ("conv_rate", "einsum_rate", "bandwidth", "einsum_bandwidth", "overhead"):
        assert math.isclose(getattr(model, attr), getattr(truth, attr), rel_tol=1e-6), attr
    assert (model.channels, model.grouped) == (8, 2.0)


def test_the_cli_shows_and_refreshes_the_cache(calibrated):
    env_run = [sys.executable, "-m", "tnspec", "calibrate"]  # the fixture's environment
    out = subprocess.run(env_run + ["--refresh"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert str(calibrated) in out.stdout and "MAC/s" in out.stdout
    bad = subprocess.run(env_run + ["--device", "tpu"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2
    assert "cannot measure device 'tpu'" in bad.stderr


def _busy_samples(*args, **kwargs) -> list[measure.Sample]:
    """What a machine busy with other work measures: every step about 56 ms whatever its
    size, repeats far apart."""
    return [measure.Sample("conv", n, g, ci, co, s * s, k * k, 0.056 + 1e-6 * i, spread=3.0)
            for i, (n, g, ci, co, s, k) in enumerate(measure.CONVS)] + \
        [measure.Sample("einsum", n, 1, ci, co, s, 1, 0.056 + 1e-6 * i, spread=3.0)
         for i, (n, ci, co, s) in enumerate(measure.EINSUMS)]


def test_an_implausible_calibration_is_measured_again_then_kept_as_a_fallback_for_a_while(
        calibrated, monkeypatch):
    calls = []
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: calls.append(1) or
                        _busy_samples())
    with pytest.warns(UserWarning, match="not plausible twice .*overhead .* us per step.*"
                                         "built-in constants until .* and then measures again"):
        found = tnspec.calibrate()
    assert len(calls) == 2  # measured again before giving up
    assert found.model == CostModel() and calibration.cost_model() == CostModel()
    assert found.conditions["attempts"] == 2 and found.conditions["doubts"]
    assert "repeats spread x3.00" in " ".join(found.conditions["doubts"])
    assert found.conditions["others"] == 0
    assert "not plausible" in found.describe() and "are used until" in found.describe()
    # the next process on the busy machine neither measures nor warns: the decision was kept
    calibration.forget()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert calibration.cost_model() == CostModel()
    assert len(calls) == 2
    # an hour on, it measures again
    later = found.conditions["until"] + 1
    monkeypatch.setattr(calibration.time, "time", lambda: later)
    calibration.forget()
    with pytest.warns(UserWarning, match="not plausible twice"):
        calibration.cost_model()
    assert len(calls) == 4
    with pytest.warns(UserWarning, match="not plausible twice"):
        tnspec.calibrate(refresh=True)  # and --refresh measures whatever was decided
    assert len(calls) == 6


def test_a_second_measurement_that_is_plausible_is_kept(calibrated, monkeypatch):
    calls = []

    def busy_then_idle(*args, **kwargs):
        calls.append(1)
        return _busy_samples() if len(calls) == 1 else idle_samples()
    monkeypatch.setattr(calibration, "measure", busy_then_idle)
    found = tnspec.calibrate()
    assert len(calls) == 2 and found.conditions["attempts"] == 2
    assert found.conditions["doubts"] == [] and found.model != CostModel()
    stored = json.loads(calibrated.read_text())["devices"][found.key]
    assert stored["conditions"]["attempts"] == 2 and stored["conditions"]["cpus"] >= 1


def test_an_implausible_cached_calibration_is_dropped_and_measured_again(calibrated):
    key = calibration.device_key("cpu", torch.float32)
    bad = {"model": {**vars(CostModel()), "einsum_rate": 1e15, "overhead": 0.056461},
           "error": 1.2, "seconds": 10.0, "samples": 18}
    calibrated.write_text(json.dumps({"format": calibration.FORMAT, "devices": {key: bad},
                                      "choices": {}}))
    with pytest.warns(UserWarning, match=r"ignoring the cached calibration .*overhead 56461 us"
                                         r" per step; einsum 1e\+15 MAC/s"):
        found = tnspec.calibrate()
    assert found.model.overhead < measure.MAX_OVERHEAD or found.conditions["doubts"]
    assert found.model.einsum_rate != 1e15


@pytest.mark.parametrize("field, value", [("conv_rate", 0.0), ("einsum_rate", -1e9),
                                          ("bandwidth", float("nan")),
                                          ("overhead", float("inf"))])
def test_a_cached_constant_that_is_no_rate_is_dropped_and_layers_still_run(
        calibrated, field, value):
    key = calibration.device_key("cpu", torch.float32)
    bad = {"model": {**vars(CostModel()), field: value}, "error": 1.1, "seconds": 10.0,
           "samples": 18}
    calibrated.write_text(json.dumps({"format": calibration.FORMAT, "devices": {key: bad},
                                      "choices": {}}))
    calibration.forget()
    with pytest.warns(UserWarning, match=rf"ignoring the cached calibration .*{field} "):
        model = calibration.cost_model()
    assert all(v > 0 and math.isfinite(v) for v in vars(model).values() if v)
    layer = tnspec.layer("x[b, c, h+kh-1, w+kw-1], U[c, r], G[r, s, kh, kw], V[s, o] -> "
                         "y[b, o, h, w]", c=8, o=8, r=4, s=4, kh=3, kw=3)
    assert layer(torch.randn(2, 8, 6, 6)).shape == (2, 8, 6, 6)


def test_a_cache_that_is_not_utf8_leaves_the_cli_working(calibrated, capsys):
    calibrated.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.warns(UserWarning, match="corrupt calibration cache"):
        assert main(["calibrate", "--show"]) == 0
    with pytest.warns(UserWarning, match="corrupt calibration cache"):
        assert main(["calibrate", "--forget", "mixing *"]) == 0


def test_a_first_call_that_times_logs_what_it_did(calibrated, caplog):
    tnspec.calibrate()
    layer = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)
    with caplog.at_level("DEBUG", logger="tnspec"):
        layer(torch.randn(4, 16, 8, 8))
        layer(torch.randn(4, 16, 8, 8))  # the second call logs nothing
    (record,) = [r for r in caplog.records if "first call" in r.getMessage()]
    assert record.name == "tnspec"
    assert "for input [4, 16, 8, 8]: first call took" in record.getMessage()
    assert "timed" in record.getMessage() or "recalled" in record.getMessage()
    assert record.levelname in ("DEBUG", "INFO")  # INFO past a second


def test_as_many_other_running_threads_as_cpus_is_a_doubt(calibrated, monkeypatch):
    monkeypatch.setattr(calibration, "others_running", lambda: 2 * (os.cpu_count() or 1))
    with pytest.warns(UserWarning, match="other threads running on"):
        found = tnspec.calibrate()
    assert found.model == CostModel()  # kept as the busy machine's decision, not a fit
    stored = json.loads(calibrated.read_text())["devices"][found.key]
    assert stored["model"] == vars(CostModel()) and stored["conditions"]["until"] > 0
    assert found.conditions["others"] == 2 * (os.cpu_count() or 1)


def test_bad_cache_entries_are_dropped_one_by_one_and_layers_still_run(calibrated):
    """A mixing step's entry holding an order, an order that is a list: each dropped with a
    warning, the others kept, and every later forward of that shape still runs."""
    tnspec.calibrate()
    layer = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)
    x = torch.randn(4, 16, 8, 8)
    y = layer(x)
    data = json.loads(calibrated.read_text())
    keys = list(data["choices"])
    mixing = [k for k in keys if " | mixing " in k]
    order = [k for k in keys if " | order of " in k]
    assert mixing and order
    data["choices"][mixing[0]] = {"order": "auto", "seconds": 1.0}
    data["choices"][order[0]] = {**data["choices"][order[0]], "order": ["auto"]}
    data["choices"]["cpu | float32 | torch 0 | mixing batch 1"] = {"op": "bmm", "seconds": 1}
    calibrated.write_text(json.dumps(data))
    calibration.forget()
    with pytest.warns(UserWarning, match="dropping the calibration cache entry") as caught:
        again = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)
        again.load_state_dict(layer.state_dict())
        torch.testing.assert_close(again(x), y)
    assert len([w for w in caught if "dropping" in str(w.message)]) == 3
    assert calibration.cost_model() == tnspec.calibrate().model  # the device entry stayed


def test_a_failed_cache_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "others_running", lambda: 0)
    monkeypatch.setenv(calibration.ENV_SWITCH, "1")
    monkeypatch.setenv(calibration.ENV_DIR, str(tmp_path))
    (tmp_path / calibration.FILE_NAME).mkdir()  # a directory where the file should be
    calibration.forget()
    for _ in range(3):
        with pytest.warns(UserWarning, match="cannot write the calibration cache"):
            calibration.remember("cpu", torch.float32, "mixing batch 1, test", {
                "op": "conv1x1", "seconds": {}})
    assert sorted(p.name for p in tmp_path.iterdir()) == [calibration.FILE_NAME,
                                                          calibration.FILE_NAME + ".lock"]
    calibration.forget()


def test_calibrate_merges_what_another_process_stored_meanwhile(calibrated, monkeypatch):
    key = calibration.device_key("cpu", torch.float32) + " | mixing batch 8, other process"

    def measure_while_another_process_writes(*args, **kwargs):
        samples = idle_samples()
        data = json.loads(calibrated.read_text()) if calibrated.exists() else {
            "format": calibration.FORMAT, "devices": {}, "choices": {}}
        data["choices"][key] = {"op": "einsum", "seconds": {"conv1x1": 2.0, "einsum": 1.0}}
        calibrated.write_text(json.dumps(data))
        return samples
    monkeypatch.setattr(calibration, "measure", measure_while_another_process_writes)
    tnspec.calibrate(dtype=torch.float64)
    stored = json.loads(calibrated.read_text())
    assert key in stored["choices"]
    assert calibration.device_key("cpu", torch.float64) in stored["devices"]


def test_a_requested_planner_is_the_order_that_runs(calibrated, monkeypatch):
    """planner= was ignored where the layer autotunes: the autotuner timed auto's candidates,
    while layer.plan(shape).report() showed the requested order."""
    tnspec.calibrate()
    monkeypatch.setattr(tnspec.Layer, "_time", lambda *a, **k: pytest.fail("timed orders"))
    layer = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3,
                         planner="left-to-right")
    x = torch.randn(4, 16, 8, 8)
    layer(x)
    shown = layer.plan(tuple(x.shape))
    assert shown.planner == "left-to-right"
    assert layer._last_class is runtime.layer_class(layer.network, shown)


def test_the_plan_shown_is_the_order_the_autotuner_chose(calibrated, monkeypatch):
    tnspec.calibrate()
    monkeypatch.setattr(calibration, "time_mixing",
                        lambda step, device, dtype, repeats, **k: {"conv1x1": 1.0, "einsum": 2.0})

    def second_is_fastest(self, classes, shape, repeats, channels_last=False):
        return quiet([1.0, 0.1] + [1.0] * (len(classes) - 2))
    monkeypatch.setattr(tnspec.Layer, "_time", second_is_fastest)
    layer = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)
    x = torch.randn(4, 16, 8, 8)
    shown = layer.plan(tuple(x.shape))  # times now, as the first call would
    layer(x)
    model_order = layer._plan(tuple(x.shape))
    assert [s.result for s in shown.steps] != [s.result for s in model_order.steps]
    assert layer._last_class is runtime.layer_class(layer.network, shown)


def test_spatial_sizes_share_plans_and_timings_by_size_class(calibrated, monkeypatch):
    """Thirty image sizes took 30 rounds of timing (321 s for a 64-channel Tucker-2); sizes
    within a factor of two now share a class, as batch sizes do."""
    tnspec.calibrate()
    mixing = []
    monkeypatch.setattr(calibration, "time_mixing", lambda step, device, dtype, repeats, **k: (
        mixing.append(step.spatial) or {"conv1x1": 1.0, "einsum": 2.0}))
    timed = []
    monkeypatch.setattr(tnspec.Layer, "_time", lambda self, classes, shape, repeats,
                        channels_last=False: timed.append(shape) or quiet([1.0] * len(classes)))
    layer = tnspec.layer(TUCKER2, c=8, o=8, r0=2, r1=3, kh=3, kw=3)
    reference = tnspec.layer(TUCKER2, c=8, o=8, r0=2, r1=3, kh=3, kw=3, autotune=False)
    reference.load_state_dict(layer.state_dict())
    for side in range(12, 42):  # classes 16 (12-22) and 32 (23-45)
        x = torch.randn(2, 8, side, side)
        torch.testing.assert_close(layer(x), reference(x))
    assert len(timed) == 2 and len(layer._classes) == 2
    assert {s for s in mixing} <= {(16, 16), (32, 32), (14, 14), (30, 30)} and len(mixing) <= 4
    orders = [k for k in json.loads(calibrated.read_text())["choices"] if "order of" in k]
    assert len(orders) == 2


def test_autotuning_stops_past_its_time_budget(calibrated, monkeypatch, caplog):
    tnspec.calibrate()
    monkeypatch.setattr(calibration, "time_mixing",
                        lambda step, device, dtype, repeats, **k: {"conv1x1": 1.0, "einsum": 2.0})
    timed = []
    monkeypatch.setattr(tnspec.Layer, "_time", lambda self, classes, shape, repeats,
                        channels_last=False: timed.append(shape) or quiet([1.0] * len(classes)))
    layer = tnspec.layer(TUCKER2, c=8, o=8, r0=2, r1=3, kh=3, kw=3)
    layer.autotune_seconds = 1e-9  # spent by the first timing
    with caplog.at_level("INFO", logger="tnspec"):
        layer(torch.randn(2, 8, 16, 16))
        layer(torch.randn(2, 8, 32, 32))  # another class: planned by the model alone
    assert len(timed) == 1
    assert any("past autotune_seconds=1e-09" in r.getMessage() for r in caplog.records)
    assert layer.plan((2, 8, 32, 32)).planner == "auto"


def test_the_cache_keeps_at_most_max_choices_the_newest(calibrated, monkeypatch):
    monkeypatch.setattr(cache, "MAX_CHOICES", 5)
    for n in range(8):
        calibration.remember("cpu", torch.float32, f"mixing batch {n}, test",
                             {"op": "conv1x1", "seconds": {}})
    kept = list(json.loads(calibrated.read_text())["choices"])
    assert [k.rsplit("batch ", 1)[1] for k in kept] == [f"{n}, test" for n in range(3, 8)]


def test_export_before_any_call_measures_nothing_under_fake_tensors(calibrated, monkeypatch):
    """torch.export of a layer never called: with calibration on and an empty cache, planning
    the traced class measured the cost model under export's fake tensors, and export failed
    ("a fake tensor in the exported program constant's list")."""
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("measured"))
    layer = tnspec.formats.htk2(16, 16, 3, rank=4, padding=1).layer()
    x = torch.randn(2, 16, 8, 8)
    exported = torch.export.export(layer, (x,))
    monkeypatch.undo()
    torch.testing.assert_close(exported.module()(x), layer(x), rtol=1e-4, atol=1e-5)


def _fake_clock(monkeypatch, lead: list[float]) -> list[int]:
    """``Layer._time`` replaced: the model's order (the first class) takes 1 s, every other
    ``lead[0]`` s (a list, so that a test can change it between calls). Returns the number
    of classes of each call."""
    calls = []

    def fake(self, classes, shape, repeats, channels_last=False):
        calls.append(len(classes))
        return quiet([1.0] + [lead[0]] * (len(classes) - 1))
    monkeypatch.setattr(tnspec.Layer, "_time", fake)
    monkeypatch.setattr(calibration, "time_mixing",
                        lambda step, device, dtype, repeats, **k: {"conv1x1": 1.0, "einsum": 2.0})
    return calls


def _orders(path) -> list[dict]:
    return [v for v in json.loads(path.read_text())["choices"].values() if "order" in v]


def test_a_recalled_order_that_leads_no_more_is_dropped_within_the_process(
        calibrated, monkeypatch):
    """A choice measured once (on a busy machine, say) must not persist: a process that
    recalls an order other than the model's times the two once, and where the lead is gone
    runs the model's order and writes that to the cache; the next process trusts it."""
    tnspec.calibrate()
    lead = [0.5]
    calls = _fake_clock(monkeypatch, lead)
    x = torch.randn(4, 16, 8, 8)
    first = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)
    model_order = runtime.source_of(first._planned((4, 16, 8, 8)).forward)
    first(x)
    (entry,), timed = _orders(calibrated), len(calls)
    assert timed == 2 and calls[1] == 2  # a lead is confirmed in a second set of rounds
    assert entry["order"] != next(iter(entry["candidates"])) and entry["seconds"] == 0.5
    assert {c["median"] for c in entry["candidates"].values()} == {1.0, 0.5}
    assert entry["when"] > 0 and entry["conditions"]["threads"] == torch.get_num_threads()
    calibration.forget()  # a new process, on a machine where the lead is gone
    lead[0] = 0.97
    again = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)
    again(x)
    assert calls[timed:] == [2]  # the recalled order against the model's, once
    assert runtime.source_of(again._last_class.forward) == model_order
    (entry,) = _orders(calibrated)
    assert entry["order"] == next(iter(entry["candidates"])) and "led no more" in \
        entry["dropped"]
    calibration.forget()
    tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)(x)
    assert len(calls) == timed + 1  # the model's order is recalled without timing


def test_a_recalled_lead_that_holds_is_kept_and_checked_once_a_process(calibrated, monkeypatch):
    tnspec.calibrate()
    calls = _fake_clock(monkeypatch, [0.5])
    x = torch.randn(4, 16, 8, 8)
    tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)(x)
    (chosen,) = _orders(calibrated)
    calibration.forget()
    for r1 in (3, 3):  # two layers of one spec in one process: one check
        tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=r1, kh=3, kw=3)(x)
    assert calls == [calls[0], 2, 2] and _orders(calibrated) == [chosen]


def test_a_lead_measured_on_a_busy_machine_runs_but_is_not_kept(calibrated, monkeypatch):
    tnspec.calibrate()
    calls = _fake_clock(monkeypatch, [0.5])
    monkeypatch.setattr(calibration, "others_running", lambda: 2 * (os.cpu_count() or 1))
    layer = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)
    layer(torch.randn(4, 16, 8, 8))
    assert runtime.source_of(layer._last_class.forward) != \
        runtime.source_of(layer._planned((4, 16, 8, 8)).forward)  # the faster order runs
    assert _orders(calibrated) == [] and len(calls) == 2
    _fake_clock(monkeypatch, [0.99])  # no lead: the model's order is kept, busy or not
    tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=4, kh=3, kw=3)(torch.randn(4, 16, 8, 8))
    assert len(_orders(calibrated)) == 1


def test_a_lead_inside_the_spread_of_the_rounds_is_noise_and_not_kept(calibrated, monkeypatch):
    """A switch away from the model's order needs a lead larger than the measured spread, in
    the first set of rounds and again in a second: a fake clock whose other order is 20%
    faster in the median but scattered over 30% keeps the model's order; a lead that clears
    the spread twice is kept, with every candidate's median, spread and the conditions."""
    tnspec.calibrate()
    monkeypatch.setattr(calibration, "time_mixing",
                        lambda step, device, dtype, repeats, **k: {"conv1x1": 1.0, "einsum": 2.0})
    spread = [0.3]
    calls = []

    def fake(self, classes, shape, repeats, channels_last=False):
        calls.append(len(classes))
        return [Timing(1.0, 0.05)] + [Timing(0.8, spread[0])] * (len(classes) - 1)
    monkeypatch.setattr(tnspec.Layer, "_time", fake)
    x = torch.randn(4, 16, 8, 8)
    noisy = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)
    noisy(x)
    assert runtime.source_of(noisy._last_class.forward) == \
        runtime.source_of(noisy._planned((4, 16, 8, 8)).forward)
    (entry,) = _orders(calibrated)
    assert entry["order"] == next(iter(entry["candidates"])) and len(calls) == 1
    assert {c["spread"] for c in entry["candidates"].values()} == {0.05, 0.3}
    assert entry["spec"] == noisy.spec and entry["conditions"]["cpus"] == os.cpu_count()
    spread[0] = 0.02  # the same lead, now clear of the spread: confirmed, then kept
    calls.clear()
    clear = tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=4, kh=3, kw=3)
    clear(x)
    assert calls[1] == 2 and runtime.source_of(clear._last_class.forward) != \
        runtime.source_of(clear._planned((4, 16, 8, 8)).forward)
    assert [e["order"] != next(iter(e["candidates"])) for e in _orders(calibrated)] == \
        [False, True]


def test_networks_that_differ_only_in_names_share_one_entry(calibrated, monkeypatch):
    """The cache key is the network with its tensor and index names made canonical: the CP
    layer of ``formats.cp`` and the same network written with other names recall one
    measurement (each got its own before, and could run different orders)."""
    tnspec.calibrate()
    calls = _fake_clock(monkeypatch, [0.5])
    cp = "x[b, c, h+kh-1, w+kw-1], A[c, r], H[kh, r], V[kw, r], B[r, o] -> y[b, o, h, w]"
    renamed = ("inp[n, ci, i+k-1, j+l-1], U[ci, s], K1[k, s], K2[l, s], W[s, co] -> "
               "out[n, co, i, j]")
    x = torch.randn(4, 16, 8, 8)
    first = tnspec.layer(cp, c=16, o=16, r=4, kh=3, kw=3)
    first(x)
    (entry,) = _orders(calibrated)
    calibration.forget()  # a new process
    second = tnspec.layer(renamed, ci=16, co=16, s=4, k=3, l=3)
    names = dict(A="U", H="K1", V="K2", B="W", bias="bias")
    second.load_state_dict({names[n]: p for n, p in first.state_dict().items()})
    torch.testing.assert_close(second(x), first(x))
    assert calls == [calls[0], 2, 2]  # the first timing, its confirmation, one re-check
    assert _orders(calibrated) == [entry]
    other = tnspec.layer(cp, c=16, o=16, r=5, kh=3, kw=3)  # other sizes: another entry
    other(x)
    assert len(_orders(calibrated)) == 2


def test_an_embedding_times_the_cuts_of_its_modes_and_runs_the_fastest(
        calibrated, monkeypatch):
    tnspec.calibrate()
    timed = []

    def last_is_fastest(self, classes, shape, repeats, channels_last=False):
        timed.append(len(classes))
        return quiet([1.0] * (len(classes) - 1) + [0.5])
    monkeypatch.setattr(tnspec.Layer, "_time", last_is_fastest)
    emb = tnspec.embedding("tt", 1000, 64, rank=4)
    ids = torch.randint(0, 1000, (3, 50))
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.dense_weight()))
    planned = lookup_shape(emb.network, ids.shape)
    assert timed[0] >= 3 and emb.plan(ids.shape).runs != emb._plan(planned).runs  # not the
    # cost model's cut
    (entry,) = _orders(calibrated)
    assert entry["order"].startswith("cut ")


def test_the_cli_shows_the_measured_choices_with_margins_and_forgets_a_pattern(
        calibrated, monkeypatch):
    tnspec.calibrate()
    _fake_clock(monkeypatch, [0.5])
    x = torch.randn(4, 16, 8, 8)
    tnspec.layer(TUCKER2, c=16, o=16, r0=2, r1=3, kh=3, kw=3)(x)
    env_run = [sys.executable, "-m", "tnspec", "calibrate"]  # the fixture's environment
    shown = subprocess.run(env_run + ["--show"], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert "0.50x the time of the cost model's choice" in shown.stdout
    assert "runs as conv1x1, einsum 2.00x its time" in shown.stdout
    assert f"order of {TUCKER2} (c=16" in shown.stdout  # in the spec's own names
    mixing = len(calibration.choices("mixing *"))
    assert mixing and len(calibration.choices()) == mixing + 1
    gone = subprocess.run(env_run + ["--forget", "order of *"], capture_output=True,
                          text=True, timeout=300)
    assert gone.returncode == 0 and "dropped 1 measured choices" in gone.stdout
    calibration.forget()
    assert len(calibration.choices()) == mixing and calibration.drop("batch") == mixing


def test_time_orders_reads_the_injected_clock_into_medians_and_spreads(monkeypatch):
    """Each class's forward and backward is timed by ``autotune.clock`` in interleaved rounds
    (the first one a warm-up): a fake clock that makes the second class's calls take 0.5 s
    in every round but one gives it a median of 0.5 s and the spread of its middle half."""
    from tnspec.nn import autotune
    layer = tnspec.layer(TUCKER2, c=4, o=4, r0=2, r1=2, kh=3, kw=3, autotune=False)
    shape = (2, 4, 6, 6)
    classes = [layer._planned(shape)] * 2
    durations = [1.0, 0.5, 1.1, 0.5, 0.9, 0.5, 1.0, 2.0, 1.2, 0.5]  # rounds of (model, other)
    # each call of the clock moves it on: nothing before a start, a duration before an end
    # (the warm-up round's are read and dropped)
    steps = iter([0.0, 9.0, 0.0, 9.0] + [x for d in durations for x in (0.0, d)])
    now = [0.0]

    def fake() -> float:
        now[0] += next(steps)
        return now[0]
    monkeypatch.setattr(autotune, "clock", fake)
    model, other = autotune.time_orders(layer, classes, shape, repeats=5)
    assert model.median == pytest.approx(1.0) and other.median == pytest.approx(0.5)
    assert model.spread == pytest.approx(0.1) and other.spread == pytest.approx(0.0)
    assert other.leads(model) and not model.leads(other)
