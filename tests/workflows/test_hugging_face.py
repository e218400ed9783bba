"""Every workflow on Hugging Face models built from small configs (no download): GPT-2, whose
projections are ``transformers``' ``Conv1D`` (weight stored ``(in, out)``) and whose head is
tied to its token embedding, and BERT, fed dict batches as its tokenizer returns them."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import tnspec
from tnspec.workflows.dense_layers import weight_of

from ..model_state import snapshot, unchanged

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def bert(labels: int = 0) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=64,
                                     max_position_embeddings=16, num_labels=max(labels, 2))
    cls = transformers.BertForSequenceClassification if labels else transformers.BertModel
    return cls(config).eval()


def ids(batch: int = 3, length: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


def tied(model: nn.Module) -> bool:
    return model.lm_head.weight is model.transformer.wte.weight


def nudge(model: nn.Module) -> nn.Module:
    """Move every trainable parameter, as training would."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def test_weight_of_reads_a_conv1d_as_nn_linear_lays_its_weight_out():
    layer = Conv1D(5, 3)  # nf=5 outputs, nx=3 inputs
    x = torch.randn(4, 3)
    assert weight_of(layer).shape == (5, 3)
    torch.testing.assert_close(layer(x), x @ weight_of(layer).T + layer.bias)


def test_tensorize_replaces_gpt2s_conv1d_layers_and_leaves_the_tied_head():
    model = gpt2()
    model, report = tnspec.tensorize(model, "low_rank", rank=0.5)
    replaced = {r.name for r in report.replaced}
    assert "transformer.h.0.attn.c_attn" in replaced and "transformer.h.1.mlp.c_proj" in replaced
    assert not any(isinstance(m, Conv1D) for m in model.modules())
    assert dict(report.skipped)["lm_head"] == "tied to 'transformer.wte', which stays as it is"
    assert tied(model)
    act = {r.name: r.activation for r in report.replaced}
    assert act["transformer.h.0.mlp.c_fc"] == "gelu"  # NewGELUActivation, read as GELU
    assert act["transformer.h.0.attn.c_attn"] == "linear"
    want = logits(model, ids())
    assert want.shape == (3, 9, 64)
    merged = tnspec.merge(model)  # nn.Linear where Conv1D was: the same function
    assert isinstance(merged.transformer.h[0].attn.c_attn, nn.Linear) and tied(merged)
    torch.testing.assert_close(logits(merged, ids()), want, rtol=1e-4, atol=1e-4)


def test_a_fitted_conv1d_is_fitted_to_its_weight_not_its_transpose():
    layer = Conv1D(24, 16)
    nn.init.normal_(layer.weight)
    model = nn.Sequential(layer)
    model, report = tnspec.tensorize(model, "tucker2", rank=1.0, weights="fit")
    (row,) = report.replaced
    new = model[0]
    dense = new.dense_weight().detach()
    assert dense.shape == (24, 16)
    assert row.fit_error < 0.5
    err = float((dense - layer.weight.T).norm() / layer.weight.norm().detach())
    assert err == pytest.approx(row.fit_error, rel=1e-4)
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(new(x), x @ dense.T + layer.bias, rtol=1e-4, atol=1e-4)


def test_adapt_and_merge_on_gpt2_keep_the_tie_and_the_outputs():
    pretrained = gpt2()
    model, report = tnspec.adapt(copy.deepcopy(pretrained), "tt", rank=2)
    adapted = {a.name for a in report.adapted}
    assert {"transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc"} <= adapted
    assert "lm_head" not in adapted and "tied to 'transformer.wte'" in dict(report.skipped)[
        "lm_head"]
    tokens = ids()
    assert torch.equal(logits(model, tokens), logits(pretrained, tokens))  # zero at init
    nudge(model)
    want = logits(model, tokens)
    assert not torch.allclose(want, logits(pretrained, tokens))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = tnspec.merge_adapters(model)
    assert isinstance(merged.transformer.h[0].attn.c_attn, Conv1D) and tied(merged)
    assert torch.equal(merged.transformer.wte.weight, pretrained.transformer.wte.weight)
    torch.testing.assert_close(logits(merged, tokens), want, rtol=1e-4, atol=1e-4)
    # saved flat, as safetensors stores it, and back onto a fresh copy
    safetensors = pytest.importorskip("safetensors.torch")
    blob = safetensors.save(tnspec.adapter_state_dict(model))
    config = json.loads(json.dumps(tnspec.adapter_config(model)))
    again = tnspec.load_adapters(copy.deepcopy(pretrained), safetensors.load(blob), config)
    torch.testing.assert_close(logits(again, tokens), want, rtol=0, atol=0)


def test_compress_gpt2_with_dict_batches_and_audit_it():
    model = gpt2()
    tokens = ids(4, 12)
    want = logits(model, tokens)
    batches = [{"input_ids": tokens[:2]}, {"input_ids": tokens[2:]}]
    small, report = tnspec.compress(model, 0.6, data=batches, include="transformer.h.*",
                                    shares=(0.25, 0.5))
    assert report.data and len(report.choices) == 8  # 4 Conv1D per block
    assert report.params_after <= 0.6 * report.params_before and tied(small)
    got = logits(small, tokens)
    cos = nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > 0.9
    rows = {r["name"]: r for r in tnspec.audit(small, {"input_ids": tokens}).rows}
    fc = rows["transformer.h.0.mlp.c_fc"]
    assert fc["forward"] > 0 and fc["backward"] > 0  # through the ModelOutput, both ways


def test_compress_feeds_tuples_dicts_or_run_and_says_what_a_batch_cannot_be():
    model = bert()
    tokens = ids()
    mask = torch.ones_like(tokens)
    for data, run in [([(tokens, mask)], None), ([{"input_ids": tokens}], None),
                      ([(tokens, "label")], lambda m, b: m(b[0]))]:
        _, report = tnspec.compress(copy.deepcopy(model), 0.5, data=data, run=run,
                                    include="encoder.*", shares=(0.5,), formats=("low_rank",))
        assert report.data
    before = snapshot(model)
    with pytest.raises(tnspec.SpecError, match=r"(?s)does not take a batch of data= as "
                                               r"model\(\*batch\).*run=lambda model, batch"):
        tnspec.compress(model, 0.5, data=[(tokens, mask, mask, mask, mask, mask, mask, mask,
                                           mask, 1)])
    assert unchanged(before, model)  # hooks gone, modes restored, nothing replaced
    with pytest.raises(tnspec.SpecError, match="a batch of data= is a str"):
        tnspec.compress(copy.deepcopy(model), 0.5, data=["some text"])
    with pytest.raises(tnspec.SpecError, match="run= needs data="):
        tnspec.compress(copy.deepcopy(model), 0.5, run=lambda m, b: m(b))


def test_adapt_bert_with_a_head_trained_in_full():
    pretrained = bert(labels=2)
    model, report = tnspec.adapt(copy.deepcopy(pretrained), "cp", rank=2,
                                 modules_to_save=["classifier"])
    assert report.saved == (("classifier", 66),)
    assert "classifier: trained in full (66 parameters" in str(report)
    assert isinstance(model.classifier, tnspec.Saved)
    assert "classifier" not in {a.name for a in report.adapted}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"classifier.copies.default.weight", "classifier.copies.default.bias"} <= trainable
    assert not any(n.startswith("classifier.original") for n in trainable)
    batch = {"input_ids": ids(), "labels": torch.tensor([0, 1, 1])}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(2):
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    assert not torch.equal(model.classifier.copies.default.weight,
                           pretrained.classifier.weight)
    assert torch.equal(model.classifier.original.weight, pretrained.classifier.weight)
    assert model.classifier.out_features == 2  # attributes read from the module it runs
    tokens = ids()
    want = logits(model, tokens)
    with tnspec.disable_adapters(model):
        torch.testing.assert_close(logits(model, tokens), logits(pretrained, tokens))
    state, config = tnspec.adapter_state_dict(model), tnspec.adapter_config(model)
    assert "classifier.copies.default.weight" in state and config["saved"] == {
        "classifier": {"active": "default", "copies": ["default"]}}
    again = tnspec.load_adapters(copy.deepcopy(pretrained), state, config)
    torch.testing.assert_close(logits(again, tokens), want, rtol=0, atol=0)
    merged = tnspec.merge_adapters(model)
    assert isinstance(merged.classifier, nn.Linear)
    torch.testing.assert_close(logits(merged, tokens), want, rtol=1e-5, atol=1e-5)


def test_modules_to_save_that_selects_nothing_changes_nothing():
    model = bert(labels=2)
    before = snapshot(model)  # structure, values, requires_grad, ties
    with pytest.raises(tnspec.SpecError, match=r"modules_to_save=\['head'\] selects no module"):
        tnspec.adapt(model, "cp", rank=2, modules_to_save=["head"])
    assert unchanged(before, model)


def test_register_peft_adapts_gpt2s_conv1d():
    peft = pytest.importorskip("peft")
    pretrained = gpt2()
    config = tnspec.register_peft(peft.LoraConfig(r=2, target_modules=["c_attn", "c_fc"]),
                                  "tt")
    model = peft.get_peft_model(copy.deepcopy(pretrained), config)
    tokens = ids()
    assert torch.equal(logits(model, tokens), logits(pretrained, tokens))
    nudge(model)
    want = logits(model, tokens)
    merged = model.merge_and_unload()
    assert isinstance(merged.transformer.h[0].attn.c_attn, Conv1D)
    torch.testing.assert_close(logits(merged, tokens), want, rtol=1e-4, atol=1e-4)


def test_a_tied_embedding_and_head_share_one_tensorized_table():
    model = gpt2()
    tokens = ids()
    want = logits(model, tokens)
    model, report = tnspec.tensorize(model, "tt", rank=0.9, weights="fit",
                                     include=["transformer.wte", "lm_head"])
    assert [r.name for r in report.replaced] == ["transformer.wte", "lm_head"]
    assert "lm_head: Linear(in_features=32, out_features=64, bias=False)\n      2,048 -> 0 " \
        "params, reads the table of 'transformer.wte' (tied)" in str(report)
    head, table = model.lm_head, model.transformer.wte
    assert isinstance(head, tnspec.TiedHead) and head.table is table
    x = torch.randn(2, 32)
    torch.testing.assert_close(head(x), x @ table.dense_weight().T)  # the same cores
    out = model(tokens).logits
    cos = nn.functional.cosine_similarity(out.flatten(), want.flatten(), dim=0)
    assert cos > 0.5  # fitted at 90% of a random table's parameters
    out.square().mean().backward()  # the head's gradient reaches the embedding's cores
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in table.parameters())
    # a head whose embedding cannot be replaced stays, tied
    model = gpt2()
    model, report = tnspec.tensorize(model, "low_rank", include=["transformer.wte", "lm_head"])
    assert not report.replaced and tied(model)
    assert dict(report.skipped)["lm_head"] == "tied to 'transformer.wte', which stays as it is"


def test_a_saved_module_pickles_and_forwards_only_what_it_lacks():
    import pickle
    saved = tnspec.Saved(nn.Linear(3, 2))
    saved.add("a")
    saved.active = "a"
    again = pickle.loads(pickle.dumps(saved))
    assert again.out_features == 2 and again.active == "a" and again.running() is \
        again.copies["a"]
    with pytest.raises(AttributeError):
        again.no_such_attribute
