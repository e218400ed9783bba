"""Forward+backward time and activation memory of tnspec layers against the alternatives.

    pip install ".[bench]"
    python benchmarks/speed.py            # the full table (a few minutes on 2 CPU threads)
    python benchmarks/speed.py --write    # ... and rewrite benchmarks/RESULTS.md and speed.png
    python benchmarks/speed.py --smoke    # tiny sizes: runs everything once, cross-checks

Every tnspec layer whose format a library implements is first checked against it: the
library's cores are copied into the tnspec layer and both must give the same output. Timing:
repetitions interleaved over all implementations, median per implementation, ratios against
the dense layer and the best library implementation of the same format, measured in this
process. Memory: bytes the forward pass saves for the backward pass plus the output (the
activation memory of training; parameters excluded), read with saved-tensor hooks.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchors import Format, conv_formats, linear_format, missing  # noqa: E402

import tnspec  # noqa: E402

HERE = Path(__file__).resolve().parent


def fwd_bwd(module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        x.grad = None
        for p in module.parameters():
            p.grad = None
        module(x).sum().backward()
    return run


def activation_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes saved for backward (each storage once) plus the output's."""
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() != x.untyped_storage().data_ptr():
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    seen[y.untyped_storage().data_ptr()] = y.untyped_storage().nbytes()
    return sum(seen.values())


def cross_check(fmt: Format, x: torch.Tensor) -> list[str]:
    """Copy each library's cores into the tnspec layer; the outputs must agree."""
    failures = []
    for name, build in fmt.anchors.items():
        torch.manual_seed(0)
        anchor = build()
        with torch.no_grad():
            for p in anchor.parameters():
                p.normal_(0, 0.3)
            if getattr(anchor, "bias", None) is not None:
                anchor.bias.zero_()
        layer = tnspec.layer(fmt.spec, **fmt.sizes)
        fmt.copy[name](anchor, layer)
        with torch.no_grad():
            want, got = anchor(x), layer(x)
        err = ((got - want).abs().max() / want.abs().max()).item()
        status = "ok" if got.shape == want.shape and err < 1e-4 else "MISMATCH"
        print(f"  cross-check {fmt.name:<9} tnspec vs {name:<24} max rel. diff {err:.1e}  {status}")
        if status != "ok":
            failures.append(f"{fmt.name} vs {name}")
    return failures


def case(title: str, formats: list[Format], dense: nn.Module, x: torch.Tensor, repeats: int,
         smoke: bool) -> tuple[list[dict], list[str]]:
    print(f"\n{title}: input {tuple(x.shape)}")
    failures: list[str] = []
    for fmt in formats:
        failures += cross_check(fmt, x.detach())
    entries: list[tuple[str, str, nn.Module]] = [("dense", "torch", dense)]
    for fmt in formats:
        for planner, label in (("auto", "tnspec"), ("dense-first", "tnspec dense-first"),
                               ("left-to-right", "tnspec left-to-right")):
            entries.append((fmt.name, label, tnspec.layer(fmt.spec, planner=planner,
                                                           **fmt.sizes)))
        entries.append((fmt.name, "tnspec autotune", tnspec.layer(fmt.spec, autotune=True,
                                                                  **fmt.sizes)))
        for name, build in fmt.anchors.items():
            entries.append((fmt.name, name, build()))
    x = x.detach().requires_grad_(True)
    runs = [fwd_bwd(m, x) for _, _, m in entries]
    for run in runs:  # warm-up: plans, allocator, mkldnn primitives
        run()
    times: list[list[float]] = [[] for _ in entries]
    for _ in range(1 if smoke else repeats):
        for n, run in enumerate(runs):
            start = time.perf_counter()
            run()
            times[n].append(time.perf_counter() - start)
    rows = [dict(case=title, format=fmt, impl=impl, ms=1000 * statistics.median(t),
                 mb=activation_bytes(m, x) / 2**20)
            for (fmt, impl, m), t in zip(entries, times)]
    dense_ms = rows[0]["ms"]
    for row in rows:
        row["x_dense"] = row["ms"] / dense_ms
        anchors = [r for r in rows if r["format"] == row["format"] and
                   not r["impl"].startswith("tnspec") and r["format"] != "dense"]
        row["x_anchor"] = row["ms"] / min(r["ms"] for r in anchors) if anchors else math.nan
        row["anchor_mb"] = min(r["mb"] for r in anchors) if anchors else math.nan
        if row["impl"] == "tnspec":
            reconstruct = next(r["ms"] for r in rows if r["format"] == row["format"]
                               and r["impl"] == "tnspec dense-first")
            row["x_floor"] = row["ms"] / min(dense_ms, reconstruct)
            row["x_fastest"] = row["ms"] / min(r["ms"] for r in rows if r["format"] ==
                                               row["format"] and r["impl"].startswith("tnspec"))
    return rows, failures


def table(rows: list[dict]) -> str:
    lines = ["| case | format | implementation | ms (fwd+bwd) | x dense | x best library "
             "| activation MB |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        anchor = "" if math.isnan(r["x_anchor"]) else f"{r['x_anchor']:.2f}"
        lines.append(f"| {r['case']} | {r['format']} | {r['impl']} | {r['ms']:.1f} | "
                     f"{r['x_dense']:.2f} | {anchor} | {r['mb']:.1f} |")
    return "\n".join(lines)


def goals(rows: list[dict]) -> str:
    """tnspec <= 0.8x the best library of its format; <= 1.05x the better of dense and
    reconstruct-first; activation memory no worse than the best library's."""
    lines = ["| case | format | x best library (goal <= 0.80) | x min(dense, reconstruct) "
             "(goal <= 1.05) | memory vs best library (goal <= 1) | default vs fastest "
             "tnspec order (goal <= 1.10) |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["impl"] != "tnspec":
            continue
        a = "" if math.isnan(r["x_anchor"]) else \
            f"{r['x_anchor']:.2f} {'met' if r['x_anchor'] <= 0.8 else 'MISSED'}"
        m = "" if math.isnan(r["anchor_mb"]) else \
            f"{r['mb'] / r['anchor_mb']:.2f} {'met' if r['mb'] <= r['anchor_mb'] * 1.001 else 'MISSED'}"
        f = f"{r['x_floor']:.2f} {'met' if r['x_floor'] <= 1.05 else 'MISSED'}"
        t = f"{r['x_fastest']:.2f} {'met' if r['x_fastest'] <= 1.10 else 'MISSED'}"
        lines.append(f"| {r['case']} | {r['format']} | {a} | {f} | {m} | {t} |")
    return "\n".join(lines)


def machine() -> str:
    import opt_einsum
    from tnspec.calibration import _cpu_name
    return (f"{platform.platform()}; {_cpu_name()}; "
            f"{torch.get_num_threads()} threads; python {platform.python_version()}, torch "
            f"{torch.__version__}, opt_einsum {opt_einsum.__version__}, tnspec "
            f"{tnspec.__version__}")


def calibration_text(refresh: bool) -> str:
    """The planner's cost model on this CPU, as `tnspec calibrate` shows it."""
    from tnspec import calibration
    if not calibration.enabled():
        return "Calibration: off (TNSPEC_CALIBRATE=0): the built-in constants"
    return "Calibration: " + tnspec.calibrate(refresh=refresh).describe().replace("\n", ";")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="rewrite RESULTS.md and speed.png")
    parser.add_argument("--recalibrate", action="store_true",
                        help="measure the planner's calibration again first (as on a fresh "
                        "machine; the measured op choices are dropped too)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    calibrated = calibration_text(args.recalibrate)
    print(machine())
    print(calibrated)
    for line in missing():
        print(f"skipped: {line} is not installed")
    if args.smoke:
        c, r, hw, modes, batches, lin_batch = 12, 3, 8, (3, 2, 2), (2,), 4
    else:
        c, r, hw, modes, batches, lin_batch = 96, 10, 32, (6, 4, 4), (32, 128), 128
    rows: list[dict] = []
    failures: list[str] = []
    specs = [(f"conv b={b}", 1, b) for b in batches] + [(f"conv stride 2 b={batches[0]}", 2,
                                                        batches[0])]
    for title, stride, batch in specs:
        torch.manual_seed(0)
        x = torch.randn(batch, c, hw, hw)
        dense = nn.Conv2d(c, c, 3, stride=stride, padding=1)
        got, bad = case(title, conv_formats(c, c, r, 3, stride, modes), dense, x, args.repeats,
                        args.smoke)
        rows += got
        failures += bad
    lin = linear_format(r if not args.smoke else 2)
    got, bad = case(f"linear b={lin_batch}", [lin], nn.Linear(784, 500),
                    torch.randn(lin_batch, 784), args.repeats, args.smoke)
    rows += got
    failures += bad
    print("\n" + table(rows) + "\n\n" + goals(rows))
    if args.write and not args.smoke:
        write(rows, calibrated)
    if failures:
        print(f"\ncross-check FAILED: {', '.join(failures)}")
        return 1
    return 0


def write(rows: list[dict], calibrated: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["impl"] == "tnspec" or r["format"] == "dense"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"{r['case']}\n{r['format']}" for r in mine]
    ax.bar(range(len(mine)), [r["x_dense"] for r in mine], color="tab:blue")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(range(len(mine)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("time / dense layer (fwd+bwd)")
    ax.set_title("tnspec layers against the dense layer of the same shape")
    fig.tight_layout()
    fig.savefig(HERE / "speed.png", dpi=120)
    text = (HERE / "RESULTS.md").read_text() if (HERE / "RESULTS.md").exists() else ""
    start = "<!-- speed table -->"
    end = "<!-- end speed table -->"
    block = (f"{start}\nMachine: {machine()}\n\n{calibrated}\n\n{table(rows)}\n\n{goals(rows)}"
             f"\n{end}")
    if start in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text += "\n" + block + "\n"
    (HERE / "RESULTS.md").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
