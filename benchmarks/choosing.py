"""Choosing a format and a rank: parameters against forward+backward time, per format, for one
typical conv layer (64 -> 64 channels, 3x3, padding 1, batch 32, 32x32), at 5%, 10%, 25% and
50% of the dense layer's parameters.

    python benchmarks/choosing.py            # the table (45 s cold, 20 s cached, 2 threads)
    python benchmarks/choosing.py --write    # ... and rewrite docs/choosing.md and choosing.png
    python benchmarks/choosing.py --smoke    # tiny sizes, once (tests)

Timing: repetitions interleaved over the dense conv and every layer, median per layer, each
reported as a ratio to the dense ``nn.Conv2d`` measured in the same process, so that a figure
carries over to a machine of the same kind; the machine and versions are printed beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import fwd_bwd, interleaved, machine  # noqa: E402

import tnspec  # noqa: E402

FORMATS = ("low_rank", "cp", "tucker", "tucker2", "htk2", "tt", "tr", "block_term", "hypernet",
           "odd")
SHARES = (0.05, 0.1, 0.25, 0.5)
DOCS = Path(__file__).resolve().parent.parent / "docs"


def measure(channels: int, size: int, batch: int, repeats: int) -> list[dict]:
    """One row per (format, share): parameters, share, time ratio to the dense conv."""
    torch.manual_seed(0)
    dense = nn.Conv2d(channels, channels, 3, padding=1)
    layers: dict[tuple[str, float], nn.Module] = {}
    for fmt in FORMATS:
        for share in SHARES:
            try:
                layers[fmt, share] = tnspec.formats.build(fmt, channels, channels, 3,
                                                          rank=share, padding=1).layer()
            except tnspec.SpecError:  # even rank 1 is over this share
                continue
    layers["depthwise_separable", 0.0] = tnspec.formats.depthwise_separable(
        channels, channels, 3, padding=1).layer()
    x = torch.randn(batch, channels, size, size, requires_grad=True)
    runs = {key: fwd_bwd(m, x) for key, m in layers.items()}
    runs["dense", 1.0] = fwd_bwd(dense, x)
    for run in runs.values():  # plans once per shape, warms the allocator
        run()
    times = dict(zip(runs, interleaved(list(runs.values()), repeats)))
    base = statistics.median(times["dense", 1.0])
    params = sum(p.numel() for p in dense.parameters())
    return [{"format": fmt, "target": share,
             "params": sum(p.numel() for p in layers[fmt, share].parameters()),
             "share": sum(p.numel() for p in layers[fmt, share].parameters()) / params,
             "time": statistics.median(times[fmt, share]) / base}
            for fmt, share in layers]


def table(rows: list[dict]) -> str:
    lines = ["| format | asked share | parameters | share of dense | fwd+bwd time / dense |",
             "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["format"], r["target"])):
        asked = f"{r['target']:.0%}" if r["target"] else "(no rank)"
        lines.append(f"| {r['format']} | {asked} | {r['params']:,} | {r['share']:.1%} | "
                     f"{r['time']:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for fmt in dict.fromkeys(r["format"] for r in rows):
        pts = sorted((r["share"], r["time"]) for r in rows if r["format"] == fmt)
        ax.plot([p for p, _ in pts], [t for _, t in pts], "o-", label=fmt)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="parameters / dense conv",
           ylabel="fwd+bwd time / dense conv")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition")
    parser.add_argument("--write", action="store_true",
                        help="rewrite docs/choosing.md's table and docs/choosing.png")
    args = parser.parse_args(argv)
    channels, size, batch, repeats = (8, 8, 2, 1) if args.smoke else (64, 32, 32, 21)
    started = time.time()
    rows = measure(channels, size, batch, repeats)
    text = (f"{channels} -> {channels}, 3x3, padding 1, batch {batch}, {size}x{size}; median "
            f"of {repeats} interleaved repetitions; {time.time() - started:.0f} s on: "
            f"{machine()}\n\n{table(rows)}")
    print(text)
    if args.write:
        page = DOCS / "choosing.md"
        head, _, tail = page.read_text().partition("<!-- table -->")
        _, _, tail = tail.partition("<!-- /table -->")
        page.write_text(f"{head}<!-- table -->\n{text}\n<!-- /table -->{tail}")
        plot(rows, DOCS / "choosing.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
