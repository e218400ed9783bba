"""The workflows on real checkpoints and data, a small slice of each (seconds): all-MiniLM-L6-v2
with Rotten Tomatoes snippets, torchvision's ImageNet MobileNetV2 with Fashion-MNIST. Each test
skips where its asset is not installed (``bash .ci/run`` installs them all)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tnspec
from experiments import assets


def need(load, *args):
    try:
        return load(*args)
    except assets.Missing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def minilm():
    return need(assets.minilm)


@pytest.fixture(scope="module")
def snippets():
    texts, labels = need(assets.rotten_tomatoes)
    return texts, labels


def pooled(model: nn.Module, batch: dict) -> torch.Tensor:
    """Mean-pooled sentence embeddings (as sentence-transformers pools MiniLM's)."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden)
    return (hidden * mask).sum(1) / mask.sum(1)


def test_rotten_tomatoes_and_fashion_mnist_are_the_real_data(snippets):
    texts, labels = snippets
    assert len(texts) == 12_808 and int(labels.sum()) == 7_403  # fresh; 5,405 rotten
    images, classes = need(assets.fashion_mnist, "test", 100)
    assert images.shape == (100, 28, 28) and images.dtype == torch.uint8
    assert set(classes.tolist()) == set(range(10))


def test_compress_one_minilm_layer_with_its_tokenized_batches(minilm, snippets):
    model, tokenizer = minilm
    texts, _ = snippets
    batches = [dict(tokenizer(texts[i:i + 16], padding=True, return_tensors="pt"))
               for i in range(0, 48, 16)]
    want = torch.cat([pooled(model, b) for b in batches])
    small, report = tnspec.compress(copy.deepcopy(model), 0.5, data=batches,
                                    include="encoder.layer.0.*", formats=("low_rank", "tt"),
                                    shares=(0.25, 0.5, 0.75))
    assert len(report.choices) == 6 and report.params_after <= 0.5 * report.params_before
    assert {c.chosen.format for c in report.choices} <= {"low_rank", "tt", "dense"}
    got = torch.cat([pooled(small, b) for b in batches])
    cosine = nn.functional.cosine_similarity(got, want).mean()
    assert cosine > 0.97
    assert "left alone 1 x Embedding" not in str(report)  # include= left the rest unseen
    # the layers' inputs as the batches reached them: a whitened fit beats the plain SVD
    plain, _ = tnspec.compress(copy.deepcopy(model), 0.5, include="encoder.layer.0.*",
                               formats=("low_rank",), shares=(0.25, 0.5, 0.75))
    weight_only = torch.cat([pooled(plain, b) for b in batches])
    assert cosine > nn.functional.cosine_similarity(weight_only, want).mean()


@pytest.mark.parametrize("fmt, rule", [("tt", None), ("tr", "spectral")])
def test_adapt_minilm_trains_and_merges(minilm, snippets, fmt, rule):
    model, tokenizer = minilm
    texts, labels = snippets
    adapted, report = tnspec.adapt(copy.deepcopy(model), fmt, rank=4,
                                   include="encoder.layer.5.*", step_rule=rule)
    assert len(report.adapted) == 6
    batch = dict(tokenizer(texts[:8], padding=True, return_tensors="pt"))
    assert torch.equal(pooled(adapted, batch), pooled(model, batch))
    head = nn.Linear(384, 2)
    opt = torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad] +
                            list(head.parameters()), lr=1e-2)
    for _ in range(2):
        hidden = adapted(**batch).last_hidden_state[:, 0]
        loss = nn.functional.cross_entropy(head(hidden), labels[:8])
        opt.zero_grad()
        loss.backward()
        opt.step()
    want = pooled(adapted, batch)
    assert not torch.allclose(want, pooled(model, batch))
    merged = tnspec.merge_adapters(adapted)
    torch.testing.assert_close(pooled(merged, batch), want, rtol=1e-4, atol=1e-4)


def test_mobilenet_v2_loads_imagenet_weights_and_compresses_its_1x1_convs():
    from experiments.models import mobilenet
    weights = need(assets.mobilenet_weights)
    model = mobilenet.MobileNetV2()
    assert set(model.state_dict()) == set(weights)  # torchvision's names, every one
    model.load_state_dict(weights)
    model.eval()
    images, _ = need(assets.fashion_mnist, "test", 16)
    x = mobilenet.fashion_inputs(images, size=64)
    with torch.no_grad():
        want = model.embed(x)

    def last(name: str, m: nn.Module) -> bool:
        return name.startswith("features.17") and m.kernel_size == (1, 1)
    small, report = tnspec.compress(copy.deepcopy(model), 0.5, data=[x[:8], x[8:]],
                                    include=last, formats=("low_rank", "tucker2"),
                                    shares=(0.25, 0.5))
    assert [c.name for c in report.choices] == ["features.17.conv.0.0", "features.17.conv.2"]
    with torch.no_grad():
        got = small.embed(x)
    assert nn.functional.cosine_similarity(got, want).mean() > 0.95


def test_tensorize_merge_and_audit_minilm(minilm, snippets):
    model, tokenizer = minilm
    texts, _ = snippets
    batch = dict(tokenizer(texts[:4], padding=True, return_tensors="pt"))
    want = pooled(model, batch)
    small, report = tnspec.tensorize(copy.deepcopy(model), "low_rank", rank=0.75,
                                     weights="fit", include="encoder.layer.0.*")
    assert len(report.replaced) == 6
    assert {r.activation for r in report.replaced
            if r.name.endswith("intermediate.dense")} == {"gelu"}  # GELUActivation, read
    got = pooled(small, batch)
    assert nn.functional.cosine_similarity(got, want).mean() > 0.9
    merged = tnspec.merge(small)
    assert isinstance(merged.encoder.layer[0].intermediate.dense, nn.Linear)
    torch.testing.assert_close(pooled(merged, batch), got, rtol=1e-4, atol=1e-4)
    rows = {r["name"]: r for r in tnspec.audit(model, batch).rows}
    assert rows["encoder.layer.0.intermediate.dense"]["backward"] > 0
