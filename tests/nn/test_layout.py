"""tensorize(memory_format=...): the whole model laid out channels-last when asked, or when a
training step measured on an example is clearly faster so (a fake clock decides here); the
model computes the same either way, and timing leaves its buffers and the RNG as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tnspec
from tnspec.nn import layout

from ..model_state import snapshot, unchanged


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def laid_out(model: nn.Module) -> bool:
    """Whether the model's 4-D parameters are channels-last; those whose strides both layouts
    share (a dense conv's 1x1 weight, CP's C[r, 1, 1, kw]) tell nothing."""
    convs = [p for p in model.parameters() if p.dim() == 4 and not (
        p.is_contiguous() and p.is_contiguous(memory_format=torch.channels_last))]
    assert convs, "no 4-D parameter whose layout shows"
    return all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)


@pytest.fixture
def fake_clock(monkeypatch):
    """A clock whose steps take ``times[layout]`` seconds, the layout being the model's when
    the step ends; ``calls`` counts the steps, ``times`` may be changed between them."""
    state = {"now": 0.0, "model": None, "calls": 0,
             "times": {"channels_last": 0.5, "contiguous_format": 1.0}, "after": None}

    def clock() -> float:
        state["calls"] += 1
        if state["calls"] % 2 == 0:  # a step's end
            which = "channels_last" if laid_out(state["model"]) else "contiguous_format"
            times = state["times"]
            if state["after"] is not None and state["calls"] > state["after"]:
                times = {k: 1.0 for k in times}
            state["now"] += times[which]
        return state["now"]
    monkeypatch.setattr(layout, "clock", clock)
    monkeypatch.setattr(layout.calibration, "busy", lambda *a, **k: False)
    return state


def test_channels_last_when_asked_converts_every_4d_tensor_and_computes_the_same():
    net = small_net().eval()
    x = torch.randn(2, 3, 8, 8)
    net, report = tnspec.tensorize(net, "cp", rank=4, include="3",
                                   memory_format=torch.channels_last)
    assert laid_out(net) and isinstance(net[3], tnspec.Layer)
    assert "memory format: channels_last (asked)" in str(report)
    out = net(x.contiguous(memory_format=torch.channels_last))
    assert layout.convert(net, "contiguous_format") == report.layout.converted
    assert not laid_out(net)
    torch.testing.assert_close(out, net(x))


def test_convert_leaves_tensors_of_other_ranks_alone():
    model = nn.Module()
    model.core = nn.Parameter(torch.randn(2, 3, 4, 5, 6))
    model.kernel = nn.Parameter(torch.randn(2, 3, 4, 5))
    kernel = model.kernel
    assert layout.convert(model, "channels_last") == 1
    assert model.core.is_contiguous() and model.kernel is kernel
    assert kernel.is_contiguous(memory_format=torch.channels_last)
    assert layout.convert(model, "contiguous_format") == 1 and kernel.is_contiguous()


def test_auto_takes_a_true_lead_and_says_so(fake_clock, caplog):
    net = small_net()
    fake_clock["model"] = net
    with caplog.at_level("INFO", logger="tnspec"):
        net, report = tnspec.tensorize(net, "cp", rank=4, include="3", memory_format="auto",
                                       example=(2, 3, 8, 8))
    assert str(report.layout) in caplog.text  # also where a program logs, not prints
    assert laid_out(net)
    assert report.layout.format == "channels_last"
    # every 4-D parameter but those whose strides both layouts share (CP's 1x1 factors)
    assert report.layout.converted == sum(p.dim() == 4 and not p.is_contiguous()
                                          for p in net.parameters()) > 0
    assert "memory format: channels_last end to end, measured faster: channels_last took " \
        "0.50x the time of contiguous_format (500.0 against 1000.0 ms" in str(report)


def test_auto_keeps_the_layout_when_the_lead_does_not_hold_in_a_second_set(fake_clock):
    net = small_net()
    fake_clock["model"] = net
    fake_clock["after"] = 2 * 2 * 6  # the first set: a warm-up round and 5, two steps each
    net, report = tnspec.tensorize(net, "cp", rank=4, include="3", memory_format="auto",
                                   example=torch.randn(2, 3, 8, 8))
    assert not laid_out(net) and report.layout.format == "contiguous_format"
    assert "kept contiguous_format: channels_last took 0.50x" in str(report)
    assert "not clearly faster" in str(report)


def test_auto_does_not_trust_a_lead_measured_on_a_busy_machine(fake_clock, monkeypatch):
    net = small_net()
    fake_clock["model"] = net
    monkeypatch.setattr(layout.calibration, "busy", lambda *a, **k: True)
    net, report = tnspec.tensorize(net, "cp", rank=4, include="3", memory_format="auto",
                                   example=(2, 3, 8, 8))
    assert not laid_out(net)
    assert "other threads took the CPUs while it was timed" in str(report)


def test_auto_restores_batch_norm_statistics_and_the_random_state(fake_clock):
    net = small_net()
    fake_clock["model"] = net
    fake_clock["times"] = {"channels_last": 1.0, "contiguous_format": 1.0}  # no lead
    net.train()
    mixed = net[3].weight
    mixed.data = mixed.data.contiguous(memory_format=torch.channels_last)  # one layer only
    stats = net[1].running_mean.clone(), net[1].num_batches_tracked.clone()
    rng = torch.get_rng_state()
    layout.choose(net, (2, 3, 8, 8))
    assert torch.equal(net[1].running_mean, stats[0])
    assert torch.equal(net[1].num_batches_tracked, stats[1])
    assert torch.equal(torch.get_rng_state(), rng)
    # kept: every tensor in the layout it had, the mixed one too
    assert net[0].weight.is_contiguous() and not mixed.is_contiguous()


@pytest.mark.parametrize("kwargs, match", [
    ({"memory_format": "auto"}, r"memory_format='auto' times the model on an example input"),
    ({"example": (2, 3, 8, 8)}, r"example= is what memory_format='auto' times"),
    ({"memory_format": "fast"}, r"memory_format='fast'"),
    ({"memory_format": "auto", "example": (2, 3)},
     r"chooses the layout of images \(4-D input\) or volumes \(5-D\); the example has 2"),
    ({"memory_format": "auto", "example": (2, 5, 8, 8)}, r"the model failed on the example"),
    ({"memory_format": "auto", "example": torch.randn(8, 3, 8)},
     r"the example has 3 dimension\(s\)"),
    ({"memory_format": "auto", "example": "big"}, r"example='big'"),
    ({"memory_format": "auto", "example": "2388"}, r"example='2388'"),
])
def test_bad_memory_format_arguments_are_clear_errors(kwargs, match):
    net = small_net()
    before = snapshot(net)
    with pytest.raises(tnspec.SpecError, match=match):
        tnspec.tensorize(net, "cp", rank=4, include="3", **kwargs)
    assert unchanged(before, net)  # checked before any layer was replaced, the example too


def test_auto_restores_a_buffer_the_state_dict_leaves_out(fake_clock):
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return x
    net = nn.Sequential(Counting(), small_net())
    fake_clock["model"] = net
    layout.choose(net, (2, 3, 8, 8))
    assert net[0].calls.item() == 0
