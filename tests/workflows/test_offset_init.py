"""``adapt(init="offset")``: every core drawn, a frozen copy of the adapter at init subtracted.
The base's output at init (bit for bit without autograd, to float rounding with it) and an
exact merge over every geometry; every core learning from the first step; the frozen copy
saved, loaded, swapped and refused as the cores are."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import tnspec
from experiments.models.adapters import GEOMETRIES

from ..model_state import snapshot, unchanged

FORMATS = ("low_rank", "cp", "tucker2", "tt", "tr", "tt_lora")


def _adapt(model: nn.Module, fmt: str, rank: float | int, **kw) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # modes of small channel counts
        return tnspec.adapt(model, fmt, rank=rank, init="offset", **kw)[0]


def _small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 5 * 5, 10))


@pytest.mark.parametrize("rule", [None, "spectral"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_offset_adapters_are_the_base_at_init_and_merge_exactly(geometry, fmt, rule):
    make, shape = GEOMETRIES[geometry]
    torch.manual_seed(0)
    base = make()
    model = _adapt(nn.Sequential(copy.deepcopy(base)), fmt, 2, step_rule=rule)
    adapted = model[0]
    x = torch.randn(shape)
    with torch.no_grad():  # no autograd: the adapter and its copy run the same kernels
        assert torch.equal(model(x), base(x))
    # with autograd, a matmul may take another kernel for a weight that requires grad: the
    # two then differ in the last bits of the adapter's output, not more
    drawn = adapted.scaling["default"] * adapted.adapters["default"](x)
    assert (model(x) - base(x)).abs().max() <= 1e-5 * drawn.abs().max()
    assert drawn.abs().max() > 0  # every core drawn: the adapter itself is not zero
    assert torch.count_nonzero(adapted.delta_weight("default")) == 0  # merges to nothing
    with torch.no_grad():
        for p in adapted.adapters["default"].parameters():
            p.add_(torch.randn_like(p) * 0.3)
        y = model(x)
    assert not torch.allclose(y, base(x))
    merged = tnspec.merge_adapters(model)
    with torch.no_grad():
        assert (merged(x) - y).norm() <= 1e-5 * y.norm()


@pytest.mark.parametrize("fmt", ["tt", "tr", "tucker2"])
def test_every_core_learns_from_the_first_step_where_a_zero_core_blocks_them(fmt):
    x = torch.randn(6, 8, 5, 5)

    def moved(init: str) -> set[str]:
        torch.manual_seed(0)
        model, _ = tnspec.adapt(_small(), fmt, rank=0.3, init=init, include=["0"])
        model(x).pow(2).mean().backward()
        layer = model[0].adapters["default"]
        return {n for n, p in layer.named_parameters() if p.grad is not None and
                p.grad.abs().max() > 0}

    cores = {c.name for c in tnspec.adapt(_small(), fmt, rank=0.3, include=["0"])[0][0]
             .adapters["default"].network.cores}
    assert moved("offset") == cores
    assert len(moved("zero")) == 1  # only the zero core: its neighbours' gradient is zero


def test_the_frozen_copy_never_trains_and_adds_no_trainable_parameter():
    zero, report = tnspec.adapt(_small(), "tt", rank=0.3, init="zero")
    model, offset_report = tnspec.adapt(_small(), "tt", rank=0.3, init="offset")
    assert offset_report.trainable == report.trainable
    assert "less its frozen copy at init" in str(offset_report)
    assert "starts at zero" in str(report)
    tnspec.adapt(model, "cp", rank=0.3, name="other", init="zero")
    tnspec.set_adapter(model, "default")
    assert not any(p.requires_grad for p in model[0].offsets.parameters())
    assert set(model[0].offsets) == {"default"}  # the cp adapter was built with a zero core


def test_state_and_config_keep_the_frozen_copy_and_reload_bit_for_bit():
    model = _adapt(_small(), "tr", 0.3, step_rule="spectral")
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(4, 8, 5, 5)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    state, config = tnspec.adapter_state_dict(model), tnspec.adapter_config(model)
    assert {k for k in state if ".offsets." in k} == \
        {f"{p}.offsets.default.{c.name}" for p in ("0", "3")
         for c in model[int(p)].adapters["default"].network.cores}
    config = json.loads(json.dumps(config))
    assert config["layers"]["0"]["adapters"]["default"]["init"] == "offset"
    loaded = tnspec.load_adapters(_small(), state, config)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_a_config_without_the_init_or_an_unknown_one_is_refused_and_the_model_unchanged():
    model = _adapt(_small(), "tt", 0.3)
    state, config = tnspec.adapter_state_dict(model), tnspec.adapter_config(model)
    stripped = copy.deepcopy(config)
    for layer in stripped["layers"].values():
        layer["adapters"]["default"].pop("init")
    target = _small()
    before = snapshot(target)
    with pytest.raises(tnspec.SpecError, match=r"the frozen copy 'default' of layer '0': the "
                       r"state has 'A', which its config does not build"):
        tnspec.load_adapters(target, state, stripped)
    assert unchanged(before, target)
    future = copy.deepcopy(config)
    future["layers"]["0"]["adapters"]["default"]["init"] = "orthogonal"
    with pytest.raises(tnspec.SpecError, match="init 'orthogonal', which this tnspec does not "
                       "know"):
        tnspec.load_adapters(target, state, future)
    assert unchanged(before, target)
    with pytest.raises(tnspec.SpecError, match="unknown init 'random'"):
        tnspec.adapt(target, "tt", init="random")
    assert unchanged(before, target)


def test_hotswap_writes_the_frozen_copy_and_refuses_a_zero_init_adapter():
    x = torch.randn(4, 8, 5, 5)
    model = _adapt(_small(), "tt", 0.3)
    torch.manual_seed(1)
    other = _adapt(_small(), "tt", 0.3)  # another draw: another frozen copy
    with torch.no_grad():
        for p in other.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    tnspec.hotswap(model, tnspec.adapter_state_dict(other), tnspec.adapter_config(other))
    with torch.no_grad():
        torch.testing.assert_close(model(x), other(x), rtol=1e-5, atol=1e-6)
    saved = tnspec.adapter_state_dict(other)
    without = {k: v for k, v in saved.items() if k != "3.offsets.default.A"}
    before = snapshot(model)
    with pytest.raises(tnspec.SpecError, match=r"layer '3': offsets core A is missing"):
        tnspec.hotswap(model, without, tnspec.adapter_config(other))
    assert unchanged(before, model)  # layer 0's writes were checked, not made
    zero, _ = tnspec.adapt(_small(), "tt", rank=0.3, init="zero")
    before = snapshot(zero)
    with pytest.raises(tnspec.SpecError, match="the saved adapter's init is 'offset', adapter "
                       "'default' has 'zero'"):
        tnspec.hotswap(zero, tnspec.adapter_state_dict(other), tnspec.adapter_config(other))
    assert unchanged(before, zero)


def test_lora_export_of_an_offset_adapter_is_what_the_adapter_adds():
    model = _adapt(_small(), "tucker2", 0.3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    export = tnspec.export_lora(model, 64)  # full rank: the delta itself
    a = export.state["base_model.model.3.lora_A.weight"]
    b = export.state["base_model.model.3.lora_B.weight"]
    assert export.errors["3"] < 1e-6
    h = torch.randn(5, 16 * 5 * 5)
    with torch.no_grad():  # against the layer's output, so that a delta without the offset fails
        added = model[3](h) - model[3].base(h)
    torch.testing.assert_close(h @ (b @ a).T, added, rtol=1e-4, atol=1e-5)


def test_the_principal_start_fits_the_base_weights_principal_part_and_cancels_it():
    """``init="principal"``: PiSSA's start for any format. The cores are fitted to the base
    weight's principal part in the format (for low_rank, the truncated SVD), and a frozen
    copy cancels them, so the model is the base model at init; the function is PiSSA's
    ``(W - A0) + A`` with the base weight untouched. After a training step, merging, saving
    and loading, and exporting as LoRA all give the trained model."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
    x = torch.randn(5, 16)
    model, report = tnspec.adapt(copy.deepcopy(base), "low_rank", rank=4, init="principal")
    assert all("principal part" in a.note for a in report.adapted)
    with torch.no_grad():
        torch.testing.assert_close(model(x), base(x), rtol=0, atol=1e-6)
    adapted = model[0]
    layer, scaling = adapted.adapters["default"], adapted.scaling["default"]
    start = scaling * layer.dense_weight().detach()
    u, s, vh = torch.linalg.svd(base[0].weight.detach(), full_matrices=False)
    torch.testing.assert_close(start, (u[:, :4] * s[:4]) @ vh[:4], rtol=1e-4, atol=1e-5)
    # PiSSA's scale: the cores hold the part themselves, at equal norms (as U sqrt(S) and
    # sqrt(S) V^T do), so that Adam's steps, about lr an entry, are not shrunk by a small
    # scaling
    norms = [float(p.norm()) for p in layer.parameters()]
    assert scaling == 1.0 and max(norms) == pytest.approx(min(norms), rel=1e-5)
    for fmt in ("tt", "tr", "cp"):  # any format: fitted, exact at init
        other, rep = tnspec.adapt(copy.deepcopy(base), fmt, rank=0.5, init="principal")
        with torch.no_grad():
            torch.testing.assert_close(other(x), base(x), rtol=0, atol=1e-6)
        assert all("principal part" in a.note for a in rep.adapted)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(x).pow(2).sum().backward()
    opt.step()
    with torch.no_grad():
        trained = model(x)
        assert not torch.allclose(trained, base(x))
        merged = tnspec.merge_adapters(copy.deepcopy(model))
        torch.testing.assert_close(merged(x), trained, rtol=1e-5, atol=1e-6)
        again = tnspec.load_adapters(copy.deepcopy(base), tnspec.adapter_state_dict(model),
                                     tnspec.adapter_config(model))
        torch.testing.assert_close(again(x), trained, rtol=1e-6, atol=1e-7)
    export = tnspec.export_lora(model, rank=16)
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**export.config))
    peft.set_peft_model_state_dict(lora, export.state)
    with torch.no_grad():
        torch.testing.assert_close(lora(x), trained, rtol=1e-4, atol=1e-5)


def test_the_default_start_shares_the_scale_out_over_the_adapted_layers():
    """Unasked, ``adapt`` draws every core and gives each of ``n`` layers ``min(1, 4 / n)``
    of its base's output variance (docs/adapters.md, "The default start"): the drawn
    adapters' variance over the base's, measured with the frozen copy set aside, follows."""
    from tnspec.workflows.adapters.adapt import drawn_scale
    assert drawn_scale("offset", 3) == 1.0 and drawn_scale("principal", 36) == 4 / 36
    assert drawn_scale("zero", 36) == 1.0

    def net(n: int) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(n)])
    ratios = {}
    for n in (2, 16):
        model, report = tnspec.adapt(net(n), "cp", rank=8)
        assert report.scale == min(1.0, 4 / n)
        assert all(a.init == "offset" for a in report.adapted)
        assert ("scale" in str(report).splitlines()[0]) == (n > 4)
        x = torch.randn(512, 64)
        layer = model[0]
        with torch.no_grad():  # the drawn adapter alone: its copy is what cancels it at init
            drawn = layer.scaling["default"] * layer.adapters["default"](x)
            ratios[n] = float(drawn.var() / layer.base(x).var())
    assert 0.6 < ratios[16] / ratios[2] / 0.25 < 1.6, ratios
    _, zero = tnspec.adapt(net(16), "cp", rank=8, init="zero")
    _, given = tnspec.adapt(net(16), "cp", rank=8, scale=0.5)
    assert zero.scale == 1.0 and given.scale == 0.5


@pytest.mark.parametrize("fmt", ["low_rank", "tt", "tr"])
def test_the_drawn_scale_is_the_output_multiplier_so_a_step_moves_by_its_root(fmt):
    """``scale`` is carried by the adapter's output multiplier, the cores drawn as at
    ``scale=1``: Adam's first step moves each entry by ``lr`` whatever the gradient's size, so
    the step moves the output by ``sqrt(scale)`` of what it moves at ``scale=1`` (with cores
    drawn smaller it fell only as ``scale ** ((k - 1) / 2k)``: on the tree before, 0.70 of it
    for low_rank and TT at a quarter, 0.59 for TR, where it is now 0.5)."""
    x = torch.randn(256, 64)
    moved, cores = {}, {}
    for scale in (1.0, 0.25):
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(64, 64))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # modes of small widths
            model = tnspec.adapt(base, fmt, rank=0.1, scale=scale)[0]
        cores[scale] = [p.detach().clone() for p in model[0].adapters["default"].parameters()]
        with torch.no_grad():
            before = model(x)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model(x).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():
            moved[scale] = float((model(x) - before).norm())
    assert all(torch.equal(a, b) for a, b in zip(cores[1.0], cores[0.25]))  # drawn alike
    assert moved[0.25] / moved[1.0] == pytest.approx(0.5, rel=1e-3), moved


def test_the_drawn_scale_counts_the_layers_that_get_an_adapter():
    """Layers a small share skips ("even rank 1 has ... parameters") take no part of the
    scale: one wide layer adapted beside twelve narrow ones skipped gets ``min(1, 4 / 1)``,
    drawn as it would be alone (on MobileNetV2 at a share of 0.008, 2 of 34 convs adapted got
    4 / 34 before)."""
    def net() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 256), *[nn.Linear(4, 4) for _ in range(12)])
    alone = nn.Sequential(nn.Linear(256, 256))
    alone.load_state_dict({k: v for k, v in net().state_dict().items() if k.startswith("0.")})
    model, report = tnspec.adapt(net(), "tt", rank=0.02)
    assert [a.name for a in report.adapted] == ["0"] and len(report.skipped) == 12
    assert report.scale == 1.0
    assert all("over the budget" in why for _, why in report.skipped), \
        report.skipped
    torch.manual_seed(1)
    first = tnspec.adapt(model, "tt", rank=0.02, name="again")[0][0].adapters["again"]
    torch.manual_seed(1)
    only = tnspec.adapt(alone, "tt", rank=0.02, name="again")[0][0].adapters["again"]
    for (k, a), (_, b) in zip(first.state_dict().items(), only.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("fmt, base, shape", [
    ("low_rank", lambda: nn.Linear(32, 24), (4, 5, 32)),
    ("cp", lambda: nn.Conv2d(8, 12, 3, padding=1), (2, 8, 6, 6)),
    ("low_rank", lambda: nn.Conv1d(8, 6, 3, stride=2, groups=2), (2, 8, 11)),
])
def test_a_one_bond_adapter_less_its_copy_trains_as_one_network_of_twice_the_bond(
        fmt, base, shape):
    """While it trains on data that needs a gradient, an adapter whose cores carry one bond
    (low_rank, CP) less its frozen copy runs once, at twice the bond: the output and every
    gradient are those of the two layers run one after the other (to float rounding), and
    the step contracts the data once, not a second time for the copy."""
    torch.manual_seed(0)
    model = _adapt(nn.Sequential(base()), fmt, 2)
    adapted = model[0]
    adapter, frozen = adapted.adapters["default"], adapted.offsets["default"]
    with torch.no_grad():  # away from init: the two differ
        for p in adapter.parameters():
            p.add_(0.3 * torch.randn_like(p))
    _as_if_run_apart(model, torch.randn(shape, requires_grad=True))
    assert "_doubled" in frozen.__dict__ and frozen.__dict__["_doubled"] is not None
    assert all(p is None for p in frozen.__dict__["_doubled"]._parameters.values())


@pytest.mark.parametrize("fmt, base, shape", [
    ("tr", lambda: nn.Linear(256, 256), (4, 16, 256)),
    ("tt_lora", lambda: nn.Linear(256, 256), (64, 256)),
])
def test_a_chain_of_two_weights_less_its_copy_runs_once_at_twice_the_bond(fmt, base, shape):
    """TR's and tt_lora's cores carry more than one bond, but their plan applies two weights
    built of them, one linear after the other: while the adapter trains on data that needs a
    gradient, it less its frozen copy is one such chain at twice the bond between the two
    (the generated _reused stacks them, the copy's second negated). The output and every
    gradient are the two layers' run apart (to float rounding); at init it is the base's."""
    torch.manual_seed(0)
    model = _adapt(nn.Sequential(base()), fmt, 0.1)
    adapted = model[0]
    adapter, frozen = adapted.adapters["default"], adapted.offsets["default"]
    x = torch.randn(shape, requires_grad=True)
    flat = x.reshape(-1, shape[-1])  # at these sizes the plan is such a chain
    assert adapter._running(flat).chain and not adapter._running(flat).alone
    torch.testing.assert_close(model(x), adapted.base(x), rtol=0, atol=1e-6)
    with torch.no_grad():  # away from init: the two differ
        for p in adapter.parameters():
            p.add_(0.3 * torch.randn_like(p))
    _as_if_run_apart(model, x)
    assert "_minus" not in adapter.__dict__  # taken out: the chain did the subtraction
    assert frozen.__dict__.get("_doubled") is None  # more than one bond: no doubled network


def _as_if_run_apart(model: nn.Module, x: torch.Tensor) -> None:
    """A step of the one adapted layer of ``model`` gives the output and the gradients (of the
    data and of every core) that its adapter and frozen copy run apart give."""
    adapted = model[0]
    adapter, frozen = adapted.adapters["default"], adapted.offsets["default"]
    y = model(x)
    g = torch.randn_like(y)
    y.backward(g)
    got = [x.grad] + [p.grad for p in adapter.parameters()]
    x.grad = None
    adapter.zero_grad(set_to_none=True)
    want_y = adapted.base(x) + adapted.scaling["default"] * (adapter(x) - frozen(x))
    want_y.backward(g)
    want = [x.grad] + [p.grad for p in adapter.parameters()]
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_without_a_gradient_to_the_data_the_copy_runs_and_is_exact_at_init():
    torch.manual_seed(0)
    model = _adapt(nn.Sequential(nn.Linear(32, 24)), "low_rank", 2)
    x = torch.randn(4, 32)
    assert torch.equal(model(x), model[0].base(x))  # the data needs no gradient
    with torch.no_grad():
        assert torch.equal(model(x.requires_grad_(True)), model[0].base(x))
    assert "_doubled" not in model[0].offsets["default"].__dict__


def test_the_frozen_copy_holds_every_parameter_of_the_layer_bias_included():
    """The copy is built on empty memory: every value it holds is copied, the bias too (it
    was not, once: an uninitialized bias made a CI run's difference NaN now and then)."""
    from tnspec.workflows.adapted import frozen_copy
    torch.manual_seed(0)
    layer = tnspec.formats.build("tt", 64, 64, rank=0.2).layer()
    with torch.no_grad():
        layer.bias.normal_()
    copy_ = frozen_copy(layer)
    assert dict(copy_.named_parameters()).keys() == dict(layer.named_parameters()).keys()
    for name, p in layer.named_parameters():
        assert torch.equal(getattr(copy_, name), p), name
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.equal(copy_(x), layer(x))


@pytest.mark.parametrize("fmt, planner, needs_grad", [("tt", "dense-first", False),
                                                       ("low_rank", "auto", True)])
def test_a_layer_with_a_bias_less_its_copy_subtracts_the_copy_whole(fmt, planner, needs_grad):
    """A bias is in the layer's output, not in its weights: where the plan applies one weight
    (TT, dense-first) their difference would drop it, and the network at twice the bond
    (low_rank, the data needing a gradient) would add it once. The copy runs and is
    subtracted, bias and all."""
    from tnspec.workflows.adapted import frozen_copy, less
    torch.manual_seed(0)
    layer = tnspec.formats.build(fmt, 64, 48, rank=0.2).layer(planner=planner)
    with torch.no_grad():
        layer.bias.normal_()
    copy_ = frozen_copy(layer)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(5, 64, requires_grad=needs_grad)
    assert layer._running(x).alone is (fmt == "tt")
    torch.testing.assert_close(less(layer, copy_, x), layer(x) - copy_(x))
    assert copy_.__dict__.get("_doubled") is None


def test_an_adapter_with_hooks_of_its_own_runs_as_a_module():
    """A forward hook on the adapter layer (a user's, or FSDP's pre-hook that gathers its
    cores) fires at every call: the adapter then runs as a module, its copy apart."""
    torch.manual_seed(0)
    model = _adapt(nn.Sequential(nn.Linear(32, 24)), "low_rank", 2)
    adapter = model[0].adapters["default"]
    calls = []
    adapter.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape))
    x = torch.randn(4, 32, requires_grad=True)
    model(x).sum().backward()
    assert calls == [torch.Size([4, 32])]
    assert "_doubled" not in model[0].offsets["default"].__dict__


# the doubled network; one weight's difference; a chain of two at twice the bond
@pytest.mark.parametrize("fmt, width, rank", [("low_rank", 64, 0.2), ("tt", 64, 0.2),
                                              ("tr", 256, 0.1)])
def test_a_step_that_raises_leaves_the_model_and_its_adapter_as_they_were(fmt, width, rank,
                                                                          monkeypatch):
    """A failure inside the adapter's contraction, after the adapter was asked for its
    difference (TT), for its chain at twice the bond (TR) or the doubled network got its
    cores (low_rank): the model is as it was (values, requires_grad, structure, ties,
    adapters), the adapter holds no ``_minus`` and the doubled network no step's tensors,
    and the next step runs."""
    torch.manual_seed(0)
    model = _adapt(nn.Sequential(nn.Linear(width, width), nn.Linear(width, width)), fmt, rank)
    x = torch.randn(2, 128, width, requires_grad=True)
    model(x).sum().backward()  # planned: the failing call below takes the hot path
    model.zero_grad(set_to_none=True)
    before = snapshot(model)
    linear = torch.nn.functional.linear
    reached = []

    def failing(input, weight, bias=None):  # the base's weight is a Parameter, not the rest
        if not isinstance(weight, nn.Parameter):
            reached.append(weight.shape)
            raise RuntimeError("injected")
        return linear(input, weight, bias)
    monkeypatch.setattr(torch.nn.functional, "linear", failing)
    with pytest.raises(RuntimeError, match="injected"):
        model(x)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    assert reached and unchanged(before, model)
    for adapted in (model[0], model[1]):
        assert "_minus" not in adapted.adapters["default"].__dict__
        doubled = adapted.offsets["default"].__dict__.get("_doubled")
        assert doubled is None or all(p is None for p in doubled._parameters.values())
    doubled = model[0].offsets["default"].__dict__.get("_doubled")
    assert (fmt == "low_rank") == (doubled is not None)
    running = model[0].adapters["default"]._running(x.reshape(-1, width))
    assert (fmt == "tt") == running.alone and (fmt == "tr") == running.chain
    model(x).sum().backward()
