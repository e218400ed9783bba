"""``tnspec.audit``: variance ratios per layer, for tnspec layers and other libraries' alike."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import tnspec


def tt_linear_stack(layers: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[tnspec.formats.tt(1024, 1024, (), rank=16).layer(activation="linear")
                           for _ in range(layers)])


def test_a_graph_in_stack_with_linear_activation_keeps_every_ratio_near_1():
    model = tt_linear_stack()
    x = torch.randn(512, 1024, generator=torch.Generator().manual_seed(1))
    state = torch.get_rng_state()
    result = tnspec.audit(model, x)
    assert torch.equal(torch.get_rng_state(), state)
    assert [r["name"] for r in result.rows] == [str(i) for i in range(6)]
    for row in result.rows:
        assert row["type"] == "Layer"
        assert 0.8 < row["forward"] < 1.2 and 0.8 < row["backward"] < 1.2, row
        fwd, bwd = row["predicted"]  # the theory, from the cores' actual variances
        assert math.isclose(row["forward"], fwd, rel_tol=0.1)
    assert all(p.grad is None for p in model.parameters())  # audit accumulates no gradient


def test_tensorly_torch_tt_conv_initialized_as_its_api_invites_vanishes():
    tltorch = pytest.importorskip("tltorch")
    torch.manual_seed(0)
    conv = tltorch.FactorizedConv(64, 64, (3, 3), order=2, padding=1, factorization="tt",
                                  rank=(1, 8, 8, 8, 1))
    conv.reset_parameters(std=1 / math.sqrt(64 * 9))  # a dense conv's std, linear activation
    same = tnspec.layer("x[b, c, h+kh-1, w+kw-1], A[o, r1], B[r1, c, r2], C[r2, kh, r3], "
                        "D[r3, kw] -> y[b, o, h, w]", c=64, o=64, kh=3, kw=3, r1=8, r2=8, r3=8,
                        activation="linear")
    x = torch.randn(8, 64, 16, 16)
    (tl_row,) = tnspec.audit(nn.Sequential(conv), x).rows
    (tn_row,) = tnspec.audit(nn.Sequential(same), x).rows
    assert tl_row["type"] == "FactorizedConv" and tl_row["predicted"] is None
    assert tl_row["forward"] < 0.01 and tl_row["backward"] < 0.01  # about 1 / 8^3
    assert 0.2 < tn_row["forward"] < 5


def test_plain_torch_layers_and_containers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Sequential(nn.Conv2d(8, 8, 1)),
                          nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    result = tnspec.audit(model, torch.randn(4, 3, 8, 8), backward=False)
    assert [(r["name"], r["type"]) for r in result.rows] == [
        ("0", "Conv2d"), ("2.0", "Conv2d"), ("4", "Linear")]
    assert all(r["backward"] is None and r["predicted"] is None for r in result.rows)
    text = str(result)
    assert text.splitlines()[0].split() == ["layer", "type", "forward", "backward", "predicted",
                                           "note"]
    assert "2.0" in text and "Conv2d" in text


def test_plot_draws_the_ratios_by_depth():
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    ax = tnspec.audit(tt_linear_stack(2), torch.randn(64, 1024)).plot()
    assert [line.get_label() for line in ax.get_lines()[:2]] == ["forward", "backward"]


def test_in_place_activations_are_audited_and_restored():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3),
                          nn.ReLU(inplace=True))
    result = tnspec.audit(model, torch.randn(2, 3, 10, 10))
    assert [r["name"] for r in result.rows] == ["0", "2"]
    assert all(r["backward"] > 0 for r in result.rows)
    assert model[1].inplace and model[3].inplace


class _Block(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace  # what audit used to switch off; a functional call has no flag
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return torch.nn.functional.relu(y, inplace=True) if self.inplace else y.relu()


def test_a_functional_in_place_op_after_a_layer_is_audited_as_its_out_of_place_twin():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8, 8)
    twin = nn.Sequential(_Block(False), _Block(False))
    model = nn.Sequential(_Block(True), _Block(True))
    model.load_state_dict(twin.state_dict())
    measured, expected = tnspec.audit(model, x), tnspec.audit(twin, x)
    assert [r["backward"] for r in measured.rows] == [r["backward"] for r in expected.rows]
    # and the backward ratio is Var(dL/d input) / Var(dL/d conv output), the relu's mask in it
    inp = x.clone().requires_grad_()
    y = twin[0].conv(inp)
    g = torch.autograd.grad(twin[1](y.relu()), (inp, y),
                            torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(0)))
    assert measured.rows[0]["backward"] == pytest.approx(float(g[0].double().var() /
                                                               g[1].double().var()))


def test_rows_whose_input_breaks_the_predictions_assumptions_are_flagged():
    torch.manual_seed(0)
    model = nn.Sequential(
        tnspec.layer("x[b, i], W[i, o] -> y[b, o]", i=64, o=64, activation="linear"),
        nn.BatchNorm1d(64),
        tnspec.layer("x[b, i], W[i, o] -> y[b, o]", i=64, o=64, activation="linear"),
        tnspec.layer("x[b, i], W[i, o] -> y[b, o]", i=64, o=64, activation="linear"))
    x = torch.randn(256, 64) + 3.0  # an image-like input: far from centred
    rows = tnspec.audit(model, x).rows
    assert [r["name"] for r in rows] == ["0", "1", "2", "3"]
    first, _, normed, plain = rows
    assert first["input_mean"] == pytest.approx(3.0, rel=0.1)
    assert any("input not centred: mean +3" in f for f in first["flags"])
    # the measured ratio is (1 + m^2/v) times the prediction, as the note says
    assert first["forward"] == pytest.approx(first["predicted"][0] * (1 + 3.0 ** 2), rel=0.2)
    assert normed["after"] == "1" and "after 1 (normalized input)" in normed["flags"]
    assert plain["flags"] == () and plain["after"] is None
    text = str(tnspec.audit(model, x))
    assert "input not centred" in text and "for inputs of mean 0" in text


def test_audit_leaves_running_statistics_and_the_rng_alone_in_train_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5),
                          nn.Conv2d(8, 4, 3)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 3, 10, 10)
    rng = torch.get_rng_state()
    tnspec.audit(model, x)
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert model.training


def test_a_zero_variance_gives_inf_or_nan_not_a_crash():
    zero = nn.Linear(8, 8)
    nn.init.zeros_(zero.weight)
    nn.init.zeros_(zero.bias)
    after = nn.Linear(8, 8, bias=False)
    rows = tnspec.audit(nn.Sequential(zero, after), torch.randn(16, 8)).rows
    assert rows[0]["forward"] == 0.0 and rows[0]["backward"] == 0.0  # W = 0: y = 0, dx = 0
    assert math.isnan(rows[1]["forward"])  # 0 / 0: a zero input, a zero output
    (row,) = tnspec.audit(nn.Sequential(nn.Linear(8, 8)), torch.ones(4, 8).cumsum(1)).rows
    assert math.isfinite(row["forward"])
    (row,) = tnspec.audit(nn.Sequential(nn.Linear(8, 8)), torch.ones(4, 8)).rows
    assert row["forward"] == math.inf  # a constant input, a varying output


def test_a_model_that_changes_its_input_in_place_is_audited():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2.0)
            return self.lin(x)
    x = torch.randn(16, 8)
    saved = x.clone()
    (row,) = tnspec.audit(Scale(), x).rows
    assert row["name"] == "lin" and row["backward"] is not None
    assert torch.equal(x, saved)  # the caller's tensor is not the one changed
