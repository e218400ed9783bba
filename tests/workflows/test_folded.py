"""An adapter whose plan is one linear of a weight built of its cores runs folded into its base
linear: ``F.linear(x, W + scaling * (A - A0), b)``, one product of the data where the parts took
two or three. The base's output at init bit for bit, autograd or not; the same outputs and
gradients as the parts run apart, to float rounding, after training; fewer ops; and the parts
run apart wherever folding would change what runs (hooks, another dtype, another plan)."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import tnspec
from tnspec.emit import weights
from tnspec.emit.lower import lower
from tnspec.workflows import adapted

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from harness import Count  # noqa: E402

FORMATS = ("low_rank", "cp", "tucker2", "tt", "tr", "tt_lora")
STARTS = ({}, {"init": "zero"}, {"init": "principal"})


#: the bases a folded adapter takes the place of, and an input of each
BASES = {
    "linear": (lambda: nn.Linear(64, 64), (4, 16, 64)),
    "conv1d": (lambda: nn.Conv1d(64, 64, 3, padding=1), (4, 64, 16)),
    "conv2d, stride 2": (lambda: nn.Conv2d(64, 64, 3, stride=2, padding=1), (2, 64, 9, 9)),
    "conv2d 1x1": (lambda: nn.Conv2d(64, 64, 1), (2, 64, 6, 6)),
}


def _model(fmt: str, start: dict, kind: str = "linear") -> nn.Module:
    torch.manual_seed(0)
    make = BASES[kind][0]
    base = nn.Sequential(make(), nn.ReLU(), make())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # modes of small widths
        model = tnspec.adapt(base, fmt, rank=0.1, **start)[0]
    for m in model.modules():
        if isinstance(m, tnspec.Layer):
            m.planner = "dense-first"  # the weight built, then one linear: every format folds
    return model


def _apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapted, "folded", lambda module, x: None)


def _runs_folded(model: nn.Module, x: torch.Tensor) -> bool:
    layer = model[0].adapters[model[0].active]
    if isinstance(model[0].base, nn.Linear):
        x = x.reshape(-1, x.shape[-1])
    return layer._running(x).applied


@pytest.mark.parametrize("kind", sorted(BASES))
@pytest.mark.parametrize("start", STARTS, ids=["default", "zero", "principal"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_folded_adapter_is_its_base_at_init_bit_for_bit(fmt, start, kind):
    torch.manual_seed(1)
    x = torch.randn(BASES[kind][1])
    model = _model(fmt, start, kind)
    assert _runs_folded(model, x)
    plain = [m.base if isinstance(m, adapted.Adapted) else m for m in model]
    with torch.no_grad():
        want = plain[2](plain[1](plain[0](x)))
        assert torch.equal(model(x), want)
    x.requires_grad_(True)  # autograd recording: the same kernel on the same weight
    assert torch.equal(model(x), want)


@pytest.mark.parametrize("kind", sorted(BASES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_folded_and_apart_train_alike(fmt, kind, monkeypatch):
    torch.manual_seed(2)
    x = torch.randn(BASES[kind][1])
    folded, apart = _model(fmt, {}, kind), _model(fmt, {}, kind)
    target = torch.randn_like(folded(x))
    assert _runs_folded(folded, x)
    for model, fold in ((folded, True), (apart, False)):
        with monkeypatch.context() as patch:
            if not fold:
                _apart(patch)
            opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-2)
            for _ in range(5):
                loss = (model(x) - target).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    with torch.no_grad():
        y_folded, y_apart = folded(x), apart(x)
    assert not torch.allclose(y_folded, _model(fmt, {}, kind)(x))  # it trained
    torch.testing.assert_close(y_folded, y_apart, rtol=1e-4, atol=1e-5)


def test_folding_dispatches_fewer_ops(monkeypatch):
    x = torch.randn(512, 64, requires_grad=True)
    model = _model("tt", {})
    assert _runs_folded(model, x)

    def ops() -> int:
        model(x).sum().backward()  # plans and kept weights first
        with Count() as counted:
            model(x).backward(torch.ones(512, 64))
        model.zero_grad(set_to_none=True)
        return sum(counted.ops.values())
    folded = ops()
    _apart(monkeypatch)
    assert folded < ops()


def test_hooks_and_other_dtypes_run_the_parts(monkeypatch):
    x = torch.randn(8, 64)
    model = _model("tt", {})
    assert adapted.folded(model[0], x) is not None
    seen = []
    handle = model[0].base.register_forward_hook(lambda m, i, o: seen.append(o))
    assert adapted.folded(model[0], x) is None
    model(x)
    assert len(seen) == 1  # the base ran as a module: its hook fired
    handle.remove()
    model[0].adapters["default"].register_forward_pre_hook(lambda m, i: seen.append(i))
    assert adapted.folded(model[0], x) is None
    model = _model("tt", {})
    model[0].base.double()  # a base of another precision than its adapter's
    assert adapted.folded(model[0], x.double()) is None
    model[0].disabled = True
    assert torch.equal(model[0](x.double()), model[0].base(x.double()))
    conv = _model("tt", {}, "conv1d")
    assert adapted.folded(conv[0], torch.randn(2, 64, 8)) is not None
    conv[0].base.padding_mode = "reflect"  # the adapter pads with zeros: not one conv
    assert adapted.folded(conv[0], torch.randn(2, 64, 8)) is None


def test_the_plans_that_fold():
    model = _model("tt", {})
    layer = model[0].adapters["default"]
    network, plan, convert, compiled = layer._running(torch.randn(512, 64)).lowered
    program = lower(plan, False, convert, compiled)
    assert weights.applied(program)
    model = _model("tr", {})
    layer = model[0].adapters["default"]
    layer.planner = "auto"
    cls = layer._running(torch.randn(512, 64))
    assert cls.chain  # a chain of two weights: the data meets the cores twice
    network, plan, convert, compiled = cls.lowered
    program = lower(plan, False, convert, compiled)
    assert not weights.applied(program)
    conv = tnspec.layer("x[b, c, h+kh-1], U[c, r], W[r, o, kh] -> y[b, o, h]", c=4, o=4,
                        r=2, kh=3, planner="dense-first")
    assert conv._running(torch.randn(2, 4, 8)).applied  # one conv by the kernel built
    conv.planner = "left-to-right"  # the data meets U, then W
    assert not conv._running(torch.randn(2, 4, 8)).applied


def test_a_copy_of_a_folded_model_runs_alike():
    x = torch.randn(4, 64)
    model = _model("tt", {})
    with torch.no_grad():
        for p in model[0].adapters["default"].parameters():
            p.add_(0.1)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))


def test_the_class_kept_for_the_rows_ends_when_the_adapter_plans_anew():
    """``folded`` keeps the class it found for the rows' shape (finding it costs 0.1 ms a
    call); a planner set afterwards is seen at the next call, and a model that ran pickles."""
    import pickle
    x = torch.randn(4, 16, 64)
    model = _model("tr", {})
    assert adapted.folded(model[0], x) is not None
    assert adapted.folded(model[0], x) is not None  # the kept class
    model[0].adapters["default"].planner = "auto"  # TR at 64 rows: a chain, not one product
    assert adapted.folded(model[0], x) is None
    again = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        assert torch.equal(again(x), model(x))
