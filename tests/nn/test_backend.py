"""Back end: every zoo member and example matches the independent dense reference in float64,
values and gradients; gradcheck on small cases."""

from __future__ import annotations

import numpy
import pytest
import torch

import tnspec
from tnspec.nn.api import example_shape, generate

from ..conftest import EXAMPLES, quiet
from ..generated import compare
from ..zoo import CASES, spec

pytestmark = pytest.mark.usefixtures("float64")  # exact comparisons, 1e-10


@pytest.mark.parametrize("fmt, dims, stride, pad, dilation", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_zoo_matches_dense_reference(fmt, dims, stride, pad, dilation):
    text, sizes, shape = spec(fmt, dims, stride, pad, dilation)
    torch.manual_seed(0)
    module = tnspec.layer(text, dtype=torch.float64, **sizes)
    with torch.no_grad():
        if module.bias is not None:
            module.bias.normal_()
    compare(module, torch.randn(2, *shape))


TWO_D = [c for c in CASES if c[1] == 2]


@pytest.mark.parametrize("op", ["conv1x1", "einsum"])
@pytest.mark.parametrize("fmt, dims, stride, pad, dilation", TWO_D,
                         ids=["-".join(map(str, c)) for c in TWO_D])
def test_zoo_channel_mixing_forced_to_each_op_in_both_layouts(fmt, dims, stride, pad, dilation,
                                                              op, monkeypatch):
    """Channel mixing forced to 1x1 convs (1-D over the flattened axes of a contiguous input,
    2-D over a channels-last one) or to products (a 1x1 core's conv too: a batched matmul of
    a view of contiguous data, a matmul of the matrix channels-last data is stored as)."""
    monkeypatch.setattr(tnspec.planning.calibration, "chooser",
                        lambda *a, **k: lambda step: op)
    text, sizes, shape = spec(fmt, dims, stride, pad, dilation)
    torch.manual_seed(0)
    module = tnspec.layer(text, dtype=torch.float64, **sizes)
    x = torch.randn(2, *shape)
    compare(module, x)
    compare(module, x.contiguous(memory_format=torch.channels_last))


@pytest.mark.parametrize("fmt, dims, stride, pad, dilation", TWO_D,
                         ids=["-".join(map(str, c)) for c in TWO_D])
def test_zoo_run_channels_last_inside_matches_the_dense_reference(fmt, dims, stride, pad,
                                                                   dilation, monkeypatch):
    """The autotuner's candidate that converts a contiguous input to channels-last, runs the
    channels-last lowering and hands the result back contiguous."""
    text, sizes, shape = spec(fmt, dims, stride, pad, dilation)
    torch.manual_seed(0)
    module = tnspec.layer(text, dtype=torch.float64, **sizes)
    x = torch.randn(2, *shape)
    cls = tnspec.emit.runtime.layer_class(module.network, module.plan(x.shape), convert=True)
    monkeypatch.setattr(module, "_class", lambda shape, channels_last=False: cls)
    compare(module, x)
    assert module(x).is_contiguous()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_match_dense_reference(path):
    text = path.read_text()
    for net in tnspec.compile_all(text):
        torch.manual_seed(0)
        module = tnspec.layer(text, name=net.name, dtype=torch.float64)
        compare(module, torch.randn(*example_shape(net, {"b": 2}, default=6)))


@pytest.mark.parametrize("planner", ["auto", "dp", "greedy", "dense-first", "left-to-right"])
def test_every_planner_computes_the_same_layer(planner):
    text, sizes, shape = spec("tr", 2, 2, "same", 1)
    torch.manual_seed(0)
    module = tnspec.layer(text, planner=planner, dtype=torch.float64, **sizes)
    compare(module, torch.randn(2, *shape))


@pytest.mark.parametrize("text, sizes, shape", [
    ("x[b, c, 2*h+kh-1], U[c, r], K[r, kh, o] -> y[b, o, h]", dict(c=2, r=2, kh=3, o=2), (2, 2, 6)),
    ("x[b, (i0 i1)], A[i0, o0, r], B[r, i1, o1] -> y[b, (o0 o1)]",
     dict(i0=2, i1=3, o0=2, o1=2, r=2), (2, 6)),
    ("x[b, c, 2*t], D[c, o] -> y[b, c, o, t]", dict(c=2, o=3), (2, 2, 7)),
])
def test_gradcheck(text, sizes, shape):
    torch.manual_seed(0)
    module = tnspec.layer(text, dtype=torch.float64, **sizes)
    x = torch.randn(*shape, requires_grad=True)
    params = [getattr(module, c.name) for c in module.network.cores]

    def f(x, *ps):
        return tnspec.contract(module.network, x, dict(zip([c.name for c in
                                                            module.network.cores], ps)))
    assert torch.autograd.gradcheck(f, (x, *params))


def test_batch_index_in_a_group_is_inferred():
    module = tnspec.layer("x[(b t), c], W[c, o] -> y[b, t, o]", t=3, c=2, o=4)
    assert module(torch.randn(12, 2)).shape == (4, 3, 4)


def test_float32_and_float64():
    for dtype in (torch.float32, torch.float64):
        m = tnspec.layer("x[b, c, h+kh-1], W[o, c, kh] -> y[b, o, h]", c=2, o=3, kh=3,
                         dtype=dtype)
        assert m.W.dtype == dtype and m(torch.randn(2, 2, 5, dtype=dtype)).dtype == dtype


def test_four_conv_axes_on_one_core_is_refused_clearly():
    text = "x[b, c, p+kp-1, q+kq-1, h+kh-1, w+kw-1], W[c, kp, kq, kh, kw] -> y[b, p, q, h, w]"
    with pytest.raises(tnspec.SpecError, match="core 'W' carries 4 kernel indices") as info:
        tnspec.layer(text, c=2, kp=3, kq=3, kh=3, kw=3)
    assert (info.value.line, info.value.column) == (1, text.index("kw]") + 1)


def test_four_conv_axes_split_over_cores_work():
    text, sizes, _ = ("x[b, c, p+kp-1, q+kq-1, h+kh-1, w+kw-1], A[c, kp, kq, r], B[r, kh, kw]"
                      " -> y[b, p, q, h, w]", dict(c=2, kp=3, kq=3, kh=3, kw=3, r=2), None)
    torch.manual_seed(0)
    compare(tnspec.layer(text, **sizes), torch.randn(1, 2, 5, 5, 5, 5))


def test_spatial_axes_anywhere_in_the_input():
    text = "x[h+kh-1, b, c, 2*w+kw-2], U[c, r], K[r, kh, kw, o] -> y[o, w, b, h]"
    torch.manual_seed(0)
    compare(tnspec.layer(text, c=2, r=3, kh=3, kw=3, o=2), torch.randn(7, 2, 2, 8))


def test_compile_gives_a_network_with_plan():
    net = tnspec.compile("x[b, c, h+kh-1], W[o, c, kh] -> y[b, o, h]", c=4, o=8, kh=3)
    plan = tnspec.Layer(net).plan((2, 4, 10))
    assert [s.op for s in plan.steps] == ["conv"] and plan.network.sizes["h"] == 10


def test_index_names_that_are_keywords_of_the_api_go_in_sizes():
    text = "x[b, name], W[name, init] -> y[b, init]"
    m = tnspec.layer(text, sizes={"name": 4, "init": 3}, init="graph-out")
    assert m.sizes == {"name": 4, "init": 3} and m.network.options.init == "graph-out"
    assert m(torch.ones(2, 4)).shape == (2, 3)
    assert tnspec.compile("x[b, text], W[text, o] -> y[b, o]", text=2, o=3).sizes["text"] == 2
    assert "def __init__(self, name: int = 4, init: int = 3," in generate(
        text, sizes={"name": 4, "init": 3})
    with pytest.raises(tnspec.SpecError, match="size 'o' is given twice"):
        tnspec.layer("x[b, i], W[i, o] -> y[b, o]", sizes={"i": 2, "o": 3}, o=4)


def test_autotune_keeps_a_correct_candidate():
    text, sizes, shape = spec("tr", 2, 1, "same", 1)
    torch.manual_seed(0)
    module = tnspec.layer(text, autotune=True, **sizes)
    x = torch.randn(2, *shape)
    compare(module, x)
    assert module._shape_key(tuple(x.shape)) in module._classes  # timed once, then cached


@pytest.mark.parametrize("leads, keeps_model",
                         [((0.95,), True), ((0.8, 0.85), False), ((0.8, 0.97), True)])
def test_autotune_keeps_the_models_order_unless_another_is_clearly_faster(
        monkeypatch, leads, keeps_model):
    """Another order replaces the model's only when 10% faster in the first rounds and again
    in rounds against the model's order alone (a lead that does not hold is noise)."""
    text, sizes, shape = spec("tr", 2, 1, "same", 1)
    module = tnspec.layer(text, autotune=True, **sizes)
    timed = []

    def fake(self, classes, shape, repeats, channels_last=False):
        lead = leads[len(timed)]
        timed.append(classes)
        return quiet([1.0] + [lead] * (len(classes) - 1))  # the model's order is timed first
    monkeypatch.setattr(tnspec.Layer, "_time", fake)
    compare(module, torch.randn(2, *shape))
    assert len(timed) == len(leads) and len(timed[0]) >= 2
    if len(leads) == 2:  # the confirming rounds: the model's order and the leader
        assert timed[1] == [timed[0][0], timed[0][1]]
    assert module._last_class is timed[0][0 if keeps_model else 1]


CONVERTS = "x = x.contiguous(memory_format=torch.channels_last)"


def test_autotune_times_the_models_order_run_channels_last_inside_for_a_contiguous_image(
        monkeypatch):
    """For a 2-D conv's contiguous input the model's order run channels-last inside is a
    candidate (kept where clearly faster); not for a channels-last input or a 1-D conv."""
    timed = []

    def fake(self, classes, shape, repeats, channels_last=False):
        timed.append([CONVERTS in tnspec.emit.runtime.source_of(c.forward) for c in classes])
        return quiet([1.0] * (len(classes) - 1) + [0.5])  # the last candidate clearly fastest
    monkeypatch.setattr(tnspec.Layer, "_time", fake)
    text, sizes, shape = spec("tucker2", 2, 1, "same", 1)
    module = tnspec.layer(text, autotune=True, **sizes)
    x = torch.randn(2, *shape)
    compare(module, x)
    assert timed[0][-1] and not any(timed[0][:-1])
    source = tnspec.emit.runtime.source_of(module._last_class.forward)
    assert CONVERTS in source and "y = y.contiguous()  # back to the caller's layout" in source
    timed.clear()
    compare(module, x.contiguous(memory_format=torch.channels_last))
    text, sizes, shape = spec("tucker2", 1, 1, "same", 1)
    compare(tnspec.layer(text, autotune=True, **sizes), torch.randn(2, *shape))
    assert timed and not any(any(t) for t in timed)


@pytest.mark.parametrize("prune", [None, float("inf")])
def test_autotune_does_not_time_an_order_the_model_prices_far_above_the_cheapest(
        monkeypatch, prune):
    # the Odd network's left-to-right order is priced ~35x the model's at this shape (timing
    # it at 64 channels took minutes and gigabytes); greedy (~2.3x) is still timed
    module = tnspec.formats.build("odd", 32, 32, 3, rank=0.5, padding=1).layer(autotune=True)
    if prune is not None:
        monkeypatch.setattr(tnspec.planning.calibration, "PRUNE", prune)
    timed = []

    def fake(self, classes, shape, repeats, channels_last=False):
        timed.append(len(classes))
        return quiet([1.0] * len(classes))
    monkeypatch.setattr(tnspec.Layer, "_time", fake)
    module(torch.randn(4, 32, 16, 16))
    # auto (= dense-first), greedy[, left-to-right], auto run channels-last inside
    assert timed == [4 if prune else 3]


def test_a_new_batch_size_in_the_same_class_is_not_planned_again_and_the_cache_is_bounded(
        monkeypatch):
    text, sizes, shape = spec("tucker2", 2, 1, "same", 1)
    module = tnspec.layer(text, **sizes)
    planned = []
    real = tnspec.nn.module.plan
    monkeypatch.setattr(tnspec.nn.module, "plan",
                        lambda *a, **k: planned.append(a[0]) or real(*a, **k))
    for batch in (32, 30, 24, 33, 45):  # one class: nearest power of two is 32
        compare(module, torch.randn(batch, *shape))
    assert len(planned) == 1
    compare(module, torch.randn(2, *shape))
    assert len(planned) == 2
    module.plan_cache_size = 3
    for side in (3, 6, 12, 24, 48):  # new spatial size classes are new plans, oldest dropped
        module(torch.randn(2, shape[0], side, side))
    assert len(module._classes) == 3
    assert list(module._classes)[-1] == (2, shape[0], 64, 64)
    compare(module, torch.randn(2, shape[0], 50, 47))  # the same class: not planned again
    assert len(module._classes) == 3 and list(module._classes)[-1] == (2, shape[0], 64, 64)


@pytest.mark.parametrize("context", ["plain", "no_grad", "inference_mode", "frozen"])
def test_autotune_leaves_the_rng_and_grad_mode_alone_and_handles_frozen_cores(context):
    text, sizes, shape = spec("tr", 2, 1, "same", 1)
    module = tnspec.layer(text, autotune=True, **sizes)
    if context == "frozen":
        module.requires_grad_(False)
    x = torch.randn(2, *shape)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    with modes.get(context, torch.enable_grad)():
        y = module(x)
        grad_enabled = torch.is_grad_enabled()
    assert torch.equal(torch.get_rng_state(), state)
    assert grad_enabled == (context not in modes)
    assert not y.requires_grad or context == "plain"
    torch.testing.assert_close(y, module._planned(tuple(x.shape)).forward(module, x))


def test_friendly_errors_for_wrong_python_arguments():
    text, sizes = "x[b, i], W[i, o] -> y[b, o]", dict(i=2, o=3)
    layer = tnspec.layer(text, **sizes)
    for bad in ([[1.0, 2.0]], (1.0, 2.0), numpy.ones((3, 2))):
        with pytest.raises(TypeError, match="Layer takes a torch.Tensor, not "
                           "(list|tuple|ndarray); "
                           r"convert it with torch.as_tensor\(x\)"):
            layer(bad)
    with pytest.raises(TypeError, match="contract takes a torch.Tensor, not list"):
        tnspec.contract(text, [[1.0, 2.0]], {"W": layer.W})
    for weights, match in [({"Q": 1}, "init_weights names 'Q', which is not a core"),
                           ({"W": -1}, r"init_weights\['W'\] = -1 is not a positive number"),
                           ({"W": "x"}, r"init_weights\['W'\] = 'x' is not a positive number"),
                           ([("W", 1)], "init_weights must be a dict, not list")]:
        with pytest.raises(tnspec.SpecError, match=match):
            tnspec.layer(text, init_weights=weights, **sizes)
    with pytest.raises(tnspec.SpecError, match="unknown planner 'nope'"):
        tnspec.layer(text, planner="nope", **sizes)  # at construction, not at the first call
    with pytest.raises(tnspec.SpecError, match="unknown planner 'nope'"):
        layer.planner = "nope"  # set later too
    for limit in ("x", 0, 2.5):
        with pytest.raises(tnspec.SpecError, match=f"max_elements={limit!r} must be a positive"):
            tnspec.layer(text, max_elements=limit, **sizes)
        with pytest.raises(tnspec.SpecError, match=f"max_bytes={limit!r} must be a positive"):
            tnspec.layer(text, max_bytes=limit, **sizes)


def test_autotune_always_times_the_reconstruct_first_order(monkeypatch):
    """The cost model prices CP's dense-first order (the kernel rebuilt, one dense conv) far
    above the factorized one, past PRUNE; it is timed all the same: it costs what the dense
    layer would, and where the model overprices it, it is the floor."""
    cp = "x[b, c, h+kh-1, w+kw-1], A[c, r], H[kh, r], V[kw, r], B[r, o] -> y[b, o, h, w]"
    module = tnspec.layer(cp, c=128, o=128, r=1, kh=3, kw=3, autotune=True)
    shape = (4, 128, 18, 18)
    bound = tnspec.shapes.bind_shape(module.network, shape)
    prices = {name: sum(s.seconds for s in tnspec.planning.plan.plan(bound, name).steps)
              for name in ("auto", "dense-first")}
    assert prices["dense-first"] > tnspec.planning.calibration.PRUNE * prices["auto"]
    dense_first = tnspec.emit.runtime.source_of(tnspec.emit.runtime.layer_class(
        module.network, tnspec.planning.plan.plan(bound, "dense-first")).forward)
    timed = []

    def fake(self, classes, shape, repeats, channels_last=False):
        timed.extend(tnspec.emit.runtime.source_of(c.forward) for c in classes)
        return quiet([1.0] * len(classes))
    monkeypatch.setattr(tnspec.Layer, "_time", fake)
    compare(module, torch.randn(*shape))
    assert dense_first in timed


def test_on_a_gpu_candidates_are_timed_by_the_device_without_their_launches(monkeypatch):
    """On CUDA, ``autotune.stopwatch`` times a candidate by events around its kernels queued
    behind a sleep of the stream, so that the host's launches (which a CUDA graph or a
    compiled step does not pay) are not counted: here the host takes 5 ms to queue what the
    device runs in 1 ms, and 1 ms is what is read. The sleep grows to outlast the queueing.
    Checked with a fake stream: the events read a device clock that only the sleep and the
    kernels move."""
    from tnspec.nn import autotune
    device = {"now": 0.0, "sleeps": []}
    host = {"now": 0.0}

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at = None

        def record(self) -> None:
            self.at = device["now"]

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: "Event") -> float:
            return (end.at - self.at) * 1e3  # milliseconds, as CUDA's

    def sleep(cycles: int) -> None:
        device["sleeps"].append(cycles)
        device["now"] += cycles / 2e9

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", sleep)
    monkeypatch.setattr(autotune, "clock", lambda: host["now"])
    watch = autotune.stopwatch(torch.device("cuda"))
    assert isinstance(watch, autotune.DeviceWatch)
    for _ in range(2):
        watch.start()
        host["now"] += 5e-3  # the host queues for 5 ms ...
        device["now"] += 1e-3  # ... kernels the device runs in 1 ms
        assert watch.stop() == pytest.approx(1e-3)
    assert device["sleeps"][0] < 3e7 <= device["sleeps"][1]  # 3 x 5 ms at 2 GHz
    assert isinstance(autotune.stopwatch(torch.device("cpu")), autotune.HostWatch)


def test_a_layer_planning_inside_a_cuda_graph_capture_times_nothing(calibrated, monkeypatch):
    """A layer first called on a shape while a CUDA graph is being captured (not warmed up
    on it) must not time orders, calibrate or time channel mixing: each synchronizes, which
    a capture forbids. It plans from the cache and the cost model instead. Checked on the CPU
    with the capture faked."""
    from tnspec.nn import autotune
    from tnspec.planning import calibration
    layer = tnspec.formats.tucker2(16, 16, 3, rank=4, padding=1).layer(autotune=True)
    x = torch.randn(2, 16, 8, 8)
    want = layer(x)  # outside a capture: calibrated, timed
    layer._drop_code()
    calibration.forget()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(autotune, "time_orders", lambda *a, **k: pytest.fail("timed orders"))
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: pytest.fail("calibrated"))
    monkeypatch.setattr(calibration, "time_mixing", lambda *a, **k: pytest.fail("timed mixing"))
    assert calibration.capturing()
    torch.testing.assert_close(layer(x), want)
    other = tnspec.formats.tucker2(16, 16, 3, rank=4, padding=1).layer(autotune=True)
    other(torch.randn(3, 16, 20, 20))  # a shape nothing was measured for: still no timing


def test_a_planner_set_after_a_call_plans_anew():
    """``layer.planner = ...`` after the layer ran at a shape: that shape's next call runs the
    new planner's order, not the class kept for the old one."""
    layer = tnspec.layer("x[b, c, h+kh-1], U[c, r], W[r, o, kh] -> y[b, o, h]", c=4, o=4, r=2,
                         kh=3, planner="dense-first")
    x = torch.randn(2, 4, 8)
    y = layer(x)
    assert layer._running(x).alone  # the kernel built, then one conv
    layer.planner = "left-to-right"
    assert not layer._running(x).alone  # the data meets U first
    torch.testing.assert_close(layer(x), y)
    assert layer.planner == "left-to-right"


def test_max_bytes_set_after_a_call_plans_anew_and_old_pickles_load():
    """``layer.max_bytes = ...`` after the layer ran at a shape is a limit on that shape's next
    plan too (the class kept for the old limit ran on); a bad value is refused as in the
    constructor; a layer pickled when both settings were plain attributes loads with them."""
    layer = tnspec.layer("x[b, c, h+kh-1], U[c, r], W[r, o, kh] -> y[b, o, h]", c=4, o=4, r=2,
                         kh=3)
    x = torch.randn(2, 4, 8)
    layer(x)
    layer.max_bytes = 64
    with pytest.raises(tnspec.SpecError, match=r"would take \d+ bytes .* limit of 64 bytes"):
        layer(x)
    with pytest.raises(tnspec.SpecError, match="max_bytes=0 must be a positive int"):
        layer.max_bytes = 0
    assert layer.max_bytes == 64
    state = layer.__getstate__()
    state["planner"], state["max_bytes"] = state.pop("_planner"), state.pop("_max_bytes")
    old = type(layer).__new__(type(layer))
    old.__setstate__(state)
    assert (old.planner, old.max_bytes) == ("auto", 64)
