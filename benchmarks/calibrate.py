"""Fit the planner's cost model (tnspec.plan.CostModel) to steps timed on this machine.

    python benchmarks/calibrate.py     # ~2 minutes; prints the fitted CostModel(...)

Times forward+backward of grouped convolutions and data-side einsums over a random grid of
shapes (minimum of 5 repetitions, which is less sensitive to a busy machine than the median),
then fits, in log space, rates for convolution and einsum, the channels-per-group efficiency
c0, memory bandwidth, a per-step overhead and the slowdown of grouped convolutions. The
defaults in tnspec/plan.py came from this script on the 2-thread CPU machine.
"""

from __future__ import annotations

import itertools
import math
import random
import time

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import least_squares

from tnspec.plan import CostModel


def timed(fn, *args, reps: int = 5) -> float:
    times = []
    for _ in range(reps + 1):
        for a in args:
            a.grad = None
        start = time.perf_counter()
        fn(*args).sum().backward()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def measure(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    grid = list(itertools.product([8, 32, 128], [1, 4, 10, 32, 96], [1, 6, 10, 32, 96],
                                  [1, 4, 10], [16, 32], [1, 3]))
    for N, cin, cout, g, hw, k in rng.sample(grid, 70):
        if max(cin, cout) * N * g * hw * hw > 2e7:
            continue
        x = torch.randn(N, cin * g, hw, hw, requires_grad=True)
        w = torch.randn(cout * g, cin, k, k, requires_grad=True)
        t = timed(lambda x, w: F.conv2d(x, w, padding=k // 2, groups=g), x, w)
        rows.append(dict(kind="conv", N=N, cin=cin, cout=cout, g=g, hw=hw * hw, k=k * k, t=t))
    grid = list(itertools.product([8, 32, 128, 512], [4, 10, 96, 100], [4, 10, 96, 100],
                                  [256, 1024]))
    for B, C, O, S in rng.sample(grid, 40):
        if B * max(C, O) * S > 2e7:
            continue
        x = torch.randn(B, C, S, requires_grad=True)
        w = torch.randn(O, C, requires_grad=True)
        t = timed(lambda x, w: torch.einsum("oc,bcs->bos", w, x), x, w)
        rows.append(dict(kind="einsum", N=B, cin=C, cout=O, g=1, hw=S, k=1, t=t))
    return rows


def predict(model: CostModel, r: dict) -> float:
    traffic = r["N"] * r["g"] * (r["cin"] + r["cout"]) * r["hw"] + r["g"] * r["cin"] * \
        r["cout"] * r["k"]
    if r["kind"] == "conv":
        return model.conv(r["N"], r["g"], r["cin"], r["cout"], r["hw"], r["k"], traffic)
    return model.einsum(r["N"] * r["cin"] * r["cout"] * r["hw"], traffic)


def fit(rows: list[dict]) -> CostModel:
    def make(p) -> CostModel:
        conv, ein, c0, bw, ov, grouped = np.exp(p)
        return CostModel(conv, ein, c0, bw, ov, grouped)

    def residuals(p):
        m = make(p)
        return [math.log(predict(m, r)) - math.log(r["t"]) for r in rows]

    start = np.log([2e10, 2e10, 4, 2e9, 1e-4, 2])
    p = least_squares(residuals, start).x
    err = np.abs(residuals(p))
    print(f"{len(rows)} steps; median error x{math.exp(np.median(err)):.2f}, "
          f"90th percentile x{math.exp(np.quantile(err, 0.9)):.2f}")
    return make(p)


if __name__ == "__main__":
    torch.set_num_threads(2)
    print(fit(measure()))
