"""Tensorized embeddings, forward + backward, against nn.Embedding and TensorLy-Torch.

    python benchmarks/embedding.py            # the table in RESULTS.md ("Embeddings")
    python benchmarks/embedding.py --quick    # two small cases, a few rounds

For each case (vocabulary, dimension, lookups): ``nn.Embedding`` with dense gradients (the
baseline, 1.00), with sparse gradients, TensorLy-Torch's ``FactorizedEmbedding`` (blocktt,
rank 16) and ``tnspec.embedding("tt", ...)`` at the largest rank with at most the parameters of
TensorLy-Torch's (same three modes each side). Times are medians of interleaved rounds, each a
forward and a backward to the parameters with a dense output gradient drawn beforehand. The
output variance at init is printed too (nn.Embedding: 1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, machine, steady_malloc  # noqa: E402

import tnspec  # noqa: E402

CASES = [(10_000, 64, 4096), (100_000, 128, 4096), (100_000, 128, 65536),
         (1_000_000, 128, 16384), (1_000_000, 512, 4096)]
QUICK = [(10_000, 64, 4096), (100_000, 128, 4096)]


def step(module: nn.Module, idx: torch.Tensor, grad: torch.Tensor):
    params = [p for p in module.parameters() if p.requires_grad]

    def run() -> None:
        torch.autograd.grad(module(idx), params, grad)
    return run


def tnspec_like(tlt: nn.Module, vocab: int, dim: int) -> nn.Module:
    """tnspec's TT embedding with at most the parameters of ``tlt`` (largest such rank)."""
    budget = sum(p.numel() for p in tlt.parameters())
    rank = 1
    while sum(p.numel() for p in tnspec.embedding("tt", vocab, dim, rank=rank + 1)
              .parameters()) <= budget:
        rank += 1
    return tnspec.embedding("tt", vocab, dim, rank=rank)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    import tltorch
    print(machine())
    print(steady_malloc())
    rounds = 3 if args.quick else args.rounds
    print(f"forward + backward, median of {rounds} interleaved rounds; ratio to nn.Embedding "
          "(dense gradients); parameters in thousands; var: output variance at init")
    print(f"{'vocab':>9} {'dim':>4} {'lookups':>7} | {'dense ms':>8} {'sparse':>6} "
          f"{'TLT':>6} {'tnspec':>6} | {'tn/TLT':>6} | {'k params TLT':>12} "
          f"{'tnspec':>7} | {'var TLT':>8} {'tnspec':>6}")
    for vocab, dim, lookups in (QUICK if args.quick else CASES):
        torch.manual_seed(0)
        dense = nn.Embedding(vocab, dim)
        sparse = nn.Embedding(vocab, dim, sparse=True)
        tlt = tltorch.FactorizedEmbedding(vocab, dim, factorization="blocktt", rank=16)
        ours = tnspec_like(tlt, vocab, dim)
        idx = torch.randint(0, vocab, (lookups,))
        grad = torch.randn(lookups, dim)
        modules = [dense, sparse, tlt, ours]
        with torch.no_grad():
            var = [m(idx).var().item() for m in (tlt, ours)]
        runs = [step(m, idx, grad) for m in modules]
        for run in runs:  # warm-up: plans, allocator
            run()
        times = interleaved(runs, rounds)
        med = [statistics.median(t) for t in times]
        ratio = [m / med[0] for m in med]
        params = [sum(p.numel() for p in m.parameters()) / 1e3 for m in (tlt, ours)]
        print(f"{vocab:>9,} {dim:>4} {lookups:>7} | {med[0] * 1e3:>8.1f} {ratio[1]:>6.2f} "
              f"{ratio[2]:>6.2f} {ratio[3]:>6.2f} | {med[3] / med[2]:>6.2f} | "
              f"{params[0]:>12.1f} {params[1]:>7.1f} | {var[0]:>8.2g} {var[1]:>6.2f}")
        print(f"{'':>24}tnspec: {ours.spec}; {ours.plan((lookups,)).report().splitlines()[1]}")


if __name__ == "__main__":
    main()
