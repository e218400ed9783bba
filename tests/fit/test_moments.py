"""The metric factor of a wide moment: its leading directions by subspace iteration."""

import torch
import torch.nn.functional as F

from tnspec.fit import moments


def _patches() -> torch.Tensor:
    """A conv's patches, 2,048 wide (64 channels x 32 taps), of correlated channels: random
    signals through a random 1-D conv and a ReLU, as a pitch tracker's second conv reads them."""
    gen = torch.Generator().manual_seed(0)
    signal = torch.randn(8, 16, 1100, generator=gen)
    x = F.relu(F.conv1d(signal, torch.randn(64, 16, 9, generator=gen) / 12))
    return moments.patches(x, (32,), (1,), (16,), (1,))


def test_a_wide_moments_leading_directions_carry_what_the_exact_ones_do():
    rows = _patches()
    assert rows.shape == (8 * 1093, 2048)  # 1,092 samples a signal, padded by 16
    state = torch.get_rng_state()
    metric = moments.factor(rows)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(metric, moments.factor(rows))  # the same every call
    assert metric.shape == (1, 2048, moments.MAX_RANK) and metric.dtype == torch.float64
    block = rows.double()
    moment = block.T @ block / len(block)
    values, vectors = torch.linalg.eigh(moment)
    exact = vectors[:, -moments.MAX_RANK:]
    basis = torch.linalg.qr(metric[0]).Q
    # the energy of the moment in the subspace kept, against the exact leading subspace's
    captured = torch.trace(basis.T @ moment @ basis) / values[-moments.MAX_RANK:].sum()
    assert 0.995 < captured <= 1 + 1e-9
    # in that subspace L L^T is the moment
    inside = exact.T @ (metric[0] @ metric[0].T) @ exact
    assert torch.allclose(inside.diagonal()[-64:], values[-64:], rtol=1e-3)
    # the best rank-512 approximation's error, within a few percent
    best = torch.linalg.norm(moment - exact * values[-moments.MAX_RANK:] @ exact.T)
    assert torch.linalg.norm(moment - metric[0] @ metric[0].T) < 1.1 * best
    # rows in float64 (as the sequential refits pass them) take the same path, summed in float64
    double = moments.factor(rows.double())
    assert double.shape == metric.shape
    assert torch.linalg.norm(double[0] @ double[0].T - metric[0] @ metric[0].T) < 1e-4 * best


def test_a_moment_no_wider_than_four_times_the_rank_kept_is_decomposed_exactly():
    rows = _patches()[:, :1024]
    metric = moments.factor(rows, max_rank=512)  # 1,024 < 4 x 512: the full eigh
    block = rows.double()
    values, vectors = torch.linalg.eigh(block.T @ block / len(block))
    exact = vectors[:, -512:] * values[-512:].sqrt()
    assert torch.allclose(metric[0] @ metric[0].T, exact @ exact.T, atol=1e-10)
    few = moments.factor(rows[:300].repeat(1, 4), max_rank=512)  # 300 rows: every direction
    assert few.shape[2] <= 300
    small = rows[:300].repeat(1, 4).double()
    assert torch.allclose(few[0] @ few[0].T, small.T @ small / 300, atol=1e-9)


def test_a_wide_moment_of_low_rank_keeps_only_the_directions_the_data_has():
    """A moment summed in float32 has rounding of about 1e-7 of its largest eigenvalue in
    every direction: those are not kept as directions of the data (they were: 335 of them
    beside the 100 real ones, each a column every fit then carries)."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(5000, 100, generator=gen) @ torch.randn(100, 2048, generator=gen)
    metric = moments.factor(rows)
    assert metric.shape == (1, 2048, 100)
    block = rows.double()
    assert torch.allclose(metric[0] @ metric[0].T, block.T @ block / len(block),
                          rtol=1e-4, atol=1e-4 * float(block.square().mean()))
