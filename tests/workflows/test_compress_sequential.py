"""``compress(sequential=True)`` and ``compress(heal=steps)``: the refit on the compressed
model's inputs against a least-squares solution computed here, the healing pass, the time
bound with both, and the model left as it was when either raises."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tnspec

from ..model_state import snapshot, unchanged

FAST = {"max_iter": 20}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 12))


def _data() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    scale = torch.logspace(0, -1, 16)
    return [torch.randn(200, 16, generator=gen) * scale for _ in range(2)]


def test_the_refit_is_the_best_layer_of_its_rank_on_the_compressed_inputs(float64):
    """Layer 2 refitted = the rank-r ``V`` (and bias) minimizing ``||X W^T + b - X' V^T - c||``
    (X: its inputs in the original net, X': with layer 1 compressed; the damped least-squares
    target of the module docstring, fitted in the damped metric of X'), computed here from the
    rows by a whitened SVD."""
    net, data = _net().double(), [x.double() for x in _data()]
    model, report = tnspec.compress(copy.deepcopy(net), 0.35, ("low_rank",), data=data,
                                    fit=FAST, sequential=True, shares=(0.2, 0.35))
    assert "low_rank" in [c.chosen.format for c in report.choices]
    assert [name for name, _, _ in report.refits] == ["0", "2"]  # in the order it runs them
    x = torch.cat(data)
    with torch.no_grad():
        orig, comp = net[1](net[0](x)), model[1](model[0](x))
        w, b = net[2].weight.detach(), net[2].bias.detach()
        n = len(x)
        m, cross = comp.T @ comp / n, orig.T @ comp / n
        damp = max(0.01, 32 / n) * m.diagonal().mean() * torch.eye(32, dtype=x.dtype)
        target = torch.linalg.solve(m + damp, (w @ (cross + damp)).T).T
        # the fit's metric, damped as every data-aware fit damps it (1% of the mean eigenvalue)
        values, vectors = torch.linalg.eigh(m + 0.01 * m.diagonal().mean() * torch.eye(32))
        root = (vectors * values.sqrt()) @ vectors.T
        u, s, vh = torch.linalg.svd(target @ root)
        rank = int(torch.linalg.matrix_rank(model[2].dense_weight()))
        best = (u[:, :rank] * s[:rank]) @ vh[:rank] @ torch.linalg.inv(root)
        bias = b + (orig @ w.T - comp @ best.T).mean(0)
        want = comp @ best.T + bias
        got = model[2](comp)
    assert rank < 12
    assert torch.allclose(got, want, atol=1e-6 * float(want.abs().max()))
    name, before, after = report.refits[1]
    assert after < before
    assert abs(after - float((orig @ w.T + b - want).norm() / (orig @ w.T + b).norm())) < 1e-6


def test_the_first_layer_sees_what_it_saw_and_keeps_its_weight():
    """The first layer's inputs are the original's, so the target is its own weight: its
    refit gives the weight it had, and only the bias moves (to the least-squares value)."""
    plain, first = tnspec.compress(_net(), 0.35, ("low_rank",), data=_data(), fit=FAST,
                                   shares=(0.2, 0.35))
    model, report = tnspec.compress(_net(), 0.35, ("low_rank",), data=_data(), fit=FAST,
                                    sequential=True, shares=(0.2, 0.35))
    assert report.choices[0].chosen == first.choices[0].chosen
    with torch.no_grad():
        assert torch.allclose(model[0].dense_weight(), plain[0].dense_weight(), atol=1e-5)
    name, before, after = report.refits[0]
    assert name == "0" and after <= before
    assert "sequential: 2 layer(s) refitted" in str(report)


def test_healing_lowers_the_distance_to_the_original_and_trains_only_the_new_layers():
    net, data = _net(), _data()
    frozen = copy.deepcopy(net)
    frozen[2].weight.requires_grad_(False)  # a frozen layer's replacement stays frozen
    model, report = tnspec.compress(frozen, 0.3, ("low_rank",), data=data, fit=FAST,
                                    heal=30, heal_lr=1e-3, shares=(0.2, 0.35))
    healed = report.healed
    assert healed.steps == 30 and healed.kept and healed.after < healed.before
    assert "healed: 30 step(s)" in str(report)
    assert [p.requires_grad for p in model.parameters()] == \
        [p.requires_grad for p in frozen.parameters()]


def test_a_healing_pass_that_does_not_help_is_not_kept():
    """At a learning rate far too large, the pass raises the distance: the fitted layers stay
    as they were fitted."""
    data = _data()
    fitted, _ = tnspec.compress(_net(), 0.3, ("low_rank",), data=data, fit=FAST,
                                shares=(0.2, 0.35))
    model, report = tnspec.compress(_net(), 0.3, ("low_rank",), data=data, fit=FAST,
                                    heal=5, heal_lr=10.0, shares=(0.2, 0.35))
    assert not report.healed.kept and report.healed.after == report.healed.before
    assert "not lower: the fitted layers kept" in str(report)
    for a, b in zip(model.state_dict().values(), fitted.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stage", ["sequential", "heal"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_error_in_the_refits_or_healing_leaves_the_model_as_it_was(stage, error):
    """The run raises once the model holds a tnspec layer (the refits' and the re-measured
    sensitivities' passes) or computes gradients (healing): every layer is put back."""
    net, data = _net(), _data()
    before = snapshot(net)

    def run(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        replaced = any(isinstance(m, tnspec.Layer) for m in model.modules())
        if (stage == "sequential" and replaced) or (stage == "heal" and
                                                     torch.is_grad_enabled()):
            raise error("stop")
        return model(batch)
    options = {"sequential": True} if stage == "sequential" else {"heal": 5}
    with pytest.raises(error, match="stop"):
        tnspec.compress(net, 0.3, ("low_rank",), data=data, run=run, fit=FAST,
                        shares=(0.2, 0.35), **options)
    assert unchanged(before, net)


@pytest.mark.parametrize("options, message", [
    ({"sequential": True}, r"sequential=True needs data="),
    ({"heal": 10}, r"heal=10 needs data="),
])
def test_refits_and_healing_need_data(options, message):
    with pytest.raises(tnspec.SpecError, match=message):
        tnspec.compress(_net(), 0.3, **options)


@pytest.mark.parametrize("heal", [-1, True, 2.5])
def test_heal_is_a_number_of_steps(heal):
    with pytest.raises(tnspec.SpecError, match=r"heal=.* is a number of training steps"):
        tnspec.compress(_net(), 0.3, data=_data(), heal=heal)


@pytest.mark.parametrize("options", [{}, {"sequential": True, "heal": 1000}])
def test_max_seconds_is_kept_within_a_tenth(ticking, options):
    """Every read of the clock takes a second: the whole call, observation, fits, refits and
    healing included, ends within 10% of ``max_seconds``."""
    ticking(1.0)
    _, report = tnspec.compress(_net(), 0.3, ("low_rank", "tt"), data=_data(), fit=FAST,
                                max_seconds=60, **options)
    assert report.seconds <= 66
    if options:
        assert report.healed is not None and 0 < report.healed.steps < 1000


def test_healing_with_nothing_to_train_says_so():
    """A frozen model's replacements are frozen too: the pass runs no step and says why."""
    net = _net().requires_grad_(False)
    model, report = tnspec.compress(net, 0.3, ("low_rank",), data=_data(), fit=FAST, heal=5,
                                    shares=(0.2, 0.35))
    assert report.healed.steps == 0 and not report.healed.kept
    assert "not healed: nothing to train (no layer replaced, or each frozen" in str(report)
    assert not any(p.requires_grad for p in model.parameters())


def test_the_first_sensitivity_measure_takes_at_most_a_fifth_of_max_seconds(ticking):
    """Every forward costs 5 "seconds" (a model whose passes are slow, or a busy machine):
    measuring 8 layers on 2 batches would take 90 of the 60 allowed. The measure stops at a
    fifth of them, the layers it did not reach get the median sensitivity, and the call ends
    within a tenth of the bound with a model that runs."""
    from tnspec import progress
    ticking(1.0)
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(16, 16), nn.Tanh())])

    def slow(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            progress.now()
        return model(batch)
    data = [torch.randn(64, 16, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    model, report = tnspec.compress(net, 0.5, ("low_rank",), data=data, run=slow, fit=FAST,
                                    max_seconds=60)
    assert report.seconds <= 66
    values = [c.sensitivity for c in report.choices]
    median = sorted(values)[len(values) // 2]
    assert values.count(median) >= 3  # the unmeasured layers, and the median layer itself
    assert model(data[0]).shape == (64, 16)


def test_recording_the_inputs_stops_reading_batches_at_a_tenth_of_max_seconds(ticking, caplog):
    """Recording the layers' inputs is a forward per batch, before any fit: with 8 batches of
    5 "seconds" each it would take 40 of the 60 allowed. It reads batches until a tenth of
    them has passed (the first one always), says how many it read, and the fits get the time
    left (recording all 8, with the sensitivity measure's references, took 57 s before the
    first fit; here every read of the clock costs a second, so the first layer's fits take
    most of what is left); the call ends within a
    tenth of the bound."""
    import logging

    from tnspec import progress
    ticking(1.0)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    fed: list[int] = []

    def slow(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        fed.append(1)
        for _ in range(4):
            progress.now()
        return model(batch)
    data = [torch.randn(64, 16, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    with caplog.at_level(logging.INFO, logger="tnspec"):
        model, report = tnspec.compress(net, 0.5, ("low_rank",), data=data, run=slow,
                                        fit=FAST, max_seconds=60, max_batches=8)
    assert report.seconds <= 66
    assert "inputs recorded from 2 of 8 batch(es): max_seconds left no time" in caplog.text
    assert "low_rank" in [c.chosen.format for c in report.choices]
    assert model(data[0]).shape == (64, 16)
