"""Where the time goes: torch.profiler's operator table for tnspec and the fastest library layer
of the same format, forward+backward, as the speed table runs them (batch 32, 96 -> 96
channels, 32x32, 3x3, rank 10, 2 threads), and for the same tnspec layers compiled.

    python benchmarks/profile_ops.py [--formats cp tucker tt] [--steps 20] [--write]
    python benchmarks/profile_ops.py --networks resnet18 mobilenet_v2 [--write]
    python benchmarks/profile_ops.py --memory [--formats cp tucker] [--batch 128] [--write]
    python benchmarks/profile_ops.py --dense --stride 2 --formats tr tt-modes --no-compile
    python benchmarks/profile_ops.py --dense --channels-last --formats tr --no-compile
    python benchmarks/profile_ops.py --dense --formats tt-modes --no-compile

For each format, one table: the aten operators by self CPU time per fwd+bwd step, tnspec
beside the library, so that "same operators, same time" or "this operator costs more" can be
read off rather than argued. The columns are profiled in interleaved rounds; absolute times
move with the machine (up to 2x on these), ratios within a table much less. The compiled
columns run ``torch.compile`` of the same modules, the tnspec layer after one eager call (the
class that call chose is the one traced). ``--write`` replaces the profile block of
RESULTS.md. ``--networks`` profiles whole networks of ``models.py`` instead (a training step
at batch 32, 32x32, the dense network beside the tensorized one, as built), for the network
profile block. ``--memory`` lists instead what each implementation keeps for the backward
pass: every tensor an autograd node saved (each storage once; the layer's input and
parameters left out, as the speed table's "activation MB" leaves them out), with the node
that saved it, and the output. ``--dense`` puts the dense conv and tnspec's dense-first order
beside tnspec instead of the library (``--stride 2``: the speed table's stride-2 case);
``--channels-last`` feeds a channels-last input, every 4-D
parameter converted as ``speed.py`` converts them (the speed table's channels-last case),
with the cost model's order and the format's library beside them. Each stride and layout
has a dense profile block of its own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchors import conv_formats, missing  # noqa: E402
from harness import (channels_last_parameters, fwd_bwd, interleaved,  # noqa: E402
                     kept_for_backward, machine, steady_malloc)
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


def saved(module: nn.Module, x: torch.Tensor) -> list[tuple[str, tuple[int, ...], float]]:
    """(autograd node, shape, MB) of each tensor one forward saves for backward, then the
    output: what the speed table's activation memory counts (``harness.activation_bytes``),
    itemized. The graph is walked only to name the tensors kept, and not at all when nothing
    was kept (a checkpointed module, whose saved tensors reading would recompute)."""
    kept, y = kept_for_backward(module, x)
    kept.pop(y.untyped_storage().data_ptr(), None)  # listed once, as the output
    names: dict[int, str] = {}
    nodes, seen = [y.grad_fn] if kept else [], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            t = getattr(node, attr) if attr.startswith("_saved_") else None
            if isinstance(t, torch.Tensor):
                names.setdefault(t.untyped_storage().data_ptr(),
                                 f"{type(node).__name__}.{attr[7:]}")
        nodes.extend(n for n, _ in node.next_functions)
    out = [(names.get(ptr, "?"), tuple(t.shape), t.untyped_storage().nbytes() / 1e6)
           for ptr, t in kept.items()]
    out.append(("output", tuple(y.shape), y.untyped_storage().nbytes() / 1e6))
    return out


class Checkpointed(nn.Module):
    """``module`` under ``torch.utils.checkpoint``: only its input is kept; backward runs its
    forward again."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.module, x, use_reentrant=False)


def memory_table(name: str, modules: dict[str, nn.Module], x: torch.Tensor,
                 rounds: int = 11) -> str:
    """The tensors each module saves for backward, itemized, with its fwd+bwd median time
    (``rounds`` interleaved rounds, after warm-up) on the total's line: the memory next to what
    it costs."""
    runs = [fwd_bwd(m, x) for m in modules.values()]
    for run in runs:
        for _ in range(3):
            run()
    times = [statistics.median(t) * 1000 for t in interleaved(runs, rounds)]
    lines = [f"{name}, input {tuple(x.shape)}: tensors saved for backward, MB (each storage "
             "once; input and parameters left out), and the median fwd+bwd time",
             "| implementation | saved by | shape | MB |", "|---|---|---|---:|"]
    for (label, module), ms in zip(modules.items(), times):
        rows = saved(module, x)
        alike: dict[tuple[str, tuple[int, ...]], list[float]] = {}
        for node, shape, mb in rows:
            alike.setdefault((node, shape), []).append(mb)
        for (node, shape), mbs in sorted(alike.items(), key=lambda kv: -sum(kv[1])):
            count = f" (x{len(mbs)})" if len(mbs) > 1 else ""
            lines.append(f"| {label} | {node}{count} | {'x'.join(map(str, shape))} | "
                         f"{sum(mbs):.2f} |")
        lines.append(f"| **{label}** | **all; {ms:.1f} ms fwd+bwd** | | "
                     f"**{sum(r[2] for r in rows):.2f}** |")
    return "\n".join(lines)


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
    parser.add_argument("--memory", action="store_true",
                        help="itemize the tensors saved for backward instead of timing")
    parser.add_argument("--batch", type=int, default=32, help="batch size of the layers")
    parser.add_argument("--stride", type=int, default=1, help="stride of the layers")
    parser.add_argument("--dense", action="store_true",
                        help="beside tnspec, the dense conv and tnspec's dense-first order "
                        "instead of the library (the 'min(dense, reconstruct-first)' goal)")
    parser.add_argument("--channels-last", action="store_true",
                        help="a channels-last input and 4-D parameters (with --dense)")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc's malloc at its defaults (see harness.steady_malloc)")
    args = parser.parse_args(argv)
    allocator = steady_malloc(not args.system_malloc)
    torch.set_num_threads(args.threads)
    for line in missing():
        print(f"skipped: {line} is not installed")
    formats = {f.name: f for f in conv_formats(96, 96, 10, 3, args.stride, (6, 4, 4))}
    torch.manual_seed(0)
    x = torch.randn(args.batch, 96, 32, 32)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
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
    if args.dense and not args.memory:
        marks = "dense profile tables" + (f" stride {args.stride}" if args.stride != 1 else "") \
            + (" channels_last" if args.channels_last else "")  # a block of RESULTS.md each
    if args.memory:
        marks = "memory profile tables"
        for name in args.formats:
            fmt = formats[name]
            layer = tnspec.layer(fmt.spec, **fmt.sizes)  # memory_table's warm-up autotunes it
            modules = {"tnspec": layer, "tnspec checkpointed": Checkpointed(layer),
                       **{label: build() for label, build in fmt.anchors.items()}}
            text = memory_table(f"{name} (batch {args.batch})", modules, x)
            print("\n" + text, flush=True)
            blocks.append(text)
    for name in () if args.networks or args.memory else args.formats:
        fmt = formats[name]
        layer = tnspec.layer(fmt.spec, **fmt.sizes)
        modules: dict[str, nn.Module] = {"tnspec": layer}
        library = LIBRARY.get(name)
        if args.dense:
            modules["tnspec dense-first"] = tnspec.layer(fmt.spec, planner="dense-first",
                                                         autotune=False, **fmt.sizes)
            modules["dense conv"] = nn.Conv2d(96, 96, 3, args.stride, 1, bias=False)
            if args.channels_last:  # where the default keeps the model's order
                modules["tnspec model's order"] = tnspec.layer(fmt.spec, autotune=False,
                                                               **fmt.sizes)
        if (not args.dense or args.channels_last) and library in fmt.anchors:
            modules[library] = fmt.anchors[library]()
        if args.channels_last:
            for module in modules.values():
                channels_last_parameters(module)
        if not args.no_compile:
            torch._dynamo.reset()
            layer(x)  # the compiled layer traces the class this eager call chose
            for label, module in list(modules.items()):
                modules[f"{label} compiled"] = torch.compile(module)
        columns = ops(modules, x, args.steps)
        title = name + (f", stride {args.stride}" if args.stride != 1 else "") + \
            (", channels_last" if args.channels_last else "")
        text = table(title, columns)
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
