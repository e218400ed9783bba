"""Adapters on what real models hold: a weight tied to another module, a parametrized weight
(weight_norm, spectral_norm), ``torch.compile``, adapters saved from one geometry and loaded onto
another, switching to a name that does not exist. Each case once gave a silently wrong result or
left the model changed before an error."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import tnspec

from ..model_state import snapshot, unchanged


def _nudged(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every adapter core drawn at random: the adapter away from its exact zero at init."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, m in model.named_modules():
            if isinstance(m, tnspec.Adapted):
                for layer in m.adapters.values():
                    for p in layer.parameters():
                        p.normal_(0, 0.5)
    return model


class TiedLM(nn.Module):
    """A language model's head tied to its token embedding, as GPT-2's and BERT's are."""

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids))))


def test_adapt_leaves_a_tied_head_out_and_merging_keeps_the_tie():
    torch.manual_seed(0)
    model = TiedLM()
    embedding = model.embed.weight.detach().clone()
    model, report = tnspec.adapt(model, "low_rank", rank=2)
    assert {a.name for a in report.adapted} == {"body"}
    assert report.skipped == (("head", "its weight is tied to 'embed''s (shared weights): left "
                               "alone so that merge_adapters keeps the tie"),)
    assert "skipped head: its weight is tied to 'embed'" in str(report)
    _nudged(model)
    ids = torch.randint(0, 50, (3, 7))
    with torch.no_grad():
        want = model(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn of: the tie is never touched
        merged = tnspec.merge_adapters(model)
    assert torch.equal(merged.embed.weight, embedding) and merged.head.weight is \
        merged.embed.weight
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), want, rtol=1e-5, atol=1e-5)
    # an Adapted built by hand around a tied layer: merging gives it a weight of its own, with
    # a warning, and never writes the shared tensor
    model = TiedLM()
    model.head = tnspec.Adapted(model.head)
    model.head.add("default", tnspec.formats.low_rank(16, 50, rank=2).layer(), 1.0, None, "V")
    model.head.active = "default"
    before = snapshot(model)
    with pytest.raises(tnspec.SpecError, match="no layer has an adapter named 'c'"):
        tnspec.merge_adapters(model, ["default", "c"], inplace=True)
    assert unchanged(before, model) and before["ties"] == [["embed.weight", "head.base.weight"]]
    with pytest.warns(UserWarning, match=r"'head' shares its weight with 'embed'"):
        tnspec.merge_adapters(model, inplace=True)
    assert torch.equal(model.embed.weight, before["param embed.weight"][0])


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_a_compiled_adapted_model_computes_what_eager_does(kind):
    torch.manual_seed(0)
    base = nn.Linear(12, 8) if kind == "linear" else nn.Conv2d(4, 6, 3, padding=1)
    x = torch.randn(5, 12) if kind == "linear" else torch.randn(2, 4, 6, 6)
    model, _ = tnspec.adapt(nn.Sequential(base), "low_rank", rank=2)
    _nudged(model)
    with torch.no_grad():
        eager = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model)(x)
    # the adapter's share of the output is not small: dropping its scaling would show
    assert (eager - base(x)).abs().max() > 0.1 * eager.abs().max()
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("parametrize", [
    lambda m: parametrizations.weight_norm(m, dim=2),
    parametrizations.spectral_norm,
    lambda m: torch.nn.utils.weight_norm(m, dim=2),
], ids=["weight_norm", "spectral_norm", "old_weight_norm"])
def test_merging_into_a_parametrized_weight_keeps_the_adapter(parametrize):
    """A positional conv under weight_norm (wav2vec2's) and a spectrally normed layer: the
    merged model computes what the adapted one did."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old weight_norm is deprecated
        conv = parametrize(nn.Conv1d(8, 8, 5, padding=2, groups=2))
    model, report = tnspec.adapt(nn.Sequential(conv), "low_rank", rank=2)
    assert not report.skipped
    _nudged(model)
    model.eval()  # spectral_norm's power iteration runs in training mode only
    x = torch.randn(2, 8, 20)
    with torch.no_grad():
        want, base = model(x), conv(x)
    assert (want - base).abs().max() > 0.1 * want.abs().max()
    merged = tnspec.merge_adapters(model).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("saved, loaded, why", [
    (dict(padding=1, padding_mode="reflect"), dict(padding=1), "reflect"),
    (dict(padding=1), dict(padding=0), "padding"),
])
def test_adapters_load_only_onto_the_padding_they_were_trained_with(saved, loaded, why):
    torch.manual_seed(0)
    model, _ = tnspec.adapt(nn.Sequential(nn.Conv2d(4, 6, 3, **saved)), "cp", rank=2)
    state, config = tnspec.adapter_state_dict(_nudged(model)), tnspec.adapter_config(model)
    other = nn.Sequential(nn.Conv2d(4, 6, 3, **loaded))
    before = snapshot(other)
    with pytest.raises(tnspec.SpecError, match=f"layer '0'.*{why}"):
        tnspec.load_adapters(other, state, config)
    assert unchanged(before, other)


def test_setting_an_adapter_that_does_not_exist_changes_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    model, _ = tnspec.adapt(model, "low_rank", rank=2, name="a")
    model, _ = tnspec.adapt(model, "cp", rank=2, name="b", include=["0"])
    before = snapshot(model)
    with pytest.raises(tnspec.SpecError, match="no layer has an adapter named 'typo'"):
        tnspec.set_adapter(model, "typo")
    assert unchanged(before, model)
    assert [m.active for _, m in model.named_modules() if isinstance(m, tnspec.Adapted)] == \
        ["b", None]


def test_a_failed_load_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model, _ = tnspec.adapt(nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 4)), "low_rank", rank=2)
    state = copy.deepcopy(tnspec.adapter_state_dict(_nudged(model)))
    core = next(k for k in state if k.startswith("1.adapters.default."))
    state[core] = torch.zeros(1)  # broken
    fresh = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 4))
    before = snapshot(fresh)
    with pytest.raises(tnspec.SpecError, match="layer '1'"):
        tnspec.load_adapters(fresh, state, tnspec.adapter_config(model))
    assert unchanged(before, fresh)
    assert not any(isinstance(m, tnspec.Adapted) for m in fresh.modules())


def test_peft_builds_each_adapter_in_the_format_its_own_config_registered():
    peft = pytest.importorskip("peft")
    from tnspec.workflows.adapters.peft_bridge import register_peft
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 36, 6))
    model = peft.get_peft_model(copy.deepcopy(base), register_peft(
        peft.LoraConfig(r=2, target_modules=["0", "3"]), "tr"))
    model.add_adapter("b", register_peft(peft.LoraConfig(r=2, target_modules=["0", "3"]), "cp"))
    for i in (0, 3):
        layer = model.base_model.model[i]
        want = {name: tnspec.adapt(nn.Sequential(copy.deepcopy(base[i])), fmt, rank=2)[0][0]
                .adapters["default"].spec for name, fmt in (("default", "tr"), ("b", "cp"))}
        assert {name: layer.lora_tn[name].spec for name in want} == want
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(tnspec.SpecError, match="(?s)registers no tnspec format.*register_peft"):
        model.add_adapter("c", peft.LoraConfig(r=2, target_modules=["0", "3"]))
    assert {n for n, _ in model.named_parameters()} == set(before)


def _half_adapted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 8))
    model, _ = tnspec.adapt(model, "low_rank", rank=2, include=["0", "2"])
    return _nudged(model)


@pytest.mark.parametrize("workflow", ["tensorize", "compress", "merge"])
def test_other_workflows_leave_an_adapted_layer_whole(workflow):
    model = _half_adapted()
    x = torch.randn(4, 16)
    probe = torch.randn(3, 16)
    with torch.no_grad():
        want = {n: model[int(n)](probe) for n in ("0", "2")}
    if workflow == "tensorize":
        model, report = tnspec.tensorize(model, "cp", rank=0.5)
        assert [r.name for r in report.replaced] == ["4"]
        assert {n for n, _ in report.skipped} == {"0.base", "2.base"}
        why = dict(report.skipped)["0.base"]
        assert "inside the adapted module '0': merge_adapters first" in why
    elif workflow == "compress":
        model, report = tnspec.compress(model, 0.5, ("cp",), fit={"max_iter": 5})
        assert [c.name for c in report.choices] == ["4"]
    else:
        with pytest.warns(UserWarning, match=r"left the adapters of 2 adapted layer\(s\) as they "
                          r"are \(0, 2\): merge_adapters folds them"):
            model = tnspec.merge(model)
    assert isinstance(model[0], tnspec.Adapted) and isinstance(model[0].base, nn.Linear)
    with torch.no_grad():
        for n in ("0", "2"):
            assert torch.equal(model[int(n)](probe), want[n])
    assert set(tnspec.adapter_config(model)["layers"]) == {"0", "2"}
    merged = tnspec.merge_adapters(model)
    with torch.no_grad():
        torch.testing.assert_close(merged(x), model(x), rtol=1e-5, atol=1e-6)


def test_compress_says_which_layers_it_found_and_why_it_left_them():
    model = nn.Sequential(nn.Linear(8, 8))
    model, _ = tnspec.adapt(model, "low_rank", rank=2)
    with pytest.raises(tnspec.SpecError, match=r"no layer to compress: 0.base: inside the "
                                               r"adapted module '0'"):
        tnspec.compress(model, 0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_peft_runs_tnspec_adapters_beside_a_half_precision_model(dtype):
    """PEFT keeps adapters in float32 beside a bf16 or fp16 base, as for its own LoRA: the
    input is cast to the adapter's dtype, and its output back."""
    peft = pytest.importorskip("peft")
    from tnspec.workflows.adapters.peft_bridge import register_peft
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)).to(dtype)
    x = torch.randn(4, 16).to(dtype)
    ref = base(x)
    model = peft.get_peft_model(copy.deepcopy(base), register_peft(
        peft.LoraConfig(r=2, target_modules=["0", "2"]), "cp"))
    assert {p.dtype for n, p in model.named_parameters() if "lora_tn" in n} == {torch.float32}
    y = model(x)
    assert y.dtype == dtype and torch.equal(y, ref)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(x).float().pow(2).mean().backward()
    opt.step()
    with torch.no_grad():
        trained = model(x)
    assert not torch.equal(trained, ref)
    merged = model.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(x), trained, rtol=2e-2, atol=2e-2)


def test_peft_refuses_saved_tnspec_adapters_without_the_registered_config(tmp_path):
    """Loaded as PEFT's plain LoRA, they would compute the base model's outputs (a warning
    about missing keys aside): the saved config lets only the registered one load them."""
    peft = pytest.importorskip("peft")
    from tnspec.workflows.adapters.peft_bridge import register_peft
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    config = register_peft(peft.LoraConfig(r=2, target_modules=["0", "2"]), "cp", scale=0.5)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_tn" in name:
                p.normal_()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["tnspec"] == {"format": "cp", "scale": 0.5, "options": {},
                               "target_modules": ["0", "2"]}
    with pytest.raises(Exception, match=r"tnspec adapters: load them with PeftModel"
                       r".from_pretrained\(model, path, config=tnspec.register_peft"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT's own about the unknown 'tnspec' key
            peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path, config=config)
    x = torch.randn(3, 16)
    torch.testing.assert_close(loaded(x), model(x))
    assert config.target_modules == {"0", "2"}  # the live config is as it was
