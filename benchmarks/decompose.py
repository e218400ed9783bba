"""Decomposing dense conv kernels: tnspec's ``Layer.fit_`` against TensorLy's decompositions
(``parafac``, ``partial_tucker``, ``tensor_train``: what TensorLy-Torch's ``from_conv`` runs), at
equal ranks, and exact recovery for every format.

    python benchmarks/decompose.py            # the tables (about 7.5 min on 2 CPU threads)
    python benchmarks/decompose.py --smoke    # tiny sizes, one rank, one seed, in process (tests)
    python benchmarks/decompose.py --hops 0   # exact recovery without basin hops

Part 1, same network, same ranks. Each TensorLy decomposition is written as a tnspec spec of
the very same network (CP: factors for o, c, kh, kw; Tucker-2: factors for o and c around a
core; TT: the chain o - c - kh - kw with the ranks TT-SVD actually keeps), so the two relative
errors ``||W_fit - W|| / ||W||`` are comparable. Both run in float64 on the CPU with TensorLy's
defaults (SVD init, 100 iterations for CP and Tucker). Kernels: a Gaussian one (flat spectrum,
the hard case) and "power-law" ones (mode spectra decaying as i^-0.75, like trained kernels).
Time: repetitions interleaved, median, as the ratio tnspec / TensorLy. Peak memory: each method
runs once in a fresh process; the figure is that process's peak RSS increase over the start of
the run (``ru_maxrss``), in MiB.

Part 2, exact recovery: the weight of a random Graph-in instance of a format plus 0.5% Gaussian
noise, fitted by a fresh layer of the same format (``starts=8, hops=64``); success = error under
2%.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import machine  # noqa: E402

import tnspec  # noqa: E402

RECOVERY = ("cp", "tucker2", "tt", "tr", "htk2", "block_term", "odd", "random")


def kernel(kind: str, o: int, c: int, seed: int = 0) -> torch.Tensor:
    """A (o, c, 3, 3) float64 kernel: "gaussian" or "power-law" (mode spectra ~ i^-0.75)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(o, c, 3, 3, generator=g, dtype=torch.float64)
    if kind == "gaussian":
        return z
    u = torch.linalg.qr(torch.randn(o, o, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(c, c, generator=g, dtype=torch.float64))[0]
    so = torch.arange(1, o + 1, dtype=torch.float64) ** -0.75
    sc = torch.arange(1, c + 1, dtype=torch.float64) ** -0.75
    return torch.einsum("oi,cj,i,j,ijkl->ockl", u, v, so, sc, z)


def specs(fmt: str, r: int, o: int, c: int) -> tuple[str, dict[str, int]]:
    """The tnspec network of TensorLy's decomposition ``fmt`` at rank ``r``."""
    io = "x[b, c, h+kh-1, w+kw-1], {} -> y[b, o, h, w]"
    if fmt == "cp":
        return io.format("A[o, r], B[c, r], C[kh, r], D[kw, r]"), dict(r=r)
    if fmt == "tucker2":
        return io.format("U[c, r0], G[r1, r0, kh, kw], V[r1, o]"), dict(r0=r, r1=r)
    ranks = _tt_ranks(r, (o, c, 3, 3))
    return (io.format("G1[o, r1], G2[r1, c, r2], G3[r2, kh, r3], G4[r3, kw]"),
            dict(r1=ranks[0], r2=ranks[1], r3=ranks[2]))


def _tt_ranks(r: int, shape: tuple[int, ...]) -> list[int]:
    """The inner ranks TT-SVD keeps for a requested rank ``r`` (capped by each unfolding)."""
    out, left = [], 1
    for k in range(len(shape) - 1):
        rank = min(r, left * shape[k], math.prod(shape[k + 1:]))
        out.append(rank)
        left = rank
    return out


def run_tensorly(fmt: str, w: torch.Tensor, r: int) -> float:
    import tensorly as tl
    from tensorly.decomposition import parafac, partial_tucker, tensor_train
    tl.set_backend("pytorch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank above a mode's size
        if fmt == "cp":
            approx = tl.cp_to_tensor(parafac(w, r, init="svd"))
        elif fmt == "tucker2":
            (core, factors), _ = partial_tucker(w, rank=[r, r], modes=[0, 1])
            approx = torch.einsum("ijkl,oi,cj->ockl", core, *factors)
        else:
            approx = tl.tt_to_tensor(tensor_train(w, [1, r, r, r, 1]))
    return tnspec.fit.decompose.relative_error(approx, w)


def run_tnspec(fmt: str, w: torch.Tensor, r: int) -> float:
    spec, sizes = specs(fmt, r, w.shape[0], w.shape[1])
    layer = tnspec.layer(spec, c=w.shape[1], o=w.shape[0], kh=3, kw=3, **sizes,
                         dtype=torch.float64)
    return layer.fit_(w)


def _child(args: tuple) -> tuple[float, float, float]:
    """In a fresh process: (error, seconds, peak RSS increase in MiB) of one method."""
    method, fmt, kind, o, c, r = args
    torch.set_num_threads(torch.get_num_threads())
    w = kernel(kind, o, c)
    run = run_tnspec if method == "tnspec" else run_tensorly
    run(fmt, kernel(kind, 4, 4), 2)  # imports and first-call allocations before the baseline
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    error = run(fmt, w, r)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return error, seconds, (peak - base) / 1024


def compare(cases: list[tuple[str, int, int]], ranks: dict[str, tuple[int, ...]],
            repeats: int, fresh: bool = True) -> list[dict]:
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for kind, o, c in cases:
        w = kernel(kind, o, c)
        for fmt, rs in ranks.items():
            for r in rs:
                row = dict(kernel=f"{kind} {o}x{c}x3x3", format=fmt, rank=r)
                for method in ("tnspec", "tensorly"):
                    job = (method, fmt, kind, o, c, r)
                    if fresh:
                        with ctx.Pool(1) as pool:
                            error, _, mem = pool.apply(_child, (job,))
                    else:  # the smoke run, loaded as a file by the tests: in process
                        error, _, mem = _child(job)
                    row[f"{method} error"], row[f"{method} MiB"] = error, mem
                times: dict[str, list[float]] = {"tnspec": [], "tensorly": []}
                for _ in range(repeats):  # interleaved
                    for method, run in (("tnspec", run_tnspec), ("tensorly", run_tensorly)):
                        start = time.perf_counter()
                        run(fmt, w, r)
                        times[method].append(time.perf_counter() - start)
                row["time ratio"] = statistics.median(times["tnspec"]) / \
                    statistics.median(times["tensorly"])
                row["tensorly s"] = statistics.median(times["tensorly"])
                rows.append(row)
    return rows


def recovery(channels: int, seeds: int, starts: int, hops: int) -> list[dict]:
    rows = []
    for fmt in RECOVERY:
        errors, seconds = [], []
        for seed in range(seeds):
            if fmt == "random":
                made = tnspec.formats.random(seed)
            else:
                made = tnspec.formats.build(fmt, channels, channels, 3, padding=1, rank=0.2)
            torch.manual_seed(seed)
            weight = made.layer().dense_weight().detach()
            weight = weight + 0.005 * weight.std() * torch.randn_like(weight)
            layer = made.layer()
            start = time.perf_counter()
            errors.append(layer.fit_(weight, starts=starts, hops=hops))
            seconds.append(time.perf_counter() - start)
        rows.append(dict(format=fmt, errors=errors, seconds=statistics.median(seconds),
                         ok=sum(e < 0.02 for e in errors), params=layer.network.num_parameters))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (tests)")
    parser.add_argument("--hops", type=int, default=64, help="basin hops in the exact-recovery "
                        "part (0: none, as before tnspec had them)")
    args = parser.parse_args(argv)
    if args.smoke:
        cases, repeats = [("power-law", 8, 6)], 1
        ranks = {"cp": (4,), "tucker2": (3,), "tt": (4,)}
        channels, seeds, starts, hops = 8, 1, 2, min(args.hops, 4)
    else:
        cases = [("gaussian", 64, 64), ("power-law", 64, 64), ("power-law", 256, 256)]
        ranks, repeats = {"cp": (16, 64), "tucker2": (8, 32), "tt": (8, 32)}, 3
        channels, seeds, starts, hops = 32, 3, 8, args.hops
    print(machine())
    rows = compare(cases, ranks, repeats, fresh=not args.smoke)
    print("\n| kernel | network | rank | error tnspec | error TensorLy | tnspec / TensorLy "
          "error | time ratio | TensorLy s | peak MiB tnspec | peak MiB TensorLy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['format']} | {r['rank']} | {r['tnspec error']:.4f} | "
              f"{r['tensorly error']:.4f} | {r['tnspec error'] / r['tensorly error']:.3f} | "
              f"{r['time ratio']:.2f} | {r['tensorly s']:.3f} | {r['tnspec MiB']:.1f} | "
              f"{r['tensorly MiB']:.1f} |")
    print(f"\nexact recovery: weight of a random instance + 0.5% noise, {seeds} seed(s), "
          f"starts={starts}, hops={hops}, {channels} channels, rank share 0.2 (random: its own "
          "sizes)")
    print("| format | params | errors | under 2% | median s |")
    print("|---|---|---|---|---|")
    for r in recovery(channels, seeds, starts, hops):
        print(f"| {r['format']} | {r['params']} | {', '.join(f'{e:.4f}' for e in r['errors'])} "
              f"| {r['ok']}/{len(r['errors'])} | {r['seconds']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
