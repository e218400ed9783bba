"""A whole training step on the GPU, where models are trained: a ResNet-18 tensorized at 25% of
its parameters against the dense one, and adapters on a BERT-base classifier against PEFT's
LoRA. One command, one table, at most five minutes on one GPU:

    python benchmarks/gpu_step.py                        # the GPU table (CUDA)
    python benchmarks/gpu_step.py --device cpu --smoke   # small sizes, eager only: a minute

ResNet-18 (100 classes; torchvision's when it imports, else ``models.ResNet18``, the same
architecture and module names): every 3x3 conv but the stem and the downsampling ones
tensorized with ``tucker2`` at ``rank=0.25``, as tnspec builds it (its orders autotuned for the
step on the first call) and with ``planner="dense-first"`` (each kernel rebuilt, then one
conv). SGD with momentum, cross-entropy, bf16 autocast, channels_last. Modes: ``eager``;
``graphs``, the whole step (forward, backward, optimizer) captured once in a CUDA graph and
replayed, as ``torch.cuda.graphs`` documents, which takes the host out; ``compiled``,
``torch.compile(model)`` (the compile is warm-up, not timed; graphs compiled and graph breaks
are counted). BERT-base (12 x 768, random weights: the step time does not depend on them),
batch 32 x 128 tokens, bf16: query, key, value and the attention output adapted by every
tnspec format at LoRA r=8's parameter count from the zero start (one core zero), low_rank and
TT also from ``adapt``'s default start (every core drawn, the start subtracted by a frozen
copy: the adapter runs twice), and by PEFT's LoRA r=8.

Per row: the median step time over interleaved rounds (every variant of a block once per
round), its ratio to the block's first row, the host time (the step's Python returning, before
the device is synchronized: where it is close to the step time the step is host-bound), the
ops dispatched per step (a ``TorchDispatchMode`` counter, the same on any device) and, on CUDA,
the kernels launched per step (the profiler's device events).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import tnspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Count, machine  # noqa: E402
from models import ResNet18, written_by_hand  # noqa: E402


@dataclass
class Variant:
    """One model of a block: how to build it (on the device, trainable), and what the step
    feeds it."""
    label: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    loss: Callable[[torch.Tensor], torch.Tensor]
    failed: str = ""
    step: Callable[[], None] | None = None
    times: list[tuple[float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# --- models -------------------------------------------------------------------------------

def resnet18(classes: int = 100) -> tuple[nn.Module, str]:
    try:
        import torchvision
    except ImportError:
        return ResNet18(classes), "local definition of torchvision's resnet18"
    return torchvision.models.resnet18(num_classes=classes), \
        f"torchvision {torchvision.__version__} resnet18"


def _tensorized_conv(name: str, module: nn.Module) -> bool:
    # stem, downsampling convs and fc stay dense
    return isinstance(module, nn.Conv2d) and name != "conv1" and "downsample" not in name


def resnet_variants(batch: int, size: int, device: torch.device, classes: int = 100
                    ) -> list[Variant]:
    torch.manual_seed(0)
    dense, source = resnet18(classes)
    tensorized, _ = tnspec.tensorize(copy.deepcopy(dense), "tucker2", rank=0.25,
                                     include=_tensorized_conv)
    dense_first = copy.deepcopy(tensorized)
    for m in dense_first.modules():
        if isinstance(m, tnspec.Layer):
            m.planner = "dense-first"
    x = torch.randn(batch, 3, size, size, device=device).contiguous(
        memory_format=torch.channels_last)
    target = torch.randint(0, classes, (batch,), device=device)
    hand = written_by_hand(tensorized, dense)
    out = []
    for label, model in (("dense", dense), ("tucker2's ranks as 3 convs by hand", hand),
                         ("tnspec tucker2 25%", tensorized),
                         ("tnspec tucker2 25%, dense-first", dense_first)):
        model = model.to(device, memory_format=torch.channels_last)
        out.append(Variant(f"{label} ({_params(model)})", model, (x,),
                           lambda y, t=target: F.cross_entropy(y, t)))
    out[0].notes.append(source)
    return out


def bert_variants(batch: int, tokens: int, device: torch.device, small: bool) -> list[Variant]:
    from transformers import BertConfig, BertForSequenceClassification
    config = BertConfig(num_labels=2) if not small else BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        num_labels=2)
    targets = ("query", "key", "value", "attention.output.dense")

    def base() -> nn.Module:
        torch.manual_seed(0)
        return BertForSequenceClassification(config).to(device)

    ids = torch.randint(0, config.vocab_size, (batch, tokens), device=device)
    labels = torch.randint(0, 2, (batch,), device=device)

    def loss(out: object) -> torch.Tensor:
        return F.cross_entropy(out.logits, labels)
    out = []
    try:
        import peft
        lora = peft.get_peft_model(base(), peft.LoraConfig(r=8, lora_alpha=16,
                                                           target_modules=list(targets)))
        out.append(Variant(f"PEFT LoRA r=8 ({_params(lora)})", lora, (ids,), loss))
    except ImportError:
        print("(PEFT does not import: its LoRA row is left out; the first row is tnspec's)")
    h = config.hidden_size
    share = 2 * h * 8 / (h * h)  # LoRA r=8's share of a square projection's parameters
    # the zero start (one core zero) runs the adapter once; adapt's default (every core
    # drawn, the start subtracted by a frozen copy, exact at init) runs it twice, or once
    # where it is one product (TT here), inside the base's. "dense-first": every adapter
    # builds its weight and runs inside its base's product (the fewest ops, a third full
    # product for the weight's gradient)
    for fmt, init, planner in [(f, "zero", "auto") for f in ("low_rank", "cp", "tt", "tr",
                                                             "tt_lora")] + \
            [("low_rank", None, "auto"), ("tt", None, "auto"), ("tr", None, "auto"),
             ("low_rank", None, "dense-first"), ("tr", None, "dense-first")]:
        rank = 8 if fmt == "low_rank" else share
        try:
            model, _ = tnspec.adapt(base(), fmt, rank=rank, include=lambda n, m: n.endswith(
                targets), **({"init": init} if init else {}))
            for m in model.modules():
                if isinstance(m, tnspec.Layer):
                    m.planner = planner
            start = ("zero start" if init else "default start") + \
                (", dense-first" if planner != "auto" else "")
            out.append(Variant(f"tnspec {fmt}, {start} ({_params(model)})", model.to(device),
                               (ids,), loss))
        except tnspec.SpecError as e:
            print(f"(tnspec {fmt} left out: {str(e).splitlines()[0]})")
    return out


def _params(model: nn.Module) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{trainable / 1e6:.2f} M trained" if trainable >= 1e5 else f"{trainable:,} trained"


# --- steps --------------------------------------------------------------------------------

def make_step(v: Variant, model: nn.Module, device: torch.device, amp: torch.dtype | None
              ) -> Callable[[], None]:
    # capturable: a captured step never reads a CPU scalar (SGD has none; kept for Adam users)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        # cache_enabled=False: the autocast cache must not hold casts across a graph capture
        with torch.autocast(device.type, amp or torch.float32, enabled=amp is not None,
                            cache_enabled=False):
            loss = v.loss(model(*v.inputs))
        loss.backward()
        opt.step()
    return step


def captured(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """The whole step captured once in a CUDA graph (after warm-up steps on a side stream, as
    ``torch.cuda.graphs`` documents); each call replays it."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay(step: Callable[[], None] = step) -> None:
        # holds ``step`` and so its optimizer: the graph updates its momentum buffers in
        # place, and once they were freed a replay wrote into reused memory
        graph.replay()
    return replay


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernels(step: Callable[[], None], device: torch.device) -> int:
    from torch.profiler import ProfilerActivity, profile
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def dispatched(step: Callable[[], None]) -> int:
    with Count() as counted:
        step()
    return sum(counted.ops.values())


@contextlib.contextmanager
def dynamo_counts(v: Variant) -> Iterator[None]:
    from torch._dynamo.utils import counters
    counters.clear()
    start = time.perf_counter()
    yield
    breaks = sum(counters["graph_break"].values())
    v.notes.append(f"compiled in {time.perf_counter() - start:.0f} s, "
                   f"{counters['stats']['unique_graphs']} graphs, {breaks} graph breaks")


def prepare(v: Variant, mode: str, device: torch.device, amp: torch.dtype | None) -> None:
    """Build the variant's step for ``mode`` and warm it up (autotuning and compiling happen
    here, untimed); a failure is kept in the row rather than ending the table."""
    try:
        if mode == "compiled":
            torch._dynamo.reset()
            model = torch.compile(v.model)
            step = make_step(v, model, device, amp)
            with dynamo_counts(v):
                for _ in range(3):
                    step()
                sync(device)
        else:
            step = make_step(v, v.model, device, amp)
            for _ in range(3):  # first calls: plans, autotuning, cuDNN's choices
                step()
            sync(device)
            if mode == "graphs":
                step = captured(step, device)
        v.step = step
    except Exception as e:  # noqa: BLE001 (the table goes on; the row says what failed)
        v.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def time_block(variants: list[Variant], device: torch.device, rounds: int) -> None:
    live = [v for v in variants if v.step is not None]
    for _ in range(rounds):
        for v in live:
            sync(device)
            start = time.perf_counter()
            v.step()
            host = time.perf_counter() - start
            sync(device)
            v.times.append((time.perf_counter() - start, host))


def block(title: str, variants: list[Variant], modes: list[str], device: torch.device,
          amp: torch.dtype | None, rounds: int,
          profiled: list[tuple[str, str, Callable[[], None]]],
          child: list[str] | None = None) -> None:
    """Time ``variants`` in each of ``modes``, print their rows, and add the eager steps to
    ``profiled`` (on CUDA: their kernels are counted at the end). ``child``: the arguments
    that rebuild these variants in a child process, where CUDA graphs are captured (see
    :func:`graphs_in_child`)."""
    print(f"\n### {title}\n\n| mode | model | step ms | / first row | host ms | ops | "
          f"notes |\n|---|---|---|---|---|---|---|", flush=True)
    for mode in modes:
        if mode == "graphs" and device.type != "cuda":
            print("| graphs | - | | | | | CUDA graphs need a CUDA device |", flush=True)
            continue
        if mode == "graphs" and child is not None:
            graphs_in_child(child, [v.label for v in variants], rounds)
            continue
        for v in variants:
            v.step, v.failed, v.times, v.notes = None, "", [], v.notes[:1] if mode == "eager" \
                else []
            prepare(v, mode, device, amp)
        time_block(variants, device, rounds)

        def counted(v: Variant) -> tuple[str, str]:
            if mode != "eager":
                return "", "; ".join(v.notes)
            if device.type == "cuda":
                profiled.append((title, v.label, v.step))
            ran = orders_run(v.model)
            notes = v.notes + ([f"orders run: {ran}"] if ran else [])
            return str(dispatched(v.step)), "; ".join(notes)
        print_rows(mode, variants, counted)
        for v in variants:
            if mode != "eager":
                v.step = None  # a captured graph holds its memory pool until dropped


def print_rows(mode: str, variants: list[Variant],
               extra: Callable[[Variant], tuple[str, str]] = lambda v: ("", "")) -> None:
    """A row per variant: the median step and host ms and the ratio to the first row timed;
    ``extra(variant)`` gives the ops and notes columns."""
    first = None
    for v in variants:
        if v.step is None:
            print(f"| {mode} | {v.label} | failed | | | | {v.failed} |", flush=True)
            continue
        step_ms, host_ms = (statistics.median(column) * 1e3 for column in zip(*v.times))
        first = first or step_ms
        ops, notes = extra(v)
        print(f"| {mode} | {v.label} | {step_ms:.2f} | {step_ms / first:.2f} | "
              f"{host_ms:.2f} | {ops} | {notes} |", flush=True)


def orders_run(model: nn.Module) -> str:
    """How many of the model's tnspec layers ran each planner's order in their last call
    (autotuning's choice, for the default planner)."""
    ran = collections.Counter(m._last_class.lowered[1].planner for m in model.modules()
                              if isinstance(m, tnspec.Layer) and m._last_class is not None
                              and m._last_class.lowered[1] is not None)
    return ", ".join(f"{name} {n}" for name, n in ran.most_common())


def graphs_in_child(child: list[str], labels: list[str], rounds: int) -> None:
    """The graphs rows, captured and timed in a child process: a replay that faults leaves the
    CUDA context unusable, so the child announces each capture (and replays it once, synced)
    and, where it dies, is run again without the variant it was capturing, which gets a row
    saying why."""
    skip: dict[int, str] = {}
    while True:
        done = subprocess.run(
            [sys.executable, __file__, *child, "--rounds", str(rounds), "--skip",
             ",".join(map(str, skip)) or "none"], capture_output=True, text=True)
        rows = [line for line in done.stdout.splitlines() if line.startswith("| graphs")]
        if done.returncode == 0:
            break
        started = [int(line.split()[1]) for line in done.stdout.splitlines()
                   if line.startswith("@capturing")]
        captured = {int(line.split()[1]) for line in done.stdout.splitlines()
                    if line.startswith("@captured")}
        error = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
        if not started or started[-1] in captured or started[-1] in skip:
            print(f"| graphs | - | failed | | | | replaying: {error} |", flush=True)
            return
        skip[started[-1]] = error
    for line in rows:
        print(line, flush=True)
    for i, error in skip.items():
        print(f"| graphs | {labels[i]} | failed | | | | captured, its replay failed: {error} |",
              flush=True)


def graphs_child(args: argparse.Namespace, device: torch.device) -> int:
    """The child of :func:`graphs_in_child`: the ResNet variants at one size, each captured,
    replayed once and synced (announced on stdout), then timed and printed as rows."""
    batch, size = map(int, args.child.split("x"))
    skip = {int(i) for i in args.skip.split(",") if i != "none"}
    variants = resnet_variants(batch, size, device)
    live = []
    for i, v in enumerate(variants):
        if i in skip:
            continue
        print(f"@capturing {i}", flush=True)
        prepare(v, "graphs", device, torch.bfloat16)
        if v.step is not None:
            v.step()
            sync(device)
        print(f"@captured {i}", flush=True)
        live.append(v)
    time_block(live, device, args.rounds)
    print_rows("graphs", live)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true",
                        help="small sizes and few rounds, eager only unless --modes says")
    parser.add_argument("--modes", default=None,
                        help="comma-separated: eager, graphs, compiled (default: all three at "
                             "the first ResNet size, eager and graphs at the second)")
    parser.add_argument("--only", default="resnet,bert", help="resnet, bert or both")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # BATCHxSIZE: graphs_child
    parser.add_argument("--skip", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.child:
        return graphs_child(args, device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu (--smoke for the small sizes)")
        return 2
    rounds = args.rounds or (3 if args.smoke else 20)
    amp = torch.bfloat16
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    print(f"{machine(device)}\nbf16 autocast, SGD (momentum 0.9); medians of {rounds} "
          "interleaved rounds after 3 warm-up steps", flush=True)
    start = time.perf_counter()
    profiled: list[tuple[str, str, Callable[[], None]]] = []
    sizes = ((2, 32),) if args.smoke else ((64, 128), (256, 224))
    only = args.only.split(",")
    modes = args.modes.split(",") if args.modes else \
        ["eager"] if args.smoke else ["eager", "graphs", "compiled"]
    # compiling takes the longest: it runs last, at the first size only unless --modes says
    plans = [(size, [m for m in modes if m != "compiled" or args.modes or k == 0])
             for k, size in enumerate(sizes)]
    for (batch, size), these in plans if "resnet" in only else ():
        if these == ["compiled"]:
            continue
        block(f"ResNet-18, batch {batch} at {size} px, channels_last",
              resnet_variants(batch, size, device), [m for m in these if m != "compiled"],
              device, amp, rounds, profiled,
              child=["--device", args.device, "--child", f"{batch}x{size}"])
    if "bert" in only:
        batch, tokens = (2, 16) if args.smoke else (32, 128)
        name = "a 2 x 64 BERT" if args.smoke else "BERT-base (12 x 768)"
        block(f"Adapters on {name}, batch {batch} x {tokens} tokens, 4 projections per layer",
              bert_variants(batch, tokens, device, args.smoke), ["eager"], device, amp, rounds,
              profiled)
    for (batch, size), these in plans if "resnet" in only else ():
        if "compiled" in these:
            block(f"ResNet-18 compiled, batch {batch} at {size} px, channels_last",
                  resnet_variants(batch, size, device), ["compiled"], device, amp, rounds,
                  profiled)
    if profiled:
        # last: once CUPTI has profiled, a CUDA graph's replay can fault (pytorch#75504)
        print("\n| eager step of | model | kernels launched |\n|---|---|---|")
        for title, label, step in profiled:
            print(f"| {title} | {label} | {kernels(step, device)} |", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
