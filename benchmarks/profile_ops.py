"""Where the time goes: torch.profiler's operator table for tnspec and the fastest library layer
of the same format, forward+backward, as the speed table runs them (batch 32, 96 -> 96
channels, 32x32, 3x3, rank 10, 2 threads), and for the same tnspec layers compiled.

    python benchmarks/profile_ops.py [--formats cp tucker tt] [--steps 20] [--write]
    python benchmarks/profile_ops.py --networks resnet18 mobilenet_v2 [--write]

For each format, one table: the aten operators by self CPU time per fwd+bwd step, tnspec
beside the library, so that "same operators, same time" or "this operator costs more" can be
read off rather than argued. The columns are profiled in interleaved rounds; absolute times
move with the machine (up to 2x on these), ratios within a table much less. The compiled
columns run ``torch.compile`` of the same modules, the tnspec layer after one eager call (the
class that call chose is the one traced). ``--write`` replaces the profile block of
RESULTS.md. ``--networks`` profiles whole networks of ``models.py`` instead (a training step
at batch 32, 32x32, the dense network beside the tensorized one, as built), for the network
profile block.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchors import conv_formats, missing  # noqa: E402
from harness import fwd_bwd, machine, steady_malloc  # noqa: E402
import models  # noqa: E402

import tnspec  # noqa: E402

HERE = Path(__file__).resolve().parent
LIBRARY = {"cp": "tltorch factorized", "tucker": "tltorch factorized",
           "tt": "tltorch factorized", "tucker2": "tednet", "tr": "tednet"}


def ops(modules: dict[str, nn.Module], x: torch.Tensor, steps: int,
        rounds: int = 5) -> dict[str, dict[str, float]]:
    """Self CPU milliseconds per fwd+bwd step, by aten operator, for each module: profiled in
    ``rounds`` interleaved rounds of ``steps // rounds`` steps each, so that a slow spell of
    the machine falls on every column alike."""
    runs = {name: fwd_bwd(m, x) for name, m in modules.items()}
    for run in runs.values():  # warm-up: plans, orders timed, mkldnn primitives, compiles
        for _ in range(3):
            run()
    out: dict[str, dict[str, float]] = {name: {} for name in runs}
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for name, run in runs.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(per_round):
                    run()
            for event in prof.key_averages():
                if event.key.startswith("aten::") and event.self_cpu_time_total > 0:
                    ms = event.self_cpu_time_total / 1000 / (per_round * rounds)
                    out[name][event.key] = out[name].get(event.key, 0.0) + ms
    return out


def table(name: str, columns: dict[str, dict[str, float]], top: int = 8) -> str:
    heads = list(columns)
    total = {h: sum(columns[h].values()) for h in heads}
    keys = sorted(set().union(*columns.values()),
                  key=lambda k: -max(columns[h].get(k, 0.0) for h in heads))[:top]
    lines = [f"{name}: self CPU ms per fwd+bwd step (aten operators)",
             "| operator | " + " | ".join(heads) + " |",
             "|---|" + "---:|" * len(heads)]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(f"{columns[h].get(k, 0.0):.2f}" for h in heads)
                     + " |")
    lines.append("| **all operators** | " + " | ".join(f"**{total[h]:.2f}**" for h in heads)
                 + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=["cp", "tucker", "tt"])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="eager tables only")
    parser.add_argument("--networks", nargs="+", choices=["resnet18", "mobilenet_v2"],
                        help="profile these whole networks instead of single layers")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc's malloc at its defaults (see harness.steady_malloc)")
    args = parser.parse_args(argv)
    allocator = steady_malloc(not args.system_malloc)
    torch.set_num_threads(args.threads)
    for line in missing():
        print(f"skipped: {line} is not installed")
    formats = {f.name: f for f in conv_formats(96, 96, 10, 3, 1, (6, 4, 4))}
    torch.manual_seed(0)
    x = torch.randn(32, 96, 32, 32).requires_grad_(True)
    blocks = [machine(), allocator]
    marks = "profile tables"
    for name in args.networks or ():
        dense, tensorized, what = models.pair(name)
        image = torch.randn(32, 3, 32, 32).requires_grad_(True)
        text = table(f"{name}-like ({what}), batch 32",
                     ops({"dense": dense, "tnspec": tensorized}, image, args.steps), top=12)
        print("\n" + text, flush=True)
        blocks.append(text)
        marks = "network profile tables"
    for name in () if args.networks else args.formats:
        fmt = formats[name]
        layer = tnspec.layer(fmt.spec, **fmt.sizes)
        modules: dict[str, nn.Module] = {"tnspec": layer}
        library = LIBRARY.get(name)
        if library in fmt.anchors:
            modules[library] = fmt.anchors[library]()
        if not args.no_compile:
            torch._dynamo.reset()
            layer(x)  # the compiled layer traces the class this eager call chose
            for label, module in list(modules.items()):
                modules[f"{label} compiled"] = torch.compile(module)
        columns = ops(modules, x, args.steps)
        text = table(name, columns)
        print("\n" + text, flush=True)
        blocks.append(text)
    if args.write:
        path = HERE / "RESULTS.md"
        body = path.read_text()
        start, end = f"<!-- {marks} -->", f"<!-- end {marks} -->"
        block = start + "\n" + "\n\n".join(blocks) + "\n" + end
        body = body[:body.index(start)] + block + body[body.index(end) + len(end):] \
            if start in body else body + "\n" + block + "\n"
        path.write_text(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
