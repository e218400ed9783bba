"""Why the benchmarks' allocator never trims its heap: a small layer timed right after a module
with gigabytes of activations, under glibc's malloc keeping freed memory with
M_TRIM_THRESHOLD=-1 (never give memory back, what ``harness.steady_malloc`` sets) and with
2^31-1 (what it set before).

    python benchmarks/allocator.py [--rounds 16] [--batch 128]

Each setting runs in a process of its own (``mallopt`` is process-wide): the CP layer of the
speed table (two copies), the left-to-right TR layer (2.6 GB of activations at batch 128) and
the dense conv, forward and backward, in shuffled rounds. The table gives the CP layer's
times right after the TR module and after the others: the median, and how many runs took more
than twice the median of the runs after another module. With the 2 GB threshold, freeing the
TR module's 2.6 GB could cut the heap back, and whatever ran next faulted its pages in afresh
(not every time: it depends on what is left live at the heap's top); in the speed table's
batch-128 case that made identical code read 1.2-1.6x apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchors import conv_formats  # noqa: E402
from harness import fwd_bwd, interleaved, machine, steady_malloc  # noqa: E402

import tnspec  # noqa: E402

SETTINGS = {"never trim (-1)": -1, "trim above 2^31-1": 2**31 - 1}


def measure(trim: int, rounds: int, batch: int) -> dict[str, list[float]]:
    """The CP layers' seconds in this process, by what ran just before: the TR module or not."""
    print(steady_malloc(trim=trim), file=sys.stderr)
    formats = {f.name: f for f in conv_formats(96, 96, 10, 3, 1, (6, 4, 4))}
    cp, tr = formats["cp"], formats["tr"]
    x = torch.randn(batch, 96, 32, 32).requires_grad_(True)
    modules = {"cp": tnspec.layer(cp.spec, autotune=False, **cp.sizes),
               "cp copy": tnspec.layer(cp.spec, autotune=False, **cp.sizes),
               "big": tnspec.layer(tr.spec, planner="left-to-right", autotune=False,
                                   **tr.sizes),
               "dense": nn.Conv2d(96, 96, 3, 1, 1, bias=False)}
    runs = [fwd_bwd(m, x) for m in modules.values()]
    for run in runs:
        run()
    sequence: list[int] = []
    times = interleaved(runs, rounds, ran=sequence)
    names, big = list(modules), list(modules).index("big")
    out: dict[str, list[float]] = {"after the big module": [], "after another": []}
    for k, (before, n) in enumerate(zip([None, *sequence], sequence)):
        if names[n].startswith("cp"):  # each round runs each once: this is round k // len
            out["after the big module" if before == big else "after another"].append(
                times[n][k // len(runs)])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trim", type=int, help=argparse.SUPPRESS)  # one setting, in-process
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.trim is not None:
        print(json.dumps(measure(args.trim, args.rounds, args.batch)))
        return 0
    print(machine())
    print(f"\nCP layer (96 -> 96, rank 10, batch {args.batch}), fwd+bwd ms, {args.rounds} "
          "shuffled rounds beside left-to-right TR and the dense conv")
    print("| M_TRIM_THRESHOLD | after another: median (n) | right after the TR module: "
          "median (n) | of those, over 2x the first median |\n|---|---:|---:|---:|")
    for label, trim in SETTINGS.items():
        done = subprocess.run([sys.executable, __file__, "--trim", str(trim), "--rounds",
                               str(args.rounds), "--batch", str(args.batch), "--threads",
                               str(args.threads)], capture_output=True, text=True, check=True)
        got = json.loads(done.stdout.splitlines()[-1])
        after, other = got["after the big module"], got["after another"]
        ms = [1000 * statistics.median(t) if t else float("nan") for t in (other, after)]
        slow = sum(1000 * t > 2 * ms[0] for t in after)
        print(f"| {label} | {ms[0]:.1f} ({len(other)}) | {ms[1]:.1f} ({len(after)}) | "
              f"{slow} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
