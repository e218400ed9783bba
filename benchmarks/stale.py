"""Choices measured on a busy machine, run later on a quiet one.

    python benchmarks/stale.py          # RESULTS.md, "Autotuning on a busy machine"
    python benchmarks/stale.py --quick    # two layers, fewer rounds

Phase 1, busy: as many CPU-bound processes as CPUs run (each a one-thread matmul loop, as
DataLoader workers are) while a fresh process, with an empty calibration cache of its own,
calls each layer once, which autotunes its order. Phase 2, quiet: the busy processes are
stopped and a new process, with the cache phase 1 left, builds the same layers and calls each
once (recalling, re-checking or timing), then times the class it runs against the model's
order (the one ``tnspec compile`` writes) in interleaved rounds. The goal: within 1.10x of the
model's order, whatever phase 1 measured. Each row says what phase 1 kept and what phase 2 did.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import fwd_bwd, interleaved, machine, steady_malloc  # noqa: E402

import tnspec  # noqa: E402

CP2 = ("x[b, c, 2*h+kh-1, 2*w+kw-1], A[c, r], H[kh, r], V[kw, r], B[r, o] -> y[b, o, h, w]",
       dict(c=96, o=96, r=10, kh=3, kw=3), (32, 96, 33, 33))
TUCKER2 = ("x[b, c, h+kh-1, w+kw-1], U[c, r0], G[r0, r1, kh, kw], V[r1, o] -> y[b, o, h, w]",
           dict(c=96, o=96, r0=24, r1=24, kh=3, kw=3), (32, 96, 34, 34))
TT_LINEAR = ("x[b, (i0 i1)], A[i0, o0, r], B[r, i1, o1] -> y[b, (o0 o1)]",
             dict(i0=28, i1=28, o0=20, o1=25, r=8), (128, 784))
CASES = {"cp stride 2": CP2, "tucker2": TUCKER2, "tt-linear 784->500": TT_LINEAR}
FORMATS = {"tr 96": ("tr", 0.1), "tt 96": ("tt", 0.1)}  # formats.build at 96 channels, 3x3
QUICK = ["cp stride 2", "tt-linear 784->500"]
BUSY = ("import torch\ntorch.set_num_threads(1)\na = torch.randn(384, 384)\n"
        "while True:\n    a = torch.tanh(a @ a)")


def layers(names: list[str]) -> dict[str, tuple[torch.nn.Module, tuple[int, ...]]]:
    """The layers, seeded, with their input shapes."""
    built = {}
    for name in names:
        torch.manual_seed(0)
        if name in CASES:
            spec, sizes, shape = CASES[name]
            built[name] = (tnspec.layer(spec, **sizes), shape)
        else:
            fmt, rank = FORMATS[name]
            made = tnspec.formats.build(fmt, 96, 96, 3, rank=rank, padding=1)
            built[name] = (made.layer(), (32, 96, 32, 32))
    return built


class _Work(logging.Handler):
    """Keeps what each layer's first call said it did."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "first call took" in text:
            said = text.split("first call took ", 1)[1]
            said = said[said.index("(") + 1:].split("); to avoid it")[0].rstrip(")")
            for long, short in SHORT.items():
                said = said.replace(long, short)
            self.said.append(said)


#: what a first call said it did, in a few words
SHORT = {" forward and backward": "", "candidate orders": "orders",
         " (other threads took the CPUs: the choice is not kept)": ", busy: not kept",
         "order recalled from the calibration cache": "recalled",
         "recalled order re-checked, led no more: the model's order runs":
         "re-checked, lead gone: model's order", "one candidate order, nothing timed":
         "one candidate"}


def first_calls(names: list[str]) -> dict[str, str]:
    """Call each layer once (autotuning); what each call did."""
    work = _Work()
    logger = logging.getLogger("tnspec")
    logger.addHandler(work)
    logger.setLevel(logging.DEBUG)
    did = {}
    for name, (layer, shape) in layers(names).items():
        work.said.clear()
        layer(torch.randn(shape))
        model = tnspec.emit.runtime.source_of(layer._planned(tuple(shape)).forward)
        ran = tnspec.emit.runtime.source_of(layer._last_class.forward)
        did[name] = (work.said[-1] if work.said else "?") + \
            ("" if ran == model else " -> another order")
    return did


def phase_busy(names: list[str]) -> None:
    print(json.dumps(first_calls(names)))


def phase_quiet(names: list[str], rounds: int) -> None:
    steady_malloc()
    did = first_calls(names)  # recall, re-check or time, in a process of its own
    rows = {}
    for name, (layer, shape) in layers(names).items():
        x = torch.randn(shape, requires_grad=True)
        layer(x)
        runs_ = layer._last_class, layer._planned(tuple(shape))
        same = tnspec.emit.runtime.source_of(runs_[0].forward) == \
            tnspec.emit.runtime.source_of(runs_[1].forward)
        steps = []
        for cls in runs_:
            steps.append(fwd_bwd(_Fixed(layer, cls), x))
        for step in steps:
            step()
        times = interleaved(steps, rounds)
        med = [statistics.median(t) for t in times]
        rows[name] = {"did": did[name], "ms": med[1] * 1e3, "ratio": med[0] / med[1],
                      "model's order": same}
    print(json.dumps(rows))


class _Fixed(torch.nn.Module):
    """A layer run through one generated class (the one it chose, or the model's order)."""

    def __init__(self, layer: torch.nn.Module, cls: type) -> None:
        super().__init__()
        self.layer, self.cls = layer, cls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cls.forward(self.layer, x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--phase", choices=["busy", "quiet"], help=argparse.SUPPRESS)
    ap.add_argument("--names", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        names = args.names.split(",")
        phase_busy(names) if args.phase == "busy" else phase_quiet(names, args.rounds)
        return
    names = QUICK if args.quick else [*CASES, *FORMATS]
    rounds = 5 if args.quick else args.rounds
    print(machine())
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TNSPEC_CACHE_DIR": cache}
        me = [sys.executable, __file__, "--names", ",".join(names), "--rounds", str(rounds)]
        hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(os.cpu_count() or 1)]
        try:
            time.sleep(2)  # the hogs are running
            busy = subprocess.run(me + ["--phase", "busy"], env=env, capture_output=True,
                                  text=True, check=True)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        time.sleep(2)
        quiet = subprocess.run(me + ["--phase", "quiet"], env=env, capture_output=True,
                               text=True, check=True)
    before = json.loads(busy.stdout.splitlines()[-1])
    after = json.loads(quiet.stdout.splitlines()[-1])
    print(f"phase 1 beside {os.cpu_count()} CPU-bound processes, phase 2 quiet; chosen order "
          f"over the model's order, forward + backward, median of {rounds} interleaved rounds")
    print(f"{'layer':<19} | {'phase 1 (busy)':<41} | {'phase 2 (quiet)':<41} | "
          f"{'model ms':>8} {'ratio':>6}")
    for name in names:
        row = after[name]
        print(f"{name:<19} | {before[name]:<41} | {row['did']:<41} | "
              f"{row['ms']:>8.2f} {row['ratio']:>6.2f}" +
              ("" if row["model's order"] else "  (another order)"))


if __name__ == "__main__":
    main()
