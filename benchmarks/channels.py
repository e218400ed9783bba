"""Why a rank that is a multiple of 16 runs faster on this CPU: conv time against channel count.

    python benchmarks/channels.py     # RESULTS.md, "Ranks and the conv's channel blocks"

oneDNN (mkldnn), which runs PyTorch's float32 convolutions on the CPU, lays channels out in
blocks of the vector width (16 floats on AVX-512, 8 on AVX2) and pads the last block, so a
convolution's time steps with the channel count rather than growing with its FLOPs. This
times, interleaved, forward and backward (input and weight gradients):

1. a 3x3 convolution ``r -> r`` at batch 32, 32x32, for ranks around the blocks, against its
   FLOPs;
2. each distinct Tucker-2 layer of the ResNet-18-like network of ``models.py`` (25% of each
   dense layer's parameters) at the share's own rank and with ``rank_multiple=16``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import fwd_bwd, interleaved, machine, steady_malloc  # noqa: E402

import tnspec  # noqa: E402

RANKS = (16, 24, 25, 32, 40, 48, 51, 56, 64)
# (in, out channels, input side, stride) of the ResNet-18-like network's distinct 3x3 convs
LAYERS = ((64, 64, 32, 1), (64, 128, 32, 2), (128, 128, 16, 1), (128, 256, 16, 2),
          (256, 256, 8, 1), (256, 512, 8, 2), (512, 512, 4, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc's malloc at its defaults")
    args = parser.parse_args(argv)
    rounds = args.rounds
    print(machine())
    print(steady_malloc(keep=not args.system_malloc))
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    torch.manual_seed(0)
    runs = [fwd_bwd(nn.Conv2d(r, r, 3, padding=1, bias=False),
                    torch.randn(32, r, 32, 32, requires_grad=True)) for r in RANKS]
    times = [statistics.median(t) for t in interleaved(runs, rounds)]
    print(f"\n3x3 conv r -> r, batch 32, 32x32, fwd+bwd, median of {rounds} interleaved rounds")
    print("| r | ms | x r=64 | FLOPs x r=64 |\n|---:|---:|---:|---:|")
    for r, t in zip(RANKS, times):
        print(f"| {r} | {t * 1e3:.2f} | {t / times[-1]:.2f} | {(r / 64) ** 2:.2f} |")

    layers, names = [], []
    for c, o, side, stride in LAYERS:
        x = torch.randn(32, c, side, side, requires_grad=True)
        for multiple in (1, 16):
            fmt = tnspec.formats.tucker2(c, o, 3, rank=0.25, stride=stride, padding=1,
                                         rank_multiple=multiple)
            layers.append(fwd_bwd(fmt.layer(bias=False), x))
            names.append((c, o, side, stride, fmt.sizes["r0"]))
    times = [statistics.median(t) for t in interleaved(layers, rounds)]
    print(f"\nTucker-2 at 25% of the dense parameters, batch 32, fwd+bwd, median of {rounds} "
          "interleaved rounds")
    print("| layer | rank | ms | rank_multiple=16 | ms | ratio |\n|---|---:|---:|---:|---:|---:|")
    for k in range(0, len(names), 2):
        (c, o, side, stride, r), (*_, r16) = names[k], names[k + 1]
        print(f"| {c} -> {o}, {side}x{side}, stride {stride} | {r} | {times[k] * 1e3:.2f} | "
              f"{r16} | {times[k + 1] * 1e3:.2f} | {times[k + 1] / times[k]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
