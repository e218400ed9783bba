"""Stage 4, plan: each step's op and axis split are decided here, and the report shows them."""

from __future__ import annotations

import math

import pytest
import torch

import tnspec
from tnspec import formats
from tnspec.planning import paths
from tnspec.planning import problem as problem_module
from tnspec.planning.plan import PLANNERS, Problem, Split, plan
from tnspec.shapes import bind_shape

HTK2 = ("x[b, c, h+kh-1, w+kw-1], U[c, r0, phi], G[r0, r1, kh, kw, phi], V[r1, o, phi]"
        " -> y[b, o, h, w]")


def planned(text: str, shape, planner: str = "auto", **sizes):
    return plan(bind_shape(tnspec.compile(text, **sizes), shape), planner)


def test_left_to_right_htk2_is_mix_conv_mix_with_their_axis_splits():
    p = planned(HTK2, (8, 64, 32, 32), "left-to-right", c=64, o=64, r0=10, r1=10, kh=3,
                kw=3, phi=4)
    assert [s.op for s in p.steps] == ["conv1x1", "conv", "conv1x1"]
    first, conv, last = p.steps
    assert first.split == Split(batch=("b",), inputs=("c",), outputs=("r0", "phi"),
                                spatial=("h+kh-1", "w+kw-1"))
    assert conv.split == Split(batch=("b",), groups=("phi",), inputs=("r0",), outputs=("r1",),
                               spatial=("h+kh-1", "w+kw-1"))
    assert [c.text for c in conv.convs] == ["h+kh-1", "w+kw-1"]
    assert last.split.groups == () and last.split.inputs == ("phi", "r1")
    assert last.result.indices == ("b", "o", "h", "w")  # the data never moves


def test_linear_step_and_einsum_among_cores():
    p = planned("x[b, i], A[i, r], B[r, o] -> y[b, o]", (4, 8), "left-to-right", i=8, r=2,
                o=3)
    assert [s.op for s in p.steps] == ["linear", "linear"]
    assert p.steps[0].split == Split(batch=("b",), inputs=("i",), outputs=("r",))
    p = planned("x[b, i], A[i, r], B[r, o] -> y[b, o]", (4, 8), "dense-first", i=8, r=2, o=3)
    assert [s.op for s in p.steps] == ["einsum", "linear"] and p.steps[0].split == Split()


def test_report_names_each_steps_op():
    p = planned(HTK2, (8, 64, 32, 32), "left-to-right", c=64, o=64, r0=10, r1=10, kh=3, kw=3,
                phi=4)
    rows = p.report().splitlines()
    assert rows[1] == ("  for an input x of shape [8, 64, 32, 32] (b=8, h+kh-1=32, w+kw-1=32); "
                       "another shape may be planned differently")
    assert rows[3].split()[:2] == ["step", "op"]
    assert [r.split()[1] for r in rows[4:]] == ["conv1x1", "conv", "conv1x1"]


# ---- guards: every tensor of the forward pass, in bytes, at the batch of the call ----------


def test_a_huge_padding_is_refused_before_anything_is_allocated():
    text = "x[b, c, {p}*h+k-{p}], W[c, k] -> y[b, h]"
    layer = tnspec.layer(text.format(p=3_000_000_000), c=2, k=3)
    with pytest.raises(tnspec.SpecError, match=r"the padded input x would take 44.7 GiB "
                       r"\(12,000,000,010 elements at the batch b=1\), more than the limit of "
                       r"8.0 GiB"):
        layer(torch.randn(1, 2, 5))
    small = tnspec.layer(text.format(p=1000), c=2, k=3, max_bytes=2**16)
    assert small(torch.randn(1, 2, 5)).shape == (1, 3)
    with pytest.raises(tnspec.SpecError, match="the padded input x would take"):
        small(torch.randn(20, 2, 5))  # the same layer, a larger batch


def clique(n: int) -> tuple[str, dict[str, int]]:
    """``n`` cores, a rank-2 edge between every two of them."""
    cores: list[list[str]] = [[] for _ in range(n)]
    sizes = {"i": 16, "o": 16}
    for a in range(n):
        for b in range(a + 1, n):
            cores[a].append(f"r{a}_{b}")
            cores[b].append(f"r{a}_{b}")
            sizes[f"r{a}_{b}"] = 2
    cores[0].insert(0, "i")
    cores[-1].append("o")
    ops = ", ".join(f"V{k}[{', '.join(c)}]" for k, c in enumerate(cores))
    return f"x[b, i], {ops} -> y[b, o]", sizes


def test_an_intermediate_too_large_for_max_bytes_is_refused_at_any_batch():
    text, sizes = clique(11)  # 42k parameters; any order has a 2^30-element intermediate
    with pytest.raises(tnspec.SpecError, match=r"would take 4.0 GiB .* more than the limit of "
                       r"2.0 GiB"):
        tnspec.layer(text, sizes=sizes, max_bytes=2**31)(torch.randn(4, 16))


def test_the_guard_counts_bytes_of_the_parameters_dtype():
    text = "x[b, c], W[c, o] -> y[b, o]"
    assert tnspec.layer(text, c=4, o=4, max_bytes=32 * 4)(torch.randn(8, 4)).shape == (8, 4)
    layer = tnspec.layer(text, c=4, o=4, max_bytes=32 * 4, dtype=torch.double)
    with pytest.raises(tnspec.SpecError, match=r"256 bytes \(32 elements at the batch b=8\)"):
        layer(torch.randn(8, 4, dtype=torch.double))


@pytest.mark.parametrize("autotune", [False, True])
@pytest.mark.parametrize("text, sizes, dense", [
    ("x[b, c, h+kh-1, w+kw-1], W[o, c, kh, kw] -> y[b, o, h, w]", dict(c=2, o=3, kh=3, kw=3),
     lambda: torch.nn.Conv2d(2, 3, 3, padding=1)),
    ("x[b, c], A[c, r], B[r, o] -> y[b, o]", dict(c=2, r=2, o=3), lambda: torch.nn.Linear(2, 3)),
])
def test_an_empty_batch_gives_an_empty_output_as_torch_does(text, sizes, dense, autotune):
    layer = tnspec.layer(text, autotune=autotune, **sizes)
    x = torch.randn(0, 2, 5, 5) if "h" in text else torch.randn(0, 2)
    y = layer(x)
    assert y.shape == dense()(x).shape
    y.sum().backward()


# ---- the search ------------------------------------------------------------------------------

RANDOM = [formats.random(seed, vertices=(3, 6)) for seed in range(16)]


@pytest.mark.parametrize("fmt", RANDOM, ids=[f"random{n}" for n in range(len(RANDOM))])
def test_dp_finds_the_order_opt_einsums_dp_finds(fmt):
    net = fmt.layer().network
    channels = math.prod(net.sizes[i] for i in net.input.axes[1])
    problem = Problem(bind_shape(net, (8, channels, 12, 12)))
    ours, theirs = (problem.replay(PLANNERS[name](problem)) for name in ("dp", "opt-dp"))
    assert sum(s.seconds for s in ours) == pytest.approx(sum(s.seconds for s in theirs),
                                                         rel=1e-9)


def test_more_indices_than_an_int64_holds_plan_as_python_ints(monkeypatch):
    net = bind_shape(tnspec.compile(HTK2, c=64, o=64, r0=10, r1=10, kh=3, kw=3, phi=4),
                     (8, 64, 32, 32))
    fast = plan(net, "dp")
    monkeypatch.setattr(problem_module, "INT64_BITS", 0)
    assert Problem(net).dtype is object
    slow = plan(net, "dp")
    assert slow.steps == fast.steps


def test_a_network_that_needs_an_outer_product_is_planned():
    layer = tnspec.layer("x[b, c], A[c, o], S[q] -> y[b, o, q]", c=4, o=3, q=2)
    x = torch.randn(5, 4)
    expected = torch.einsum("bc,co,q->boq", x, layer.A, layer.S)
    torch.testing.assert_close(layer(x), expected)
    assert [str(s.right) for s in layer.plan((5, 4)).steps] == ["A[c, o]", "S[q]"]


def test_dense_first_builds_the_kernel_in_the_cheapest_order_among_cores():
    """Walking a ring core by core makes intermediates that carry both ends of the ring
    (53 MFLOPs here); dense-first contracts the cores in their cheapest order, then runs
    one step with the data."""
    ring = ("x[b, (c0 c1 c2), h+kh-1, w+kw-1], A0[r0, c0, r1], A1[r1, c1, r2], "
            "A2[r2, c2, r3], K[r3, kh, kw, r4], B0[r4, o0, r5], B1[r5, o1, r6], B2[r6, o2, r0] "
            "-> y[b, (o0 o1 o2), h, w]")
    sizes = dict(c0=4, c1=4, c2=6, o0=4, o1=4, o2=6, kh=3, kw=3,
                 **{f"r{i}": 10 for i in range(7)})
    p = planned(ring, (2, 96, 10, 10), "dense-first", **sizes)
    assert [s.data_side for s in p.steps] == [False] * 6 + [True]
    among_cores = sum(s.flops for s in p.steps if not s.data_side)
    assert among_cores < 20_000_000, among_cores


def _chain(n: int) -> tuple[str, dict[str, int]]:
    cores = ["A0[i, r1]"] + [f"A{k}[r{k}, r{k + 1}]" for k in range(1, n - 1)] + \
        [f"A{n - 1}[r{n - 1}, o]"]
    return "x[b, i], " + ", ".join(cores) + " -> y[b, o]", {f"r{k}": 3 for k in range(1, n)}


@pytest.mark.parametrize("n", [15, 40])
def test_a_long_chain_plans_without_the_exact_search(n, monkeypatch):
    """Past DP_LIMIT operands auto's dense-first candidate ran the exact DP over the cores
    anyway: 3^n-entry tables (a 15-core chain took about a minute and 4 GB; from about 40
    cores numpy refused). Now no planner of auto's builds those tables."""
    real = paths._splits

    def guarded(k: int):
        assert k <= paths.DP_LIMIT, f"an exact table over {k} operands"
        return real(k)
    monkeypatch.setattr(paths, "_splits", guarded)
    spec, sizes = _chain(n)
    layer = tnspec.layer(spec, i=8, o=8, autotune=False, sizes=sizes)
    x = torch.randn(2, 8)
    dense = layer.dense_weight().detach()
    torch.testing.assert_close(layer(x), x @ dense.T + layer.bias, rtol=1e-4, atol=1e-5)
    for name in ("dense-first", "greedy"):
        assert len(layer.plan((2, 8)).steps) == n
        tnspec.layer(spec, i=8, o=8, planner=name, autotune=False, sizes=sizes)(x)


def test_an_explicit_exact_search_over_too_many_operands_is_refused():
    spec, sizes = _chain(paths.DP_MAX)  # DP_MAX cores and the data
    layer = tnspec.layer(spec, i=8, o=8, planner="dp", autotune=False, sizes=sizes)
    with pytest.raises(tnspec.SpecError, match=r"planner 'dp' is an exact search over 3\^n "
                                               r"merges: 15 operands are too many"):
        layer(torch.randn(2, 8))


def test_max_bytes_holds_for_every_batch_of_a_size_class():
    """Batches within a factor of two share a plan; the byte guard ran only when a class was
    first planned, so after a call at batch 200, batch 360 ran unchecked although a fresh
    layer refuses it."""
    limit = 1000 * 4 * 300  # 300 rows of float32
    layer = tnspec.layer("x[b, i], W[i, o] -> y[b, o]", i=1000, o=1000, max_bytes=limit,
                         autotune=False)
    layer(torch.randn(200, 1000))
    fresh = tnspec.layer("x[b, i], W[i, o] -> y[b, o]", i=1000, o=1000, max_bytes=limit,
                         autotune=False)
    for model in (fresh, layer):
        with pytest.raises(tnspec.SpecError, match=r"360,000 elements at the batch b=360"):
            model(torch.randn(360, 1000))
    assert layer(torch.randn(250, 1000)).shape == (250, 1000)  # within the limit: runs


@pytest.mark.parametrize("n", [10, 11])
@pytest.mark.parametrize("lookups", [4, 4096])
def test_a_lookup_over_many_modes_prices_few_cuts_and_finds_the_best(n, lookups, monkeypatch):
    """2^(n-1) cuts of n vocabulary modes took ~100 s at 14 modes; past 9 modes the cuts of at
    most three runs (and one run per mode) are priced, and the cheapest of them is priced
    within 1% of the cheapest of all (where they differ, they are near-ties)."""
    from tnspec.planning import lookup
    from tnspec.planning.cost import CostModel
    emb = tnspec.embedding("tt", 2 ** n, 8, rank=2, modes=((2,) * n, (2, 2, 2) + (1,) * (n - 3)))
    net = bind_shape(emb.network, (lookups, 2 ** n))
    few = lookup.lookup_candidates(net)
    assert len(lookup._cuts(n)) == 1 + (n - 1) + (n - 1) * (n - 2) // 2 + 1 < 2 ** (n - 1)
    monkeypatch.setattr(lookup, "ALL_CUTS", 2 ** n)
    every = lookup.lookup_candidates(net)
    assert len(every) > len(few)
    price = [CostModel().einsum(c.flops // 2, c.elements) for c in (few[0], every[0])]
    assert price[1] <= price[0] <= 1.01 * price[1]
    assert len(lookup._cuts(9)) == 256  # every cut while they are few
