"""Index inputs (``x[b] in (v0 v1 v2)``): tensorized embeddings against ``F.embedding`` and
``F.embedding_bag`` of the layer's own dense table, their init, errors and workflows."""

import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tnspec
from tnspec.emit import runtime

from ..model_state import snapshot, unchanged

FORMATS = ["tt", "tr", "cp", "tucker"]
SHAPES = [(37,), (4, 9), (2, 3, 5), ()]


def _grads(module, idx, g):
    module.zero_grad()
    (module(idx) * g).sum().backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("vocab", [300, 20000])  # fewer and more rows than lookups
def test_equals_f_embedding_of_dense_table_with_gradients(fmt, shape, vocab):
    torch.manual_seed(0)
    emb = tnspec.embedding(fmt, vocab, 24, rank=4, dtype=torch.float64)
    idx = torch.randint(0, vocab, shape)
    y = emb(idx)
    assert y.shape == (*shape, 24)
    torch.testing.assert_close(y, F.embedding(idx, emb.dense_weight()))
    g = torch.randn(*shape, 24, dtype=torch.float64)
    ours = _grads(emb, idx, g)
    emb.zero_grad()
    (F.embedding(idx, emb.dense_weight()) * g).sum().backward()
    for name, p in emb.named_parameters():
        torch.testing.assert_close(ours[name], p.grad)


def test_spec_with_two_lookup_axes_and_a_bias():
    spec = "x[b, s] in (v0 v1), A[v0, d0, r], B[r, v1, d1] -> y[b, s, (d0 d1)]"
    layer = tnspec.layer(spec, v0=6, v1=7, d0=2, d1=3, r=4, bias=True)
    assert layer.bias is not None and layer.num_embeddings == 42 and layer.embedding_dim == 6
    with torch.no_grad():
        layer.bias.normal_()
    idx = torch.randint(0, 42, (3, 5))
    torch.testing.assert_close(layer(idx), F.embedding(idx, layer.dense_weight()) + layer.bias)
    with pytest.raises(ValueError, match="expected 2 axes of indices, got 1"):
        layer(torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("fmt", FORMATS)
def test_padding_idx_row_is_zero_and_gets_no_gradient(fmt):
    emb = tnspec.embedding(fmt, 100, 16, rank=3, padding_idx=-1)
    assert emb.padding_idx == 99
    idx = torch.tensor([99, 99, 3])
    y = emb(idx)
    assert not y[:2].any() and y[2].any()
    assert not emb.dense_weight()[99].any()
    emb(torch.tensor([99, 99])).sum().backward()
    assert all(not p.grad.any() for p in emb.parameters())


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_bag_modes_equal_f_embedding_bag(mode, padding_idx):
    torch.manual_seed(1)
    bag = tnspec.embedding_bag("tt", 50, 12, rank=3, mode=mode, padding_idx=padding_idx,
                               dtype=torch.float64)
    table = bag.dense_weight()
    rows = torch.randint(0, 50, (4, 6))
    rows[0, :3] = 2
    flat = torch.tensor([1, 2, 2, 7, 9, 2, 2, 40, 3])
    offsets = torch.tensor([0, 3, 3, 5])  # the second bag is empty
    cases = [((rows,), {}), ((flat, offsets), {})]
    if mode == "sum":
        cases.append(((flat, offsets), {"per_sample_weights": torch.rand(9, dtype=torch.float64)}))
    for args, kw in cases:
        want = F.embedding_bag(args[0], table, *args[1:], mode=mode, padding_idx=padding_idx,
                               **kw)
        torch.testing.assert_close(bag(*args, **kw), want)


def test_bag_rejects_what_embedding_bag_rejects():
    bag = tnspec.embedding_bag("cp", 50, 12, rank=3, mode="mean")
    with pytest.raises(ValueError, match="only for mode='sum'"):
        bag(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.ones(2))
    with pytest.raises(ValueError, match="needs 1-D offsets"):
        bag(torch.tensor([1, 2]))


def test_out_of_range_and_non_integer_indices_are_rejected():
    emb = tnspec.embedding("tt", 1000, 8, rank=2)
    with pytest.raises(IndexError, match=r"indices lie in \[0, 1000\), got 3..1000"):
        emb(torch.tensor([3, 1000]))
    with pytest.raises(IndexError, match=r"got -1..4"):
        emb(torch.tensor([-1, 4]))
    with pytest.raises(TypeError, match="expected integer indices, got torch.float32"):
        emb(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="expected integer indices, got torch.bool"):
        emb(torch.tensor([True]))


def test_vocabulary_smaller_than_the_modes_is_the_range():
    emb = tnspec.embedding("tt", 30522, 64, rank=4)  # modes 37 x 33 x 25 = 30525
    assert emb.num_embeddings == 30522 and emb.dense_weight().shape == (30522, 64)
    with pytest.raises(IndexError, match=r"\[0, 30522\)"):
        emb(torch.tensor([30522]))


@pytest.mark.parametrize("vocab", [1000, 998])  # 998: the modes (10, 10, 10) hold two more
def test_a_compiled_or_scripted_embedding_refuses_what_eager_refuses(vocab):
    """Traced, the bounds cannot be read without a graph break: an index outside the
    vocabulary is sent one past the table, which the gather refuses (a negative one would
    otherwise wrap around to a row, as Python indexing does)."""
    torch.manual_seed(0)
    emb = tnspec.embedding("tt", vocab, 8, rank=2, modes=((10, 10, 10), (2, 2, 2)))
    ids = torch.tensor([[0, 7, vocab - 1]])
    torch._dynamo.reset()
    compiled = torch.compile(emb)
    params = ", ".join(f"{k}={v}" for k, v in emb.sizes.items())
    text = f"layer emb({params}) {{\n  num_embeddings: {vocab}\n  {emb.spec}\n}}\n"
    generated = runtime.load_class(tnspec.generate(text), "Emb")()
    generated.load_state_dict(emb.state_dict())
    scripted = torch.jit.script(generated)
    torch.testing.assert_close(compiled(ids), emb(ids))
    torch.testing.assert_close(scripted(ids), emb(ids))
    for bad in (-1, -100, vocab, 999) if vocab < 1000 else (-1, -100, vocab):
        with pytest.raises((IndexError, RuntimeError)):
            emb(torch.tensor([[bad]]))
        with pytest.raises((IndexError, RuntimeError)):
            compiled(torch.tensor([[bad]]))
        with pytest.raises((IndexError, RuntimeError)):
            scripted(torch.tensor([[bad]]))
    for dtype in (torch.int32, torch.uint8):  # small integer ids as nn.Embedding takes them
        small = (ids % 250).to(dtype)
        torch.testing.assert_close(compiled(small), emb(ids % 250))
        torch.testing.assert_close(emb(small), emb(ids % 250))


@pytest.mark.parametrize("spec, match", [
    ("x[b] in (v w), A[v, d] -> y[b, d, w]", "index mode 'w' must be carried by a core"),
    ("x[b, i] in (v), A[v, i, d] -> y[b, d]", "axis i of the index input 'x' is not a lookup"),
    ("x[b] in v, A[v, d] -> y[d, b]", "must start with the axes of the index input"),
    ("x[b, h+kh-1] in v, A[v, kh, d] -> y[b, h, d]", "is not a lookup position"),
])
def test_spec_errors_are_located(spec, match):
    with pytest.raises(tnspec.SpecError, match=match) as info:
        tnspec.compile(spec, v=4, w=3, d=2, i=2, kh=3)
    assert "^" in str(info.value)


def test_syntax_error_after_in():
    with pytest.raises(tnspec.SpecError, match="line 1, column 9"):
        tnspec.compile("x[b] in [v], A[v, d] -> y[b, d]", v=3, d=2)


def test_graph_out_is_refused_for_an_index_input():
    with pytest.raises(tnspec.SpecError, match="an index input has none"):
        tnspec.embedding("tt", 100, 8, rank=2, init="graph-out")


@pytest.mark.parametrize("fmt", FORMATS)
def test_output_variance_starts_at_nn_embedding_s(fmt):
    """Graph-in for an index input: the rows' variance is nn.Embedding's N(0, 1) (median over
    seeds within 10%), and std= scales it."""
    ratios = []
    for seed in range(15):
        torch.manual_seed(seed)
        emb = tnspec.embedding(fmt, 8000, 64, rank=8)
        ratios.append(emb(torch.randint(0, 8000, (8192,))).var().item())
    assert abs(statistics.median(ratios) - 1) < 0.1
    torch.manual_seed(0)
    scaled = tnspec.embedding(fmt, 8000, 64, rank=8, std=0.1)
    assert 0.005 < scaled(torch.randint(0, 8000, (8192,))).var().item() < 0.02


@pytest.mark.parametrize("fmt", ["tt", "tr"])
def test_exact_recovery_of_a_table_of_that_format(fmt):
    torch.manual_seed(0)
    table = tnspec.embedding(fmt, 1000, 32, rank=3).dense_weight().detach()
    fitted = tnspec.embedding(fmt, 1000, 32, rank=3)
    assert fitted.fit_(table) < 1e-3
    torch.testing.assert_close(fitted.dense_weight(), table, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("rows", [10, 1001])
def test_fit_refuses_a_table_of_another_size_before_touching_the_cores(rows):
    emb = tnspec.embedding("tt", 1000, 8, rank=2)
    before = snapshot(emb)
    with pytest.raises(tnspec.SpecError, match=rf"fit_ takes the \(1000, 8\) table, got shape "
                       rf"\[{rows}, 8\]"):
        emb.fit_(torch.randn(rows, 8))
    assert unchanged(before, emb)


def test_tensorize_fit_and_merge_round_trip():
    torch.manual_seed(0)
    source = tnspec.embedding("tt", 400, 16, rank=3).dense_weight().detach()
    padded = source.clone()
    padded[0] = 0  # nn.Embedding's padding row; with it the table is not exactly TT rank 3
    model = nn.ModuleDict(dict(emb=nn.Embedding(400, 16, padding_idx=0, _weight=padded),
                               bag=nn.EmbeddingBag(400, 16, mode="max",
                                                   _weight=source.clone()),
                               head=nn.Linear(16, 4)))
    model, report = tnspec.tensorize(model, "tt", rank=3, weights="fit", include="emb")
    assert isinstance(model["emb"], tnspec.Layer) and isinstance(model["bag"], nn.EmbeddingBag)
    assert report.replaced[0].fit_error < 0.05
    model, report = tnspec.tensorize(model, "tt", rank=3, weights="fit", include="bag")
    assert report.replaced[0].fit_error < 1e-3
    assert isinstance(model["bag"], tnspec.EmbeddingBag)
    idx = torch.randint(0, 400, (5, 7))
    before = model["emb"](idx), model["bag"](idx)
    merged = tnspec.merge(model)
    assert type(merged["emb"]) is nn.Embedding and merged["emb"].padding_idx == 0
    assert type(merged["bag"]) is nn.EmbeddingBag and merged["bag"].mode == "max"
    torch.testing.assert_close(merged["emb"](idx), before[0])
    torch.testing.assert_close(merged["bag"](idx), before[1])


def test_tensorize_keeps_an_embedding_tied_to_its_head():
    emb, head = nn.Embedding(100, 8), nn.Linear(8, 100, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    _, report = tnspec.tensorize(model, "tt", rank=2)
    assert isinstance(model[1], tnspec.TiedHead) and model[1].table is model[0]
    assert not report.skipped
    # tied to another module as well: left alone, the tie kept
    emb, head, other = nn.Embedding(100, 8), nn.Linear(8, 100, bias=False), nn.Embedding(100, 8)
    head.weight = other.weight = emb.weight
    model = nn.Sequential(emb, head, other)
    _, report = tnspec.tensorize(model, "tt", rank=2)
    assert type(model[0]) is nn.Embedding and model[1].weight is model[0].weight
    assert any(name == "0" for name, _ in report.skipped)


def test_merge_gives_a_tied_head_back_as_a_linear_tied_to_the_merged_table():
    emb, head = nn.Embedding(100, 8), nn.Linear(8, 100, bias=True)
    head.weight = emb.weight
    model = nn.Sequential(emb, nn.Tanh(), head)
    tnspec.tensorize(model, "tt", rank=2)
    with torch.no_grad():
        model[2].bias.normal_()
    idx = torch.randint(0, 100, (4, 3))
    want = model(idx)
    merged = tnspec.merge(model)
    assert type(merged[0]) is nn.Embedding and type(merged[2]) is nn.Linear
    assert merged[2].weight is merged[0].weight
    torch.testing.assert_close(merged(idx), want)


def test_merge_that_raises_leaves_the_model_as_it_was():
    """merge builds every dense module before it sets one: a layer it cannot merge (an
    embedding with a bias) stops it before the layers named earlier were replaced."""
    lin = tnspec.formats.cp(8, 8, (), rank=2).layer()
    emb = tnspec.layer("x[b] in (v0 v1), A[v0, d0, r], B[v1, d1, r] -> y[b, (d0 d1)]",
                       v0=3, v1=4, d0=2, d1=2, r=2, bias=True)
    model = nn.ModuleDict({"a": lin, "b": emb})
    before = snapshot(model)
    with pytest.raises(tnspec.SpecError, match="an embedding with a bias has no nn.Embedding"):
        tnspec.merge(model)
    assert unchanged(before, model) and model["a"] is lin


def test_generated_module_equals_inline_and_scripts_and_exports(tmp_path):
    text = ("layer emb(v0=8, v1=9, v2=10, d0=2, d1=3, d2=4, r=3, q=2) {\n  padding_idx: 5\n"
            "  x[b] in (v0 v1 v2), A[v0, d0, r], B[r, v1, d1, q], C[q, v2, d2] "
            "-> y[b, (d0 d1 d2)]\n}\n")
    inline = tnspec.layer(text)
    source = tnspec.generate(text)
    cls = runtime.load_class(source, "Emb")
    generated = cls()
    generated.load_state_dict(inline.state_dict())
    assert generated.num_embeddings == 720 and generated.padding_idx == 5
    idx = torch.randint(0, 720, (6, 11))
    idx[0, 0] = 5
    torch.testing.assert_close(generated(idx), inline(idx))
    assert not generated(idx)[0, 0].any()
    scripted = torch.jit.script(generated)
    torch.testing.assert_close(scripted(idx), inline(idx))
    exported = torch.export.export(generated, (idx,))
    torch.testing.assert_close(exported.module()(idx), inline(idx))
    assert "index_select" in inline.source((6, 11))


def test_lookup_plan_builds_the_table_only_when_lookups_outnumber_rows():
    emb = tnspec.embedding("tt", 10**6, 64, rank=8)
    few = emb.plan((4096,))
    assert len(few.runs) > 1 and "gather (v0)" in few.report()
    small = tnspec.embedding("tt", 1000, 64, rank=8)
    assert len(small.plan((4096,)).runs) == 1


def test_embedding_format_checks_its_arguments():
    with pytest.raises(tnspec.SpecError, match="tucker2 has no embedding form: an "
                                               "embedding's formats are tt, tr, cp, tucker"):
        tnspec.embedding("tucker2", 100, 8)
    with pytest.raises(tnspec.SpecError, match="unknown embedding format 'bogus'"):
        tnspec.embedding("bogus", 100, 8)
    with pytest.raises(tnspec.SpecError, match="padding_idx=100 is not an index"):
        tnspec.embedding("tt", 100, 8, padding_idx=100)
    with pytest.raises(tnspec.SpecError, match="do not fit"):
        tnspec.embedding("tt", 100, 8, modes=((4, 4), (2, 4)))
    budget = tnspec.embedding("tt", 10000, 64, rank=0.05)
    assert sum(p.numel() for p in budget.parameters()) <= 0.05 * 10000 * 64


def test_first_call_log_names_the_index_shape_not_the_one_hot_axis(caplog):
    emb = tnspec.embedding("tt", 1000, 16, rank=2)
    with caplog.at_level("DEBUG", logger="tnspec"):
        emb(torch.randint(0, 1000, (3, 7)))
    said = [r.getMessage() for r in caplog.records if "first call took" in r.getMessage()]
    assert said and "for [21] indices: first call took" in said[0], said
