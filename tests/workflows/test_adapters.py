"""Adapters (``tnspec.adapt``): exact at init over every geometry ``nn.ConvNd`` accepts, only
adapter parameters train, exact merge, state on its own, named adapters, the init rule."""

from __future__ import annotations

import copy
import io
import json
import math
import warnings

import pytest
import torch
from torch import nn

import tnspec
from experiments.models.adapters import GEOMETRIES

from ..model_state import snapshot, unchanged

FORMATS = ("low_rank", "cp", "tucker2", "tt", "tr")
EXACT = FORMATS + ("tt_lora",)  # exact zero at init and exact merge: every adapter format


def _adapted(geometry: str, fmt: str, rank: int = 2, seed: int = 0, init: str = "zero"):
    make, shape = GEOMETRIES[geometry]
    torch.manual_seed(seed)
    base = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a tt of 4 channels as (2, 2) modes at rank 2 is tiny
        model, report = tnspec.adapt(nn.Sequential(copy.deepcopy(base)), fmt, rank=rank,
                                     init=init)
    assert not report.skipped, report.skipped
    return base, model, shape


@pytest.mark.parametrize("fmt", EXACT)
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_adapted_equals_base_bit_for_bit_at_init_and_merges_exactly(geometry, fmt):
    base, model, shape = _adapted(geometry, fmt)
    x = torch.randn(shape)
    assert isinstance(model[0], tnspec.Adapted)
    assert torch.equal(model(x), base(x))
    assert torch.equal(model(x[0]), base(x[0]))  # unbatched input, as nn.ConvNd takes it
    with torch.no_grad():  # the adapter away from zero: every core random
        for p in model[0].adapters.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    y = model(x)
    assert not torch.allclose(y, base(x))
    merged = tnspec.merge_adapters(model)
    assert type(merged[0]) is type(base)
    for key in ("stride", "padding", "dilation", "groups", "padding_mode"):
        assert getattr(merged[0], key, None) == getattr(base, key, None)
    assert (merged(x) - y).norm() <= 1e-5 * y.norm()
    assert torch.equal(model[0].base.weight, base.weight)  # merge worked on a copy


@pytest.mark.parametrize("fmt", EXACT)
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_the_default_start_is_exact_without_autograd_and_to_rounding_with_it(geometry, fmt):
    """The default (``init="offset"``): every core drawn, a frozen copy subtracted. Without
    autograd the model computes the base's output bit for bit; while autograd records, a
    matmul may take another kernel for a weight that requires grad, so within rounding."""
    make, shape = GEOMETRIES[geometry]
    torch.manual_seed(0)
    base = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, report = tnspec.adapt(nn.Sequential(copy.deepcopy(base)), fmt, rank=2)
    assert report.adapted[0].init == "offset" and "default" in model[0].offsets
    x = torch.randn(shape)
    with torch.no_grad():
        assert torch.equal(model(x), base(x))
        assert torch.equal(model(x[0]), base(x[0]))
    want = base(x)
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("fmt", EXACT)
def test_an_optimizer_step_changes_only_adapter_parameters_and_every_core_learns_by_step_2(fmt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, stride=2, padding=1, padding_mode="reflect"),
                          nn.Flatten(), nn.LayerNorm(8 * 9), nn.Linear(8 * 9, 5))
    model, report = tnspec.adapt(model, fmt, rank=2, init="zero")
    assert len(report.adapted) == 3
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".adapters.default." in n for n in trainable)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x, target = torch.randn(6, 4, 5, 5), torch.randint(0, 5, (6,))
    grads = []
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), target).backward()
        grads.append({n: p.grad.abs().sum().item() for n, p in model.named_parameters()
                      if p.requires_grad})
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (n in trainable), n
    zeroed = {f"{a.name}.adapters.default.{a.zeroed}" for a in report.adapted}
    assert {n for n, g in grads[0].items() if g > 0} == zeroed  # step 1: the zero core alone
    assert all(g > 0 for g in grads[1].values())  # step 2: every core


def _update_size(fmt: str, rank: float, layer: nn.Module, x: torch.Tensor, scaled: bool) -> float:
    """The adapter's output std after 5 Adam steps (lr 1e-3), relative to the base's."""
    torch.manual_seed(1)
    model, _ = tnspec.adapt(copy.deepcopy(layer), fmt, rank=rank, init="zero")
    if not scaled:
        model.scaling["default"] = 1.0
    target = layer(x).detach() + 0.3 * torch.randn_like(layer(x))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(5):
        opt.zero_grad()
        (model(x) - target).pow(2).mean().backward()
        opt.step()
    with torch.no_grad():
        return ((model(x) - layer(x)).std() / layer(x).std()).item()


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_the_first_steps_move_the_output_alike_whatever_the_rank_and_format(kind):
    torch.manual_seed(0)
    layer = nn.Linear(256, 256) if kind == "linear" else nn.Conv2d(32, 32, 3, padding=1)
    x = torch.randn(512, 256) if kind == "linear" else torch.randn(16, 32, 12, 12)
    shares = (0.02, 0.08, 0.25) if kind == "linear" else (0.05, 0.1, 0.3)
    cases = [(f, r) for f in FORMATS for r in shares]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sizes = [_update_size(f, r, layer, x, True) for f, r in cases]
        raw = [_update_size(f, r, layer, x, False) for f, r in cases]
    spread, spread_raw = max(sizes) / min(sizes), max(raw) / min(raw)
    # within 1.6x of each other; without the zero core's scaling, spread out twice as far
    assert spread < 1.6 and spread_raw > 2 * spread, (dict(zip(cases, sizes)),
                                                      dict(zip(cases, raw)))


def test_the_adapter_reaches_scale_times_the_base_variance_at_the_zero_cores_graph_in_scale():
    torch.manual_seed(0)
    base = nn.Conv2d(32, 48, 3, padding=1)
    x = torch.randn(64, 32, 10, 10)
    for fmt in FORMATS:
        ratios = []
        for seed in range(12):
            torch.manual_seed(seed)
            model, report = tnspec.adapt(copy.deepcopy(base), fmt, rank=0.1, scale=0.25,
                                         init="zero")
            zeroed = getattr(model.adapters["default"], report.adapted[0].zeroed)
            with torch.no_grad():  # in units of its Graph-in std: std 1
                zeroed.normal_()
                delta = model(x) - base(x)
                plain = nn.functional.conv2d(x, base.weight, padding=1)
            ratios.append((delta.var() / plain.var()).item())
        assert 0.25 * 0.75 < sum(ratios) / len(ratios) < 0.25 * 1.25, (fmt, ratios)


@pytest.mark.parametrize("magnitude", [1e-4, 1e4])
def test_a_very_small_or_large_base_weight_gets_an_adapter_of_its_scale(magnitude):
    """Past the activation scales whose stds are finite (1e-6 to 1e6), the rest of the scale
    goes to the adapter's output multiplier: still ``scale`` times the base's variance."""
    torch.manual_seed(0)
    base = nn.Linear(64, 48)
    with torch.no_grad():
        base.weight.mul_(magnitude / base.weight.std())
    x = torch.randn(512, 64)
    ratios = []
    for seed in range(8):
        torch.manual_seed(seed)
        model, report = tnspec.adapt(copy.deepcopy(base), "cp", rank=4, scale=0.25,
                                     init="zero")
        zeroed = getattr(model.adapters["default"], report.adapted[0].zeroed)
        with torch.no_grad():
            zeroed.normal_()
            ratios.append(((model(x) - base(x)).var() / (x @ base.weight.T).var()).item())
    assert 0.25 * 0.7 < sum(ratios) / len(ratios) < 0.25 * 1.3, ratios


def test_state_dict_holds_only_adapters_and_reloads_onto_a_fresh_model():
    torch.manual_seed(0)
    fresh = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, padding_mode="circular"), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 36, 4))
    model, _ = tnspec.adapt(copy.deepcopy(fresh), "tr", rank=3, init="zero")
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    state, config = tnspec.adapter_state_dict(model), tnspec.adapter_config(model)
    adapter_tensors = {n: t for n, t in model.state_dict().items() if ".adapters." in n}
    assert state.keys() == adapter_tensors.keys()  # flat, named as the model names them
    base_ptrs = {p.data_ptr() for n, p in model.named_parameters() if ".adapters." not in n}
    assert not base_ptrs & {t.data_ptr() for t in state.values()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    config = json.loads(json.dumps(config))  # JSON-able
    loaded = tnspec.load_adapters(copy.deepcopy(fresh),
                                  torch.load(buffer, weights_only=True), config)
    x = torch.randn(2, 3, 6, 6)
    # equal up to float32 rounding: see test_peft_runs_tnspec_adapters_through_its_own_api
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-6, atol=1e-7)
    trained, reloaded = model.state_dict(), loaded.state_dict()
    assert trained.keys() == reloaded.keys()
    assert all(torch.equal(reloaded[k], v) for k, v in trained.items())
    assert {n for n, p in loaded.named_parameters() if p.requires_grad} == \
        {n for n, p in model.named_parameters() if p.requires_grad}


def test_loading_an_adapter_over_one_of_the_same_name_is_refused_and_changes_nothing():
    """Loading adapters onto a model that holds one of that name replaced it without a word;
    it is an error now, raised before the model is touched, for adapted layers and for
    modules trained in full alike."""
    torch.manual_seed(0)
    model, _ = tnspec.adapt(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)), "tt",
                            rank=2, include="0", modules_to_save="2")
    state, config = tnspec.adapter_state_dict(model), tnspec.adapter_config(model)
    before = snapshot(model)
    with pytest.raises(tnspec.SpecError, match="layer '0' already holds an adapter named "
                       "'default': loading would replace it") as caught:
        tnspec.load_adapters(model, state, config)
    assert "tnspec.hotswap" in str(caught.value)
    assert unchanged(before, model)
    config["layers"] = {}
    with pytest.raises(tnspec.SpecError, match="layer '2' already holds an adapter named "
                       "'default'"):
        tnspec.load_adapters(model, {n: t for n, t in state.items() if ".copies." in n}, config)
    assert unchanged(before, model)


def test_named_adapters_switch_disable_and_merge_by_name():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(3, 16)
    ref = base(x)
    model, _ = tnspec.adapt(copy.deepcopy(base), "low_rank", rank=2, name="a")
    model, report = tnspec.adapt(model, "tt", rank=2, name="b")
    assert report.adapter == "b" and model[0].active == "b"
    with torch.no_grad():
        for layer in (model[0], model[2]):
            for p in layer.adapters.parameters():
                p.normal_()
    out = {}
    for name in ("a", "b"):
        tnspec.set_adapter(model, name)
        trainable = {n.split(".adapters.")[1].split(".")[0]
                     for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == {name}
        out[name] = model(x)
    assert not torch.allclose(out["a"], out["b"])
    with tnspec.disable_adapters(model):
        assert torch.equal(model(x), ref)
    assert torch.equal(model(x), out["b"])
    merged = tnspec.merge_adapters(model, "a")
    assert torch.allclose(merged(x), out["a"], rtol=1e-5, atol=1e-6)
    with pytest.raises(tnspec.SpecError, match="no layer has an adapter named 'c'"):
        tnspec.set_adapter(model, "c")
    with pytest.raises(tnspec.SpecError, match="no layer has an adapter named 'c'"):
        tnspec.merge_adapters(model, "c")
    with pytest.raises(tnspec.SpecError, match="adapt changed nothing: 0: it has an adapter "
                                               "named 'a' already"):
        tnspec.adapt(model, "cp", name="a")


def test_merge_in_place_and_a_bare_layer():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 3)
    adapted, _ = tnspec.adapt(conv, "tucker2", rank=2)
    assert isinstance(adapted, tnspec.Adapted) and adapted.base is conv
    with torch.no_grad():
        adapted.adapters["default"].V.normal_()
    x = torch.randn(1, 4, 5, 5)
    y = adapted(x)
    merged = tnspec.merge_adapters(adapted, inplace=True)
    assert merged is conv and torch.allclose(conv(x), y, rtol=1e-5, atol=1e-6)


def test_a_spec_string_takes_its_channel_and_kernel_sizes_from_each_layer():
    spec = "x[b, c, h+kh, w+kw], U[c, r], V[r, kh, kw, o] -> y[b, o, h, w]"  # no padding
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 5, padding="same",
                                                                   padding_mode="reflect"),
                          nn.Conv2d(8, 8, 3, stride=2), nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(2, 3, 9, 9)
    model(x)
    ref = model(x)
    model, report = tnspec.adapt(model, spec, sizes={"r": 2}, include=["0", "1", "2"])
    assert [a.name for a in report.adapted] == ["0", "1"]
    assert report.skipped == (("2", "the adapter's geometry differs from the layer's: stride "
                               "(1, 1) where the layer has (2, 2)"),)
    with torch.no_grad():  # exact without autograd (with it, to float rounding)
        assert torch.equal(model(x), ref)
    assert report.adapted[0].params == 3 * 2 + 2 * 9 * 8
    assert report.adapted[1].params == 8 * 2 + 2 * 25 * 8
    with pytest.raises(tnspec.SpecError, match=r"adapt changed nothing: Conv2d: the adapter "
                       r"pads \(1, 1\), the layer \(2, 2\) \(zeros\)"):
        tnspec.adapt(nn.Conv2d(3, 8, 5, padding=2),
                     spec.replace("h+kh", "h+kh-1").replace("w+kw", "w+kw-1"), sizes={"r": 2})


def test_shared_layers_get_one_adapter_and_float_ranks_are_shares():
    shared = nn.Linear(64, 64)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    model, report = tnspec.adapt(model, "cp", rank=0.05)
    assert model[0] is model[2] and isinstance(model[0], tnspec.Adapted)
    assert len(report.adapted) == 1 and report.adapted[0].params <= 0.05 * 64 * 64
    assert f"{report.trainable:,} of {report.total:,} parameters train" in str(report)


def test_the_adapt_docstring_example_runs():
    import doctest
    from tnspec.workflows.adapters import adapt
    result = doctest.testmod(adapt, extraglobs={"nn": nn})
    assert result.failed == 0 and result.attempted >= 3


def test_bad_arguments_are_clear_errors():
    conv = nn.Conv2d(4, 4, 3)
    with pytest.raises(tnspec.SpecError, match="scale=0 must be a positive number"):
        tnspec.adapt(conv, scale=0)
    with pytest.raises(tnspec.SpecError, match="adapter name 'a b' must be a Python identifier"):
        tnspec.adapt(conv, name="a b")
    # arguments that leave every layer skipped: one error, and the model as it was
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Conv2d(4, 4, 3))
    before = snapshot(model)
    for kwargs, match in [
            (dict(fmt="tucker2", zero="Q"), r"adapt changed nothing: 0: zero='Q' is not a core"
                                            r".* \(and 1 more layer\(s\)\)"),
            (dict(fmt="x[b, i], W[i, o] -> y[b, o]", rank=3),
             "rank= and format options go with a format name"),
            (dict(fmt="lora"), r"unknown format 'lora'(?s:.*)LoRA is low_rank"),
            (dict(fmt="cp", rank=0), r"rank=0 is no rank"),
            (dict(fmt="cp", rank=1.5), r"rank=1.5 is no rank"),
            (dict(fmt="cp", rank=(2, -1)), r"rank=\(2, -1\) is no rank"),
            (dict(fmt="cp", include="nothing"), "no nn.Linear, nn.Conv1d/2d/3d or "
                                                "transformers' Conv1D layer is selected")]:
        with pytest.raises(tnspec.SpecError, match=match):
            tnspec.adapt(model, **kwargs)
        assert unchanged(before, model)
    with pytest.raises(tnspec.SpecError, match="not an adapter config"):
        tnspec.load_adapters(conv, {}, {"layers": {}})
    with pytest.raises(tnspec.SpecError, match="needs the adapters' config beside"):
        tnspec.load_adapters(conv, {})
    model, _ = tnspec.adapt(nn.Sequential(nn.Linear(4, 4)), "cp", rank=2)
    state, config = tnspec.adapter_state_dict(model), tnspec.adapter_config(model)
    with pytest.raises(tnspec.SpecError, match="no layer '0' to put an adapter on"):
        tnspec.load_adapters(nn.Sequential(), state, config)
    with pytest.raises(tnspec.SpecError, match="in_features 4 where the layer has 5"):
        tnspec.load_adapters(nn.Sequential(nn.Linear(5, 4)), state, config)
    fresh = nn.Sequential(nn.Linear(4, 4))
    before = snapshot(fresh)
    with pytest.raises(tnspec.SpecError, match=r"tensors no adapter uses: 'extra'"):
        tnspec.load_adapters(fresh, {**state, "extra": torch.ones(1)}, config)
    assert unchanged(before, fresh)


@pytest.mark.parametrize("name", ["train", "eval", "type", "keys"])
def test_an_adapter_name_nn_module_dict_has_is_refused(name):
    with pytest.raises(tnspec.SpecError, match=f"adapter name '{name}' is taken by "
                                               "nn.ModuleDict"):
        tnspec.adapt(nn.Sequential(nn.Linear(4, 4)), "cp", rank=2, name=name)


def test_an_adapter_larger_than_its_layer_is_said():
    with pytest.warns(UserWarning, match="adapter of 0 has more parameters than the layer"):
        _, report = tnspec.adapt(nn.Sequential(nn.Linear(16, 2)), "tt", rank=8)
    assert "more parameters than the layer it adapts" in report.adapted[0].note
    assert report.adapted[0].params > report.adapted[0].base_params


def test_a_model_on_the_meta_device_is_adapted_for_kaimings_variance():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    model, report = tnspec.adapt(model, "low_rank", rank=4)
    assert all("on the meta device" in a.note for a in report.adapted)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")  # materialized as usual
    assert model(torch.randn(2, 64)).shape == (2, 8)


def test_a_zero_weight_still_gives_a_scaled_adapter():
    conv = nn.Conv2d(4, 4, 3)
    with torch.no_grad():
        conv.weight.zero_()
    model, report = tnspec.adapt(conv, "low_rank", rank=2)
    assert "the base weight is zero" in report.adapted[0].note
    assert math.isfinite(model.scaling["default"]) and model.scaling["default"] > 0


def test_peft_runs_tnspec_adapters_through_its_own_api(tmp_path):
    peft = pytest.importorskip("peft", reason="the PEFT integration needs peft")
    from tnspec.workflows.adapters.peft_bridge import register_peft
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 36, 6))
    fresh = copy.deepcopy(base)
    x = torch.randn(2, 4, 6, 6)
    ref = base(x)
    config = register_peft(peft.LoraConfig(r=2, target_modules=["0", "3"]), "tr")
    model = peft.get_peft_model(base, config)
    assert torch.equal(model(x), ref)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_tn.default." in n for n in trainable)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    y = model(x)
    assert not torch.allclose(y, ref)
    with model.disable_adapter():
        assert torch.equal(model(x), ref)
    model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(fresh), tmp_path, config=config)
    # the same weights at other addresses: MKL's float32 GEMM may round differently with the
    # operands' alignment (an nn.Linear alone differs in the last bit on an AMD EPYC), so
    # equal up to float32 rounding, not bit for bit
    torch.testing.assert_close(loaded(x), y, rtol=1e-6, atol=1e-7)
    merged = model.merge_and_unload()
    assert type(merged[0]) is nn.Conv2d and merged[0].padding_mode == "reflect"
    assert (merged(x) - y).norm() <= 1e-5 * y.norm()


def test_the_report_names_adapted_layers_a_sample_forward_never_reaches():
    """``adapt(..., sample=batch)``: the adapted layers the forward never called (an
    AutoModel's pooler whose output the task ignores) are named in the report, since their
    adapters would never train; the sample runs in eval mode without changing the model."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 8)
            self.norm = nn.BatchNorm1d(8)
            self.pooler = nn.Linear(8, 8)  # defined, never called

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return self.norm(self.body(x)) * scale
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    model, report = tnspec.adapt(Net(), "cp", rank=2, sample=x)
    assert report.unreached == ("pooler",)
    assert "never reached by the sample's forward (their adapters will not train): pooler" \
        in str(report)
    assert model.training and torch.equal(model.norm.running_mean, torch.zeros(8))
    assert tnspec.adapt(Net(), "cp", rank=2, sample={"x": x, "scale": 2.0})[1].unreached == \
        ("pooler",)
    assert tnspec.adapt(Net(), "cp", rank=2, sample=(x, 2.0))[1].unreached == ("pooler",)
    assert tnspec.adapt(Net(), "cp", rank=2)[1].unreached == ()


def test_a_sample_the_model_does_not_take_raises_with_the_model_untouched():
    """``adapt(..., sample=...)`` runs the sample on the model before changing anything: a
    sample of the wrong shape, or a tuple the forward does not take, is a SpecError quoting
    the model's error, and the model is exactly as it was (structure, values,
    ``requires_grad``, ties)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
    model[2].weight = model[0].weight  # a tie, which the snapshot holds too
    model[3].weight.requires_grad_(False)
    before = snapshot(model)
    with pytest.raises(tnspec.SpecError, match=r"sample= does not run through the model: "
                       r"RuntimeError: mat1 and mat2 shapes cannot be multiplied"):
        tnspec.adapt(model, "tt", rank=2, sample=torch.randn(3, 5))
    assert unchanged(before, model)
    with pytest.raises(tnspec.SpecError, match=r"does not take a batch of sample= as "
                       r"model\(\*batch\)"):
        tnspec.adapt(model, "tt", rank=2, sample=(torch.randn(3, 4), torch.randn(3)))
    assert unchanged(before, model)


def test_an_error_while_drawing_an_adapter_leaves_the_model_as_it_was(monkeypatch):
    """Every adapter is drawn before ``adapt`` changes the model: an error while drawing one
    (here the second layer's frozen copy; a principal start's fit, an interrupt) leaves it
    exactly as it was, the adapters it held, their values, ``requires_grad`` and ties too."""
    from tnspec.workflows.adapters import adapt as adapt_module
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8))
    model[3].weight = model[1].weight  # a tie, which the snapshot holds too
    model, _ = tnspec.adapt(model, "low_rank", rank=2, name="first", include="0")
    model[1].bias.requires_grad_(True)  # adapt froze it: a flag a new adapt would set again
    before = snapshot(model)
    calls = []
    real = adapt_module.frozen_copy

    def failing(layer):
        calls.append(layer)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(layer)
    monkeypatch.setattr(adapt_module, "frozen_copy", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        tnspec.adapt(model, "tt", rank=2, name="second", include=["0", "2"])
    assert len(calls) == 2 and unchanged(before, model)
