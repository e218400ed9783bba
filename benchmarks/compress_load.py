"""``tnspec.compress`` on a machine shared with another job: why a run with other processes on
the cores took 10x a quiet one, and what ``threads="auto"`` (the default) does about it.

Compresses a two-block transformer MLP (384 -> 1536 -> 384, twice) to 50% with data, alone and
beside a busy neighbour (a process multiplying 1024 x 1024 matrices on 2 threads without end),
with torch's intra-op threads left at the machine's default (``threads=None``), at 1, and as
``threads="auto"`` chooses (the cores other processes leave free). Rounds alternate the
settings; medians of ``--rounds`` (3). The neighbour starts 2 s before its rows and is killed
after them.

``--job tensorize`` times ``tensorize(weights="fit")`` of two 256-channel 3x3 convs (one of 4
groups) to Tucker-2 at 25% instead, at torch's threads (``threads=None``) and with
``threads="auto"``. ``--job minilm`` times the real case, all-MiniLM-L6-v2's encoder (36
linear layers) compressed to 50% with 4 batches of 32 Rotten Tomatoes snippets at 64 tokens,
as ``compress`` runs by default (``threads="auto"``); it needs the experiments' assets.
``--job small`` times ``compress``'s defaults on a 0.63 M-parameter 1-D conv network (four
convs with kernels of 32-64 taps over 1,024 samples, then a linear layer: the shape of a pitch
tracker), randomly initialized (no such checkpoint installs here; the fits' time follows the
shapes), with 4 batches of 16 random signals; it also prints the compressed network's relative
output error on 64 other random signals.

    python benchmarks/compress_load.py            # about 12 minutes on 2 cores (--rounds 1: 5)
    python benchmarks/compress_load.py --job tensorize --rounds 1   # about 6 minutes
    python benchmarks/compress_load.py --job minilm --rounds 1      # about 7 minutes
    python benchmarks/compress_load.py --job small --rounds 1       # about 2 minutes
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import tnspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine  # noqa: E402

NEIGHBOUR = ("import torch\ntorch.set_num_threads(2)\na = torch.randn(1024, 1024)\n"
             "while True:\n    a @ a\n")


def seconds(job: str, net: nn.Module, data: list[torch.Tensor],
            threads: int | str) -> tuple[float, nn.Module]:
    """Wall seconds of one ``compress`` (or ``tensorize(weights="fit")``) and the model it
    made: at ``threads`` intra-op threads (torch's setting, restored after, and
    ``threads=None``), or with ``threads="auto"``."""
    before = torch.get_num_threads()
    if threads != "auto":
        torch.set_num_threads(int(threads))
    given = "auto" if threads == "auto" else None
    try:
        start = time.perf_counter()
        if job == "compress":
            made = tnspec.compress(copy.deepcopy(net), 0.5, ("low_rank", "tucker2", "tt"),
                                   data=data, threads=given)[0]
        elif job == "minilm":
            made = tnspec.compress(copy.deepcopy(net), 0.5, data=data, include="encoder.*",
                                   threads=given)[0]
        elif job == "small":
            made = tnspec.compress(copy.deepcopy(net), 0.5, data=data, threads=given)[0]
        else:
            made = tnspec.tensorize(copy.deepcopy(net), "tucker2", rank=0.25, weights="fit",
                                    threads=given, fit={"max_seconds": 300})[0]
        return time.perf_counter() - start, made
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job", choices=("compress", "tensorize", "minilm", "small"),
                        default="compress")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.job == "compress":
        net = nn.Sequential(*[nn.Sequential(nn.Linear(384, 1536), nn.GELU(),
                                            nn.Linear(1536, 384)) for _ in range(2)])
    else:
        net = nn.Sequential(nn.Conv2d(256, 256, 3, padding=1, groups=4), nn.ReLU(),
                            nn.Conv2d(256, 256, 3, padding=1))
    data: list = [torch.randn(16, 64, 384) for _ in range(4)]
    if args.job == "minilm":
        net, data = minilm()
    if args.job == "small":
        net, data = conv1d_net(), [torch.randn(16, 1, 1024) for _ in range(4)]
    default = torch.get_num_threads()
    settings: list[int | str] = [*sorted({default, 1}, reverse=True), "auto"] \
        if args.job == "compress" else ["auto"] if args.job in ("minilm", "small") \
        else [default, "auto"]
    times: dict[tuple[str, int | str], list[float]] = {}
    made: nn.Module | None = None
    for machine_state in ("quiet", "one busy neighbour"):
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) \
            if machine_state != "quiet" else None
        try:
            time.sleep(2 if neighbour else 0)
            for _ in range(args.rounds):
                for threads in settings:
                    spent, made = seconds(args.job, net, data, threads)
                    times.setdefault((machine_state, threads), []).append(spent)
        finally:
            if neighbour:
                neighbour.kill()
                neighbour.wait()
    quiet = statistics.median(times["quiet", settings[0]])
    print(machine())
    print(f"\n{args.job}\n\n| machine | torch threads | seconds (median of {args.rounds}) "
          f"| x quiet at {settings[0]} threads |\n|---|---|---|---|")
    for (state, threads), spent in times.items():
        median = statistics.median(spent)
        print(f"| {state} | {threads} | {median:.1f} | {median / quiet:.2f} |")
    if args.job == "small" and made is not None:  # what the time bought
        held_out = torch.randn(64, 1, 1024, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want, got = net(held_out), made(held_out)
        print(f"\nthe last result's relative output error on 64 held-out signals: "
              f"{float((got - want).norm() / want.norm()):.4f}")
    return 0


def conv1d_net() -> nn.Module:
    """A 1-D conv network of 625,960 parameters, in eval mode."""
    def block(c_in: int, c_out: int, kernel: int, **more: int) -> list[nn.Module]:
        return [nn.Conv1d(c_in, c_out, kernel, padding=kernel // 2, **more),
                nn.BatchNorm1d(c_out), nn.ReLU()]
    return nn.Sequential(*block(1, 128, 64, stride=4), nn.MaxPool1d(2),
                         *block(128, 64, 32), nn.MaxPool1d(2), *block(64, 64, 32),
                         nn.MaxPool1d(2), *block(64, 64, 32), nn.AdaptiveAvgPool1d(4),
                         nn.Flatten(), nn.Linear(256, 360)).eval()


def minilm() -> tuple[nn.Module, list[dict]]:
    """all-MiniLM-L6-v2 and 4 batches of 32 Rotten Tomatoes snippets at 64 tokens, as the
    experiments load them (the repository's root on the path)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from experiments import assets
    model, tokenizer = assets.minilm()
    texts, _ = assets.rotten_tomatoes()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0)).tolist()
    data = [dict(tokenizer([texts[i] for i in order[k:k + 32]], padding="max_length",
                           truncation=True, max_length=64, return_tensors="pt"))
            for k in range(0, 128, 32)]
    return model.eval(), data


if __name__ == "__main__":
    raise SystemExit(main())
