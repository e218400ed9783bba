"""What ``adapt``'s default start (every core drawn, a frozen copy subtracted) costs a training
step against the zero start, per format, on the CPU: four 768 -> 768 linears (BERT-base
projections) in a row, each adapted at LoRA r=8's parameters, 8 x 128 tokens that need a
gradient (as inside a network whose earlier layers train). Interleaved rounds in one process,
medians, inputs and gradients drawn outside the timed region; the ratio is within the run.

    python benchmarks/adapter_start.py            # about a minute
    python benchmarks/adapter_start.py --smoke    # seconds (the suite runs it)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TNSPEC_CALIBRATE", "0")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import tnspec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, machine  # noqa: E402

FORMATS = ("low_rank", "cp", "tt", "tr", "tt_lora")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes, two rounds")
    args = parser.parse_args(argv)
    width, tokens, rounds = (64, 8, 2) if args.smoke else (768, 128, 15)
    torch.manual_seed(0)
    x = torch.randn(8, tokens, width, requires_grad=True)
    g = torch.randn(8, tokens, width)
    base = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
    print(machine())
    print(f"\n| four adapted {width} -> {width} linears, 8 x {tokens} tokens | zero start | "
          "default start | default / zero |\n|---|---|---|---|")
    for fmt in FORMATS:
        rank = 8 if fmt == "low_rank" else 2 * width * 8 / width ** 2  # LoRA r=8's share
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # modes of small widths
            models = [tnspec.adapt(copy.deepcopy(base), fmt, rank=rank, **start)[0]
                      for start in ({"init": "zero"}, {})]

        def step(model: nn.Module) -> None:
            model(x).backward(g)
            model.zero_grad(set_to_none=True)
            x.grad = None
        for model in models:  # plans, and the default start's one-time work
            for _ in range(3):
                step(model)
        times = interleaved([lambda m=m: step(m) for m in models], rounds)
        zero, default = (statistics.median(t) for t in times)
        print(f"| tnspec {fmt} | {zero * 1e3:.1f} ms | {default * 1e3:.1f} ms | "
              f"{default / zero:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
