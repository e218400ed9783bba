"""Path quality and planning time over random networks of the paper's generator.

    python benchmarks/paths.py [--networks 200] [--write]

For each network (tnspec.formats.random: 4-8 cores, 2-3 input and output modes, random rank
edges, a 3x3 conv on one core, a hyperedge on half of them), batch 32 at 32x32: the planner's
cost against the exhaustive optimum of the same cost model (every split of every subset,
outer products included), and the planning time (median of 3). Goals: cost <= 1.05x the
optimum; median planning time <= 50 ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import tnspec
from tnspec.nn.formats import random as random_format
from tnspec.shapes import bind_shape
from tnspec.planning.plan import Problem, plan

HERE = Path(__file__).resolve().parent


def exhaustive(problem: Problem) -> float:
    """The cheapest order under ``problem``'s cost model, over every binary tree."""
    n = len(problem.operands)
    best = {1 << k: 0.0 for k in range(n)}
    for subset in sorted(range(1, 1 << n), key=lambda s: bin(s).count("1")):
        if subset in best:
            continue
        low = subset & -subset
        rest = subset ^ low
        value = float("inf")
        sub = rest
        while True:  # every split (a, subset - a) with the lowest operand in a
            a = sub | low
            b = subset ^ a
            if b and a in best and b in best:
                step = problem.price(problem.array([a]), problem.array([b]))[0][0]
                value = min(value, best[a] + best[b] + float(step))  # inf if not allowed
            if sub == 0:
                break
            sub = (sub - 1) & rest
        best[subset] = value
    return best[(1 << n) - 1]


def study(count: int) -> list[dict]:
    rows = []
    for seed in range(count):
        spec, sizes = random_format(seed)
        net = tnspec.compile(spec, **sizes)
        channels = 1
        for i in net.input.axes[1]:
            channels *= net.sizes[i]
        bound = bind_shape(net, (32, channels, 32, 32))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            chosen = plan(bound)
            times.append(time.perf_counter() - start)
        planned = sum(s.seconds for s in chosen.steps)
        optimum = exhaustive(Problem(bound))
        rows.append(dict(seed=seed, cores=len(net.cores), ratio=planned / optimum,
                         ms=1000 * statistics.median(times)))
    return rows


def report(rows: list[dict]) -> str:
    ratios = sorted(r["ratio"] for r in rows)
    ms = sorted(r["ms"] for r in rows)
    within = sum(r <= 1.05 for r in ratios)
    lines = [f"{len(rows)} random networks (4-8 cores), batch 32, 32x32:",
             f"- planned cost / exhaustive optimum: median {statistics.median(ratios):.3f}, "
             f"max {ratios[-1]:.3f}; within 1.05x: {within}/{len(rows)}",
             f"- planning time: median {statistics.median(ms):.1f} ms, 90th percentile "
             f"{ms[int(0.9 * len(ms))]:.1f} ms, max {ms[-1]:.1f} ms"]
    by_cores: dict[int, list[float]] = {}
    for r in rows:
        by_cores.setdefault(r["cores"], []).append(r["ms"])
    lines.append("- median planning time by number of cores: " + ", ".join(
        f"{k}: {statistics.median(v):.1f} ms" for k, v in sorted(by_cores.items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--networks", type=int, default=200)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    text = report(study(args.networks))
    print(text)
    if args.write:
        path = HERE / "RESULTS.md"
        body = path.read_text() if path.exists() else ""
        start, end = "<!-- path table -->", "<!-- end path table -->"
        block = f"{start}\n{text}\n{end}"
        if start in body:
            body = body[:body.index(start)] + block + body[body.index(end) + len(end):]
        else:
            body += "\n" + block + "\n"
        path.write_text(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
