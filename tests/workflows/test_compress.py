"""Data-aware fitting (``Layer.fit_(weight, inputs=X)``, ``tnspec.moments``) and
``tnspec.compress``: the budget, the allocation, latency mode, interruption."""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tnspec
from tnspec import formats, progress
from tnspec.fit import moments
from tnspec.workflows.convert import observe
from tnspec.workflows.convert.allocate import allocate

from ..model_state import snapshot, unchanged

FAST = {"max_iter": 20, "max_seconds": 10}


def _dense_out(layer, x, weight):
    if weight.dim() == 2:
        return x @ weight.T
    conv = (F.conv1d, F.conv2d, F.conv3d)[weight.dim() - 3]
    return conv(x, weight, None, layer.stride, layer.padding, layer.dilation, layer.groups)


@pytest.mark.parametrize("fmt, kernel", [("tt", 3), ("tr", ()), ("tucker2", 3)])
def test_fit_to_inputs_recovers_an_exactly_representable_weight(fmt, kernel):
    torch.manual_seed(0)
    make = getattr(formats, fmt)
    spec = make(16, 16, kernel, rank=3, **({"padding": 1} if kernel else {}))
    weight = spec.layer().dense_weight().detach()
    shape = (8, 16, 6, 6) if kernel else (64, 16)
    scale = torch.logspace(0, -2, 16).view(1, 16, *([1] * (len(shape) - 2)))
    layer = spec.layer()
    assert layer.fit_(weight, inputs=torch.randn(shape) * scale) < 1e-4
    assert tnspec.fit.decompose.relative_error(layer.dense_weight(), weight) < 1e-4


CASES = {
    "linear": (lambda: nn.Linear(64, 48), lambda: formats.tucker2(64, 48, (), rank=0.2),
               (2000, 64)),
    "conv-stride-dilation": (
        lambda: nn.Conv2d(16, 16, 3, stride=2, padding=1, dilation=2),
        lambda: formats.tucker2(16, 16, 3, rank=0.15, stride=2, padding=1, dilation=2),
        (64, 16, 12, 12)),
    "conv-groups": (
        lambda: nn.Conv2d(16, 16, 3, padding=1, groups=2),
        lambda: formats.cp(16, 16, 3, rank=0.2, padding=1, groups=2), (64, 16, 10, 10)),
    "conv1d-tt": (lambda: nn.Conv1d(16, 16, 3, padding=1),
                  lambda: formats.tt(16, 16, (3,), rank=0.2, padding=1), (64, 16, 20)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fit_to_inputs_beats_the_weight_fit_on_held_out_outputs(case):
    make_dense, make_format, shape = CASES[case]
    torch.manual_seed(0)
    dense = make_dense()
    weight = dense.weight.detach()
    # a strongly anisotropic second moment: channel scales over three decades
    scale = torch.logspace(0, -3, shape[1]).view(1, shape[1], *([1] * (len(shape) - 2)))
    if len(shape) == 2:
        scale = torch.logspace(0, -3, shape[1])
    train, held_out = torch.randn(shape) * scale, torch.randn(shape) * scale
    errors = []
    for inputs in (None, train):
        layer = make_format().layer()
        layer.fit_(weight, inputs=inputs)
        with torch.no_grad():
            y = _dense_out(layer, held_out, weight)
            errors.append(((_dense_out(layer, held_out, layer.dense_weight()) - y).norm()
                           / y.norm()).item())
    assert errors[1] < 0.9 * errors[0], errors


def test_the_metric_is_the_second_moment_of_the_patches_the_conv_reads():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2)
    x = torch.randn(3, 4, 9, 8)
    rows = moments.patches(x, conv.kernel_size, conv.stride, conv.padding, conv.dilation)
    unfolded = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
    assert torch.allclose(rows, unfolded.transpose(1, 2).reshape(-1, 4 * 6))
    metric = moments.factor(rows, 2)
    per = rows.shape[1] // 2
    for g in range(2):
        block = rows[:, g * per:(g + 1) * per].double()
        assert torch.allclose(metric[g] @ metric[g].T, block.T @ block / len(block), atol=1e-9)
    layer = formats.cp(4, 6, 3, rank=2).layer()
    with pytest.raises(tnspec.SpecError, match=r"inputs of shape \(3, 5, 9, 8\) are not"):
        layer.fit_(layer.dense_weight().detach(), inputs=torch.randn(3, 5, 9, 8))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 24, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(24, 24, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(24 * 16, 10))


def _compress(model, budget, **kw):
    return tnspec.compress(model, budget, ("tucker2", "cp"), shares=(0.1, 0.3, 0.6),
                           exclude=["0"], fit=FAST, **kw)


@pytest.mark.parametrize("budget", [0.15, 0.4])
def test_the_budget_holds_exactly_and_data_lowers_the_model_error(budget):
    model = _model()
    x = torch.randn(32, 3, 8, 8)
    ref = model(x)
    errors = []
    for data in (None, x):
        small, report = _compress(copy.deepcopy(model), budget, data=data)
        names = [c.name for c in report.choices]
        actual = sum(p.numel() for n in names for p in small.get_submodule(n).parameters())
        assert actual == report.params_after <= budget * report.params_before
        assert report.params_before == sum(p.numel() for n in names
                                           for p in model.get_submodule(n).parameters())
        assert f"budget {budget:.0%}" in str(report)
        errors.append(((small(x) - ref).norm() / ref.norm()).item())
    assert errors[1] < errors[0]


def test_the_allocation_is_the_knapsack_optimum():
    items = [[(100, 0.0), (30, 0.5), (10, 0.9)], [(200, 0.0), (50, 0.2), (20, 0.7)],
             [(50, 0.0), (25, 0.1), (5, 0.8)]]
    for budget in (0.1, 0.2, 0.3, 0.5, 1.0):
        capacity = budget * 350
        best = min((sum(items[i][k][1] for i, k in enumerate(pick)), pick)
                   for pick in itertools.product(range(3), repeat=3)
                   if sum(items[i][k][0] for i, k in enumerate(pick)) <= capacity)
        picks = allocate(items, budget)
        assert sum(items[i][k][1] for i, k in enumerate(picks)) == pytest.approx(best[0])
    with pytest.raises(tnspec.SpecError, match="below what the smallest candidates need"):
        allocate(items, 0.05)
    # each layer's count rounded up to the DP's unit (7 here) sums past the budget, yet the
    # dense layers fit it exactly: keeping them is the answer, not an error
    assert allocate([[(4001, 0.0)], [(4001, 0.0)], [(4536, 0.0)]], 1.0) == [0, 0, 0]


def test_an_allocation_that_fits_by_a_few_parameters_is_found():
    # 36 layers at one rank fit half the budget with 360 parameters to spare; counted in units
    # of 900 rounded up, they would not, and two layers would get the far worse candidate
    items = [[(100_000, 0.0), (49_990, 1.0), (40_000, 5.0)]] * 36
    assert allocate(items, 0.5) == [1] * 36


def test_the_allocation_fits_the_budget_exactly_whatever_the_unit():
    rng = np.random.default_rng(0)
    for _ in range(200):
        items = [[(int(rng.integers(50, 200)), 0.0)]
                 + [(int(rng.integers(1, 120)), float(rng.random())) for _ in range(3)]
                 for _ in range(4)]
        budget = float(rng.uniform(0.2, 0.9))
        capacity = budget * sum(layer[0][0] for layer in items)
        feasible = [pick for pick in itertools.product(range(4), repeat=4)
                    if sum(items[i][k][0] for i, k in enumerate(pick)) <= capacity]
        if not feasible:
            continue
        cost = lambda pick: sum(items[i][k][1] for i, k in enumerate(pick))  # noqa: E731
        coarse = allocate(items, budget, units=7)  # a unit of a few dozen parameters
        assert sum(items[i][k][0] for i, k in enumerate(coarse)) <= capacity
        # no worse than counting each candidate rounded up to the unit, as before
        unit = -(-int(capacity) // 7)
        up = [pick for pick in feasible
              if sum(-(-items[i][k][0] // unit) for i, k in enumerate(pick)) <= capacity // unit]
        assert not up or cost(coarse) <= min(map(cost, up)) + 1e-12
        assert cost(allocate(items, budget)) == pytest.approx(min(map(cost, feasible)))


def test_latency_mode_never_picks_a_layer_slower_than_dense():
    def timer(module, shape):  # an injected clock: cp is slow, tucker2 fast
        if not isinstance(module, tnspec.Layer):
            return 1.0
        return 0.5 if "U[" in module.spec else 2.0  # tucker2's cores are U, G, V
    model = _model()
    small, report = _compress(model, 0.3, data=torch.randn(8, 3, 8, 8), latency=True,
                              timer=timer)
    assert all(c.chosen.format in ("dense", "tucker2") for c in report.choices)
    assert all(c.chosen.seconds <= c.dense_seconds for c in report.choices)
    assert "0.50x" in str(report)


def test_latency_times_the_served_forward_at_the_datas_batch_and_at_batch_1():
    """A served model runs forward without autograd, at a batch the data need not show: a
    candidate faster at the data's batch but slower at batch 1 is dropped."""
    seen = []

    def timer(module, shape):  # tucker2 wins at the data's batch, loses at batch 1
        seen.append(shape)
        if not isinstance(module, tnspec.Layer):
            return 1.0
        if "U[" in module.spec:
            return 0.5 if shape[0] > 1 else 1.5
        return 0.5  # cp wins at both
    _, report = _compress(_model(), 0.3, data=torch.randn(8, 3, 8, 8), latency=True,
                          timer=timer)
    assert {s[0] for s in seen} == {8, 1} and all(s[1:] for s in seen)
    assert all(c.chosen.format in ("dense", "cp") for c in report.choices)
    assert any(c.chosen.format == "cp" for c in report.choices)
    # only the picks are timed: a tucker2 candidate left was never picked, so never timed
    assert all(c.seconds is None for ch in report.choices for c in ch.candidates
               if c.format == "tucker2")
    seen.clear()  # for training: forward and backward at the data's shape alone
    _, report = _compress(_model(), 0.3, data=torch.randn(8, 3, 8, 8), latency="training",
                          timer=timer)
    assert {s[0] for s in seen} == {8}
    assert any(c.chosen.format == "tucker2" for c in report.choices)


def test_latency_times_only_the_picks_and_allocates_as_timing_them_all_would():
    """The allocation is timed, not every candidate: the slow picks leave and it is redone.
    Its result is the allocation without the slow format at all."""
    calls = []

    def timer(module, shape):  # cp slow, tucker2 fast
        if isinstance(module, tnspec.Layer):
            calls.append(id(module))
            return 0.5 if "U[" in module.spec else 2.0
        return 1.0
    x = torch.randn(8, 3, 8, 8)
    _, lazy = _compress(_model(), 0.3, data=x, latency=True, timer=timer, prune=False)
    _, without = tnspec.compress(_model(), 0.3, ("tucker2",), shares=(0.1, 0.3, 0.6),
                                 exclude=["0"], fit=FAST, data=x, prune=False)
    assert [(c.chosen.format, c.chosen.share) for c in lazy.choices] == \
        [(c.chosen.format, c.chosen.share) for c in without.choices]
    timed = len(set(calls))  # each at two batches
    kept = [c for ch in lazy.choices for c in ch.candidates if c.format != "dense"]
    dropped = timed - sum(c.seconds is not None for c in kept)
    assert dropped > 0 and timed < len(kept) + dropped  # not every candidate


@pytest.mark.parametrize("training", [False, True])
def test_the_latency_clock_runs_backward_only_for_training(training):
    from tnspec.workflows.convert.timing import timed
    layer = nn.Linear(6, 4)
    grad_modes = []
    layer.register_forward_hook(lambda m, a, y: grad_modes.append(torch.is_grad_enabled()))
    backward = []
    layer.weight.register_hook(lambda g: backward.append(1))
    assert timed(layer, (3, 6), repeats=3, training=training) > 0
    assert set(grad_modes) == {training} and len(grad_modes) == 5
    assert bool(backward) is training


def test_latency_that_leaves_no_allocation_within_the_budget_says_so():
    def timer(module, shape):  # every candidate slower than dense
        return 2.0 if isinstance(module, tnspec.Layer) else 1.0
    model = _model()
    before = snapshot(model)
    with pytest.raises(tnspec.SpecError, match="below what the smallest candidates need") as exc:
        _compress(model, 0.3, data=torch.randn(4, 3, 8, 8), latency=True, timer=timer)
    assert "latency=True left out" in exc.value.hint and "latency=False" in exc.value.hint
    assert unchanged(before, model)


@pytest.mark.parametrize("after_swap", [False, True])
def test_a_clock_that_raises_leaves_the_model_exactly_as_it_was(after_swap):
    """The latency clock raising while the first allocation is timed, or (sequential) while
    the second is, after the new layers were set in the model: structure, values,
    requires_grad, modes and ties are as before, by snapshot."""
    model = _model()
    model[2].requires_grad_(False)
    model[5].eval()
    before = snapshot(model)

    def timer(module, shape):
        swapped = any(isinstance(m, tnspec.Layer) for m in model.modules())
        if isinstance(module, tnspec.Layer) and swapped == after_swap:
            raise RuntimeError("clock broke")
        return 0.5 if isinstance(module, tnspec.Layer) else 1.0
    with pytest.raises(RuntimeError, match="clock broke"):
        _compress(model, 0.3, data=torch.randn(4, 3, 8, 8), latency=True, timer=timer,
                  sequential=after_swap)
    assert unchanged(before, model)


def test_once_the_time_is_spent_the_picks_left_untimed_stay():
    """max_seconds spent: nothing more is timed and no pick leaves for want of a time (an
    allocation within the budget stays), and the count is returned for the progress line."""
    from tnspec.workflows.convert.report import Candidate
    from tnspec.workflows.convert.timing import drop_slower
    layer = nn.Linear(4, 4)
    rows = [("a", 20, [(Candidate("dense", 1.0, 20, 0.0, 1.0), None),
                       (Candidate("cp", 0.5, 10, 0.1), layer)], 1.0, (1.0, 1.0))]
    timed = []
    times = lambda module, shape: timed.append(shape) or (2.0, 2.0)  # noqa: E731
    assert drop_slower(rows, [1], times, {"a": (2, 4)}, lambda: 0.0) == (0, 1)
    assert not timed and len(rows[0][2]) == 2
    assert drop_slower(rows, [1], times, {"a": (2, 4)}, lambda: 5.0) == (1, 0)
    assert timed == [(2, 4)] and len(rows[0][2]) == 1


def test_an_unknown_latency_or_a_clock_without_it_is_a_clear_error():
    with pytest.raises(tnspec.SpecError, match="latency='fast' is not a timing"):
        tnspec.compress(_model(), 0.5, data=torch.randn(4, 3, 8, 8), latency="fast")
    with pytest.raises(tnspec.SpecError, match="timer= is the clock of latency=, which is off"):
        tnspec.compress(_model(), 0.5, data=torch.randn(4, 3, 8, 8), timer=lambda m, s: 1.0)


def test_ctrl_c_leaves_the_model_unchanged():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    calls = []

    def interrupt(module, args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
    handle = model[5].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):  # while recording or measuring sensitivities
        _compress(model, 0.3, data=[torch.randn(4, 3, 8, 8)] * 3)
    handle.remove()

    def timer(module, shape):  # and while fitting and timing candidates
        if isinstance(module, tnspec.Layer) and len(calls) > 6:
            raise KeyboardInterrupt
        calls.append(1)
        return 1.0
    with pytest.raises(KeyboardInterrupt):
        _compress(model, 0.3, data=torch.randn(4, 3, 8, 8), latency=True, timer=timer)
    assert [type(m) for m in model.modules()] == kinds
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(m.training for m in model.modules())


def test_bad_arguments_are_clear_errors_before_anything_changes():
    model = _model()
    model[2].requires_grad_(False)
    before = snapshot(model)
    for kwargs, match in [
            (dict(budget=0.5, formats=("tucker", "cp2")), "unknown format 'cp2'"),
            (dict(budget=0.5, data=iter([])), "data= holds no batch"),
            (dict(budget=0.5, include="nothing"), "no layer to compress"),
            (dict(budget=0.001, formats=("cp",), shares=(0.5,), fit=FAST,
                  data=torch.randn(4, 3, 8, 8)), "below what the smallest candidates need")]:
        with pytest.raises(tnspec.SpecError, match=match):  # the last one after every fit
            tnspec.compress(model, **kwargs)
        assert unchanged(before, model)
    with pytest.raises(tnspec.SpecError, match="budget=0 is a share"):
        tnspec.compress(_model(), 0)
    with pytest.raises(tnspec.SpecError, match="latency=True needs data="):
        tnspec.compress(_model(), 0.5, latency=True)
    with pytest.raises(tnspec.SpecError, match="no layer to compress"):
        tnspec.compress(_model(), 0.5, include="nothing")
    with pytest.raises(tnspec.SpecError, match="fit= has no option 'iterations'"):
        tnspec.compress(_model(), 0.5, fit={"iterations": 3})
    with pytest.raises(tnspec.SpecError, match=r"formats=\('tucker', 'cp2'\): unknown format "
                                               "'cp2'"):
        tnspec.compress(_model(), 0.5, ("tucker", "cp2"))
    with pytest.raises(tnspec.SpecError, match=r"formats='cp' must be a tuple(?s:.*)\('cp',\)"):
        tnspec.compress(_model(), 0.5, "cp")


def test_a_few_sweeps_before_the_float32_refit_reach_the_float64_fit():
    """compress's quick data fit (``sweeps=5``: the weight-only start stops after 5 ALS
    sweeps; the refit runs in float32 for a float32 weight) is as good as the full one."""
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 16, 3, padding=1)
    x = torch.randn(64, 16, 8, 8) * torch.logspace(0, -2, 16).view(1, 16, 1, 1)
    errors = []
    for weight, sweeps in ((conv.weight.detach(), 5), (conv.weight.detach().double(), None)):
        layer = formats.cp(16, 16, 3, rank=0.3, padding=1).layer().to(weight.dtype)
        errors.append(layer.fit_(weight, inputs=x.to(weight.dtype)) if sweeps is None else
                      layer._fit(weight, moments.of_inputs(conv, x), sweeps=sweeps,
                                 max_seconds=None))
    assert errors[0] < 1.1 * errors[1]
    with pytest.raises(tnspec.SpecError, match="sweeps=0 must be an int >= 1"):
        tnspec.fit.decompose.fit(layer.network, conv.weight.detach(), sweeps=0)


def test_the_report_plots_each_layers_candidates(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    _, report = _compress(_model(), 0.3)
    fig = report.plot(str(tmp_path / "fronts.png"))
    assert (tmp_path / "fronts.png").stat().st_size > 0
    assert len([ax for ax in fig.axes if ax.get_title()]) == len(report.choices)


def test_a_frozen_model_stays_frozen_and_latency_mode_times_it():
    small, report = _compress(_model().requires_grad_(False), 0.3, data=torch.randn(8, 3, 8, 8))
    assert any(c.chosen.format != "dense" for c in report.choices)
    assert not any(p.requires_grad for p in small.parameters())
    # timed for real (forward, and backward to the input alone): every layer gets a time
    _, report = _compress(_model().requires_grad_(False), 1.0, data=torch.randn(8, 3, 8, 8),
                          latency=True)
    assert all(c.dense_seconds > 0 for c in report.choices)
    partly = _model()
    partly[2].requires_grad_(False)
    small, _ = _compress(partly, 0.3, data=torch.randn(8, 3, 8, 8))
    assert not any(p.requires_grad for p in small[2].parameters())
    assert all(p.requires_grad for p in small[5].parameters())


class _WithHead(nn.Module):
    """A trunk the data runs through and an auxiliary head it never reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = _model()
        self.aux = nn.Linear(24 * 16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)


def test_latency_mode_leaves_a_layer_the_data_never_reaches_untimed():
    model = _WithHead()
    small, report = tnspec.compress(model, 1.0, ("tucker2", "cp"), shares=(0.1, 0.3),
                                    exclude=["trunk.0"], fit=FAST, latency=True,
                                    data=torch.randn(4, 3, 8, 8))
    aux = next(c for c in report.choices if c.name == "aux")
    assert aux.dense_seconds is None
    assert all(c.dense_seconds is not None for c in report.choices if c.name != "aux")


def test_data_given_as_a_generator_is_read_once():
    model = _model()
    x = torch.randn(16, 3, 8, 8)
    batches = (x[i:i + 4] for i in range(0, 16, 4))
    small, report = _compress(copy.deepcopy(model), 0.3, data=batches)
    with_list, _ = _compress(copy.deepcopy(model), 0.3, data=[x[i:i + 4] for i in range(0, 16, 4)])
    assert report.data
    torch.testing.assert_close(small(x), with_list(x))
    with pytest.raises(tnspec.SpecError, match="data= holds no batch"):
        _compress(copy.deepcopy(model), 0.3, data=iter([]))


def test_sampled_patches_are_the_subset_of_all_patches():
    x = torch.randn(3, 4, 11, 9)
    args = ((3, 2), (2, 1), (1, 0), (1, 2))
    every = moments.patches(x, *args)
    some = moments.patches(x, *args, max_rows=20)
    assert torch.equal(some, every[moments.subset(len(every), 20)])
    assert torch.equal(moments.factor(some), moments.factor(every, max_rows=20))


_PEAK = """
import resource, sys, torch
from tnspec import formats
torch.manual_seed(0)
layer = formats.tucker2(64, 64, 3, rank=16, padding=1).layer(autotune=False)
weight = layer.dense_weight().detach()
x = torch.randn(int(sys.argv[1]), 64, 32, 32)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
layer.fit_(weight, inputs=x, max_iter=2, starts=1, hops=0)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""


def test_fitting_to_inputs_needs_memory_for_the_sampled_patches_not_the_batch():
    """A 16 MiB and a 64 MiB batch: the peak above the batch stays (it grew 28x the batch when
    every patch was built in float64 before sampling: +509 and +1807 MiB)."""
    peaks = []
    for n in (64, 256):
        out = subprocess.run([sys.executable, "-c", _PEAK, str(n)], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "TNSPEC_CALIBRATE": "0"})
        assert out.returncode == 0, out.stderr
        peaks.append(float(out.stdout.split()[-1]))
    assert peaks[1] < peaks[0] + 48 and peaks[1] < 400, peaks


def test_the_report_says_which_layer_types_it_left_alone_and_why():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.norm = nn.LayerNorm(16)
            self.ff = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ff(self.norm(x + self.attn(x, x, x)[0]))

    torch.manual_seed(0)
    _, report = tnspec.compress(Block(), 0.8, data=torch.randn(2, 5, 16), shares=(0.5,))
    assert [c.name for c in report.choices] == ["ff"]
    assert dict(report.skipped)["attn.out_proj"] == \
        "nn.MultiheadAttention reads this layer's weight directly"
    text = str(report)
    assert "left alone 1 x MultiheadAttention: its in-projection is a parameter its fused " \
        "kernel reads, not a layer" in text
    assert "left alone 1 x LayerNorm: a normalization" in text


def test_a_time_bound_gives_the_best_allocation_fitted_never_an_error(ticking):
    """With ``max_seconds`` the first format's smallest candidate is fitted for every layer
    before anything else, so that an allocation within the budget exists however soon the
    time ends; where even those could not all be fitted, each layer holds its smallest
    fitted candidate and the report says the budget was not reached. It raised "budget is
    below what the smallest candidates need" (on MiniLM, after 522 s of a 60 s bound)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, 8))
    x = torch.randn(16, 32)
    ticking(1.0)  # every look at the clock takes a second
    _, report = tnspec.compress(copy.deepcopy(net), 0.3, data=[x], formats=("low_rank", "tt"),
                                max_seconds=20, fit={"max_iter": 20})
    assert report.unfitted > 0 and not report.over_budget
    assert report.params_after <= 0.3 * report.params_before
    ticking(1.0)
    _, report = tnspec.compress(copy.deepcopy(net), 0.3, data=[x], formats=("low_rank", "tt"),
                                max_seconds=3, fit={"max_iter": 20})
    assert report.over_budget and report.unfitted > 0
    assert "over the budget: max_seconds was spent" in str(report)
    for c in report.choices:  # each layer's smallest fitted candidate
        assert c.chosen.params == min(o.params for o in c.candidates)
    with pytest.raises(tnspec.SpecError, match="below what the smallest candidates need"):
        tnspec.compress(copy.deepcopy(net), 0.001, data=[x], formats=("low_rank",),
                        fit={"max_iter": 20})


def test_the_progress_lines_say_about_how_long_is_left(ticking, caplog):
    """Each layer's progress line gives the time left at the pace so far, never past
    ``max_seconds``, and the last line none."""
    import logging
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    ticking(1.0)
    with caplog.at_level(logging.INFO, logger="tnspec"):
        tnspec.compress(copy.deepcopy(net), 0.5, data=[torch.randn(8, 16)],
                        formats=("low_rank", "tt"), max_seconds=1000, fit={"max_iter": 5})
    lines = [r.getMessage() for r in caplog.records if "candidate(s) fitted" in r.getMessage()]
    assert len(lines) == 4 and all(", about " in line and " s left)" in line
                                   for line in lines[:-1])
    assert "left" not in lines[-1]


def test_a_layer_whose_output_is_mean_pooled_keeps_its_sensitivity():
    """A fit's error is ``(W - W_fit) x``: where the input is the same at every position, so
    is the error, and a mean over the positions after the layer keeps all of it. Noise drawn
    for each output element alone was averaged away (to an eighth over 8 x 8 positions), and
    the allocation cut such layers (a CNN's last conv before its pool) too deep."""
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 5, 1)
    model = nn.Sequential(conv, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    x = torch.randn(4, 6, 1, 1).expand(4, 6, 8, 8).contiguous()
    measured = observe.sensitivities(model, [("0", conv)], [x])
    assert measured["0"] == pytest.approx(1.0, rel=1e-4)


@pytest.mark.parametrize("sequential", [False, True])
def test_an_error_while_a_layer_is_perturbed_leaves_the_model_as_it_was(sequential):
    """The sensitivity measure hooks each layer in turn to add its random weight's term; an
    error in such a run (the first measure, or sequential's second, on the new layers) leaves
    the model as it was by snapshot (structure, values, requires_grad, modes, ties), with no
    hook left on any module."""
    model = _model()
    model[2].requires_grad_(False)
    model[5].eval()
    before = snapshot(model)
    hooks = {n: len(m._forward_hooks) for n, m in model.named_modules()}

    def run(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        new = any(isinstance(x, tnspec.Layer) for x in m.modules())
        perturbed = any(hook.__name__ == "perturb" for x in m.modules()  # observe's hook
                        for hook in x._forward_hooks.values())
        if perturbed and new == sequential:
            raise RuntimeError("broke while perturbed")
        return m(batch)
    with pytest.raises(RuntimeError, match="broke while perturbed"):
        _compress(model, 0.3, data=[torch.randn(4, 3, 8, 8)] * 2, run=run,
                  sequential=sequential)
    assert unchanged(before, model)
    assert {n: len(m._forward_hooks) for n, m in model.named_modules()} == hooks


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU(),
                         nn.Linear(96, 48))


def test_by_default_every_replaced_layer_holds_the_budgets_share():
    """``shares=None``: each layer at the budget's share of its parameters, its format chosen
    (or dense where the rounding leaves room); a tuple of shares lets the allocation give
    each layer its own rank (on MiniLM and MobileNetV2 the cuts below the budget cost a probe
    on the features 0.5-2.4 points)."""
    x = torch.randn(64, 48)
    _, report = tnspec.compress(_mlp(), 0.4, ("low_rank", "cp"), data=[x], fit=FAST)
    assert {c.chosen.share for c in report.choices if c.chosen.format != "dense"} == {0.4}
    assert all(o.share in (0.4, 0.05, 1.0) for c in report.choices for o in c.candidates)
    assert report.params_after <= 0.4 * report.params_before
    _, spread = tnspec.compress(_mlp(), 0.4, ("low_rank",), data=[x], fit=FAST,
                                shares=(0.1, 0.4, 0.7))
    assert {o.share for c in spread.choices for o in c.candidates} == {0.1, 0.4, 0.7, 1.0}


def test_a_format_beaten_at_a_layers_two_smallest_shares_is_not_fitted_at_its_larger_ones():
    """``prune``, within a layer: the ring loses to low-rank at the second layer's 10% and 20%,
    so it is not fitted at its 40% and 60%; at the first layer it wins 10%, so it goes on."""
    def model() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 24), nn.Linear(24, 16))
    torch.manual_seed(0)
    x = torch.randn(128, 32) * torch.logspace(0, -2, 32)
    fitted = {}
    for prune in (False, True):
        _, report = tnspec.compress(model(), 0.5, ("low_rank", "tr"), data=[x], fit=FAST,
                                    prune=prune, shares=(0.1, 0.2, 0.4, 0.6))
        fitted[prune] = report, {c.name: {(o.format, o.share): o.error for o in c.candidates}
                                 for c in report.choices}
    every, pruned = fitted[False][1], fitted[True][1]
    assert every["0"][("tr", 0.1)] < every["0"][("low_rank", 0.1)]  # what the rule reads
    assert all(every["1"][("low_rank", s)] <= every["1"][("tr", s)] for s in (0.1, 0.2))
    assert fitted[True][0].pruned == 2
    left_out = {("1", "tr", 0.4), ("1", "tr", 0.6)}
    assert pruned == {name: {k: e for k, e in errors.items() if (name, *k) not in left_out}
                      for name, errors in every.items()}


def test_a_format_far_behind_at_the_first_two_layers_of_a_shape_is_not_fitted_at_the_others():
    """``prune``: four 32 -> 32 linears and a 32 -> 16 one. The ring's error is over 1.5 times
    low-rank's or TT's at the first two 32 x 32 layers, so it is not fitted at the other two;
    TT wins at the second, so it stays; the 32 -> 16 layer is of another shape, so both are
    fitted there."""
    def model() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)], nn.Linear(32, 16))
    torch.manual_seed(0)
    x = torch.randn(128, 32) * torch.logspace(0, -2, 32)
    fitted = {}
    for prune in (False, True):
        _, fitted[prune] = tnspec.compress(model(), 0.5, ("low_rank", "tt", "tr"), data=[x],
                                           fit=FAST, prune=prune)
    every = {c.name: {o.format: o.error for o in c.candidates} for c in fitted[False].choices}
    for name in "01":  # what the rule reads: the ring far behind at both, TT not at the second
        assert 1.5 * min(every[name]["low_rank"], every[name]["tt"]) <= every[name]["tr"]
    assert every["1"]["tt"] < every["1"]["low_rank"]
    pruned = {c.name: {o.format: o.error for o in c.candidates} for c in fitted[True].choices}
    assert fitted[False].pruned == 0 and fitted[True].pruned == 2
    for name in every:
        left_out = {"tr"} if name in "23" else set()
        assert pruned[name] == {f: e for f, e in every[name].items() if f not in left_out}
    assert "2 candidate(s) not fitted" in str(fitted[True])


def test_a_format_the_time_left_out_is_unfitted_not_pruned(monkeypatch, caplog):
    """The model of the test above on a clock that stands still until the ring's fits at the
    second 32 x 32 layer are done, then jumps past ``max_seconds``: the rule would leave the
    ring out at the third and fourth, but the time did first, and the report counts them
    unfitted (it counted them pruned)."""
    import logging

    def model() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)], nn.Linear(32, 16))
    torch.manual_seed(0)
    x = torch.randn(128, 32) * torch.logspace(0, -2, 32)
    now = [0.0]
    monkeypatch.setattr(progress, "clock", lambda: now[0])

    class Jump(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("compress: 1: 1 tr candidate(s) fitted"):
                now[0] = 1e9
    jump = Jump()
    logging.getLogger("tnspec").addHandler(jump)
    try:
        with caplog.at_level(logging.INFO, logger="tnspec"):
            _, report = tnspec.compress(model(), 0.5, ("low_rank", "tt", "tr"), data=[x],
                                        fit=FAST, max_seconds=100)
    finally:
        logging.getLogger("tnspec").removeHandler(jump)
    assert now[0] == 1e9  # the jump happened
    formats = {c.name: {o.format for o in c.candidates} for c in report.choices}
    assert formats["0"] >= {"low_rank", "tt", "tr"} and formats["1"] >= {"low_rank", "tt", "tr"}
    assert "tr" not in formats["2"] | formats["3"] | formats["4"]
    lines = [r.getMessage() for r in caplog.records]
    assert not any("tr not fitted: far behind" in line for line in lines)
    assert report.pruned == 0 and report.unfitted == 3  # the ring at "2", "3" and "4"


def test_where_the_budgets_share_cannot_hold_the_budget_smaller_shares_are_fitted(caplog):
    """A layer left dense (here: latency finds its candidate slower than dense), or biases
    kept whole, leave the others more than the budget at its share: then the smaller shares
    of ``SHARES`` are fitted and allocated too, one at a time from the largest until the budget
    holds, and the progress says so; with ``shares`` given, it is an error."""
    import logging
    x = torch.randn(64, 48)

    def timer(module: nn.Module, shape: tuple[int, ...]) -> float:
        slow = isinstance(module, tnspec.Layer) and module.out_features == 48
        return 1.0 if slow else 0.5  # the last layer's candidates are slower than dense
    with caplog.at_level(logging.INFO, logger="tnspec"):
        _, report = tnspec.compress(_mlp(), 0.5, ("low_rank",), data=[x], fit=FAST,
                                    latency=True, timer=timer)
    said = [r.getMessage() for r in caplog.records if "does not hold" in r.getMessage()]
    assert [m.split("fitting ")[1] for m in said] == ["0.35 too", "0.2 too"]
    assert said[0].startswith("compress: the budget does not hold with every layer at 0.5 ")
    chosen = {c.name: c.chosen for c in report.choices}
    assert chosen["4"].format == "dense" and report.params_after <= 0.5 * report.params_before
    assert min(chosen["0"].share, chosen["2"].share) < 0.5
    # 0.35 left the last layer, dense, too many parameters; 0.2 did not: 0.1 was not fitted
    # (0.05: the floor every call fits, so that max_seconds always leaves an allocation)
    assert {o.share for c in report.choices for o in c.candidates} == {1.0, 0.5, 0.35, 0.2, 0.05}
    # raising at the allocation (shares given; or the default, after the smaller shares were
    # fitted too: at 0.15, 0.1 then 0.05, each failing) leaves the model as it was, a frozen
    # bias included
    for budget, shares in ((0.5, {"shares": (0.5,)}), (0.06, {}), (0.15, {})):
        model = _mlp()
        model[2].bias.requires_grad_(False)
        before = snapshot(model)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tnspec"), \
                pytest.raises(tnspec.SpecError, match="below what the smallest candidates need"):
            tnspec.compress(model, budget, ("low_rank",), data=[x], fit=FAST, latency=True,
                            timer=timer, **shares)
        assert unchanged(before, model)
        tried = [r.getMessage().split("fitting ")[1] for r in caplog.records
                 if "does not hold" in r.getMessage()]
        assert tried == {0.5: [], 0.06: ["0.05 too"], 0.15: ["0.1 too", "0.05 too"]}[budget]


@pytest.mark.parametrize("shares, why", [((), r"\(\)"), ((0.5, 1.5), r"\(0.5, 1.5\)"),
                                         (0.5, "0.5"), (("a",), r"\('a',\)")])
def test_shares_that_are_no_shares_are_refused(shares, why):
    with pytest.raises(tnspec.SpecError, match=f"shares={why}.*must be a tuple of shares"):
        tnspec.compress(_mlp(), 0.4, shares=shares)


@pytest.mark.parametrize("seconds", [0, -1.0, True, "60"])
def test_a_max_seconds_that_is_no_number_of_seconds_is_refused(seconds):
    model = _mlp()
    before = snapshot(model)
    with pytest.raises(tnspec.SpecError,
                       match=f"max_seconds={seconds!r} must be a positive number of seconds"):
        tnspec.compress(model, 0.4, data=torch.randn(8, 48), max_seconds=seconds)
    assert unchanged(before, model)


@pytest.mark.parametrize("channels", [16, 64])  # a moment 512 wide (eigh), 2,048 (subspace)
def test_inputs_with_nan_are_a_clear_error_and_leave_the_model_as_it_was(channels):
    """A NaN in a layer's inputs made its moment NaN, whose eigendecomposition gave NaN
    eigenvalues without an error: every direction was dropped and the layer fitted in no
    metric at all, silently. Now it is an error naming the layer, raised while the inputs are
    recorded: before anything is set, so the model is as it was (a frozen bias, a tie)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(channels, 32, 32), nn.ReLU(), nn.Conv1d(32, 32, 1),
                          nn.Conv1d(32, 32, 1))
    model[0].bias.requires_grad_(False)
    model[3].weight = model[2].weight
    x = torch.randn(8, channels, 700)
    x[0, 0, 5] = float("nan")
    before, threads = snapshot(model), torch.get_num_threads()
    with pytest.raises(tnspec.SpecError, match=r"layer '0': the inputs hold NaN or infinite "
                                               r"values\nhint: check the data"):
        tnspec.compress(model, 0.5, ("low_rank",), data=[x], fit=FAST)
    assert unchanged(before, model) and torch.get_num_threads() == threads
