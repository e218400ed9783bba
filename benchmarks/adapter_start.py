"""What an adapter's training step costs on the CPU, per format, from the zero start and from
``adapt``'s default start (every core drawn, a frozen copy subtracted), against PEFT's LoRA r=8
where peft imports: four 768 -> 768 linears (BERT-base projections) in a row, each adapted at
LoRA r=8's parameters, 8 x 128 tokens that need a gradient (as inside a network whose earlier
layers train). Interleaved rounds in one process, medians, inputs and gradients drawn outside
the timed region; the ratios are within the run.

    python benchmarks/adapter_start.py            # about two minutes
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
    lora = None
    try:
        import peft
        lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=8, target_modules=[str(i) for i in range(len(base))]))
    except ImportError:
        print("\npeft does not import: no LoRA column")

    def step(model: nn.Module) -> None:
        model(x).backward(g)
        model.zero_grad(set_to_none=True)
        x.grad = None
    print(f"\n| four adapted {width} -> {width} linears, 8 x {tokens} tokens | zero start | "
          "default start | default / zero | zero / LoRA | default / LoRA |\n"
          "|---|---|---|---|---|---|")
    for fmt in FORMATS:
        rank = 8 if fmt == "low_rank" else 2 * width * 8 / width ** 2  # LoRA r=8's share
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # modes of small widths
            models = [tnspec.adapt(copy.deepcopy(base), fmt, rank=rank, **start)[0]
                      for start in ({"init": "zero"}, {})]
        if lora is not None:  # timed beside each format's pair, as they are
            models.append(lora)
        for model in models:  # plans, and the default start's one-time work
            for _ in range(3):
                step(model)
        times = [statistics.median(t) for t in
                 interleaved([lambda m=m: step(m) for m in models], rounds)]
        zero, default = times[:2]
        against = (f"{zero / times[2]:.2f} | {default / times[2]:.2f}" if lora is not None
                   else " | ")
        print(f"| tnspec {fmt} | {zero * 1e3:.1f} ms | {default * 1e3:.1f} ms | "
              f"{default / zero:.2f} | {against} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
