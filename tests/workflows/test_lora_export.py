"""``export_lora``: a tnspec adapter as PEFT's plain LoRA, loaded by PEFT alone."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import tnspec

peft = pytest.importorskip("peft")


def trained(model: nn.Module, fmt: str, rank: int) -> nn.Module:
    adapted, _ = tnspec.adapt(copy.deepcopy(model), fmt, rank=rank)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapted.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return adapted


def loaded(base: nn.Module, export: tnspec.LoraExport) -> nn.Module:
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**export.config))
    result = peft.set_peft_model_state_dict(model, export.state)
    assert not result.unexpected_keys
    return model


@pytest.mark.parametrize("fmt", ["tt", "cp", "tucker2"])
def test_an_exported_lora_reproduces_the_adapter_within_its_reported_error(fmt):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 5))
    x = torch.randn(3, 4, 6, 6)
    adapted = trained(base, fmt, 3)
    with torch.no_grad():
        want = adapted(x)
    # full rank: exact, as PEFT computes it
    full = tnspec.export_lora(adapted, rank=36)
    assert max(full.errors.values()) < 1e-6 and full.config["target_modules"] == ["0", "3"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(base, full)(x), want, rtol=1e-4, atol=1e-4)
    # rank 1: the error reported is the delta's, and the outputs move by about as much
    with pytest.warns(UserWarning, match=r"the rank-1 LoRA loses more than 0.05 of the "
                      r"adapter's delta in 2 of 2 layer\(s\), at worst 0\.\d\d \('\d'\)"):
        cut = tnspec.export_lora(adapted, rank=1)
    assert all(0 < e < 1 for e in cut.errors.values())
    assert "LoRA rank 1 of 2 layer(s)" in str(cut)
    delta = tnspec.merge_adapters(adapted)[3].weight - base[3].weight
    with torch.no_grad():
        lora = loaded(base, cut).base_model.model[3]
        got = lora.lora_B["default"].weight @ lora.lora_A["default"].weight
    err = float((got - delta).norm() / delta.norm())
    assert err == pytest.approx(cut.errors["3"], rel=1e-3)


def test_gpt2s_conv1d_exports_with_fan_in_fan_out():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                     n_positions=8, bos_token_id=0, eos_token_id=0)
    base = transformers.GPT2LMHeadModel(config).eval()
    adapted = trained(base, "tt", 2)
    ids = torch.randint(0, 32, (2, 5))
    export = tnspec.export_lora(adapted, rank=16)
    assert export.config["fan_in_fan_out"] is True
    with torch.no_grad():
        torch.testing.assert_close(loaded(base, export)(ids).logits, adapted(ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_layers_without_a_lora_form_are_named_before_anything_is_made():
    model = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2), nn.Conv2d(8, 8, 3, dilation=2))
    adapted, _ = tnspec.adapt(model, "cp", rank=2)
    with pytest.raises(tnspec.SpecError, match=r"layer '0' \(Conv2d\) has no LoRA form"):
        tnspec.export_lora(adapted, rank=2)
    with pytest.raises(tnspec.SpecError, match="rank=0 must be a positive int"):
        tnspec.export_lora(adapted, rank=0)
    with pytest.raises(tnspec.SpecError, match="no adapted layer has an adapter named 'x'"):
        tnspec.export_lora(tnspec.adapt(nn.Sequential(nn.Linear(3, 3)), "cp", rank=1)[0], 2,
                           name="x")
    with pytest.raises(tnspec.SpecError, match="the model is a bare adapted layer"):
        tnspec.export_lora(tnspec.adapt(nn.Linear(3, 3), "cp", rank=1)[0], 2)


def test_modules_trained_in_full_go_with_the_lora_and_peft_loads_them():
    """A new head trained in full (``modules_to_save``) is exported as PEFT saves its
    ``modules_to_save``: its tensors and its name in the config, so that PEFT's model is the
    adapted one, head included. (It was left out without a word: PEFT then ran the untrained
    head.) Full rank, no warning; a warning names the worst layer when the cut loses much."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(),
                         nn.Linear(12, 3))
    adapted, _ = tnspec.adapt(copy.deepcopy(base), "tt", rank=4, include=["0", "2"],
                              modules_to_save="4")
    with torch.no_grad():
        for p in adapted.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(5, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export = tnspec.export_lora(adapted, rank=12)
    assert export.config["modules_to_save"] == ["4"]
    assert {"base_model.model.4.weight", "base_model.model.4.bias"} <= set(export.state)
    with torch.no_grad():
        torch.testing.assert_close(loaded(base, export)(x), adapted(x), rtol=1e-4, atol=1e-4)
    with pytest.warns(UserWarning, match=r"give a higher rank .* or warn_above=None"):
        tnspec.export_lora(adapted, rank=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tnspec.export_lora(adapted, rank=1, warn_above=None)
