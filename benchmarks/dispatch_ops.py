"""Ops dispatched per training step (forward and backward), counted with a
``TorchDispatchMode``: on a GPU every op is host time, so a step of small layers is bound by how
many ops it dispatches. The count does not depend on the device, so it is measured here, on the
CPU, at batch 2.

    python benchmarks/dispatch_ops.py            # seconds
    python benchmarks/dispatch_ops.py --bert     # BERT-base adapters' steps: 10 minutes

A ResNet-18 of torchvision's architecture (100 classes, 64x64 input; defined here, since
torchvision's CPU wheel does not install beside torch's) dense, with every 3x3 conv but the stem
and the downsampling ones written by hand as three convs (1x1, 3x3, 1x1) at the ranks tnspec
gives it, and tensorized with ``tucker2`` at 25% of their parameters; then one 64-channel layer
per format against the hand-written Tucker-2; then an adapter of each format on a BERT-base
projection, from the zero start and from ``adapt``'s default one. Channel mixing is forced to
1x1 convolutions (the op a GPU is expected to choose) and calibration is off, so that the
count does not depend on this machine's measurements.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("TNSPEC_CALIBRATE", "0")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import tnspec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Count  # noqa: E402
from models import ResNet18, by_hand, written_by_hand  # noqa: E402


def step_ops(module: nn.Module, x: torch.Tensor, amp: bool = False) -> int:
    """Ops of one forward and backward, gradients unset as ``zero_grad()`` leaves them, the
    gradient contiguous as a next layer gives it; after a warm-up step. ``amp``: the forward
    under bfloat16 autocast, as the GPU step runs it."""
    def forward() -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            return module(x)
    y = forward()
    g = torch.randn_like(y)
    y.backward(g)
    module.zero_grad(set_to_none=True)
    x.grad = None  # an input that needs a gradient gets it as a next layer's would: anew
    with Count() as counted:
        forward().backward(g)
    module.zero_grad(set_to_none=True)
    x.grad = None
    return sum(counted.ops.values())


def main(argv: list[str] | None = None) -> int:
    if "--bert" in (sys.argv[1:] if argv is None else argv):
        return bert()
    calibration = tnspec.planning.calibration
    chooser = calibration.chooser
    calibration.chooser = lambda *a, **k: lambda step: "conv1x1"
    try:
        table()
    finally:
        calibration.chooser = chooser
    return 0


def flattened_1x1(model: nn.Module) -> nn.Module:
    """``model`` with its tnspec layers running the form ``torch.compile`` traces, eagerly: 1x1
    convs 1-D over the flattened spatial axes, as every eager call ran before issue 58."""
    for m in model.modules():
        if isinstance(m, tnspec.Layer):
            m._class = lambda shape, last=False, m=m: tnspec.emit.runtime.layer_class(
                m.network, m.plan(shape), last, compiled=True)
    return model


def table() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    dense = ResNet18()

    def chosen(name: str, m: nn.Module) -> bool:  # stem, downsampling and fc stay dense
        return isinstance(m, nn.Conv2d) and name != "conv1" and "downsample" not in name
    tensorized, _ = tnspec.tensorize(ResNet18(), "tucker2", rank=0.25, include=chosen)
    hand = written_by_hand(tensorized, ResNet18())
    print(f"torch {torch.__version__}, tnspec {tnspec.__version__}; batch 2, 64x64, "
          "channel mixing by 1x1 convs, calibration off\n")
    print("| ResNet-18 (100 classes) | parameters | ops per fwd+bwd |\n|---|---|---|")
    flat = flattened_1x1(copy.deepcopy(tensorized))
    for label, model in (("dense", dense), ("3 convs by hand (tucker2's ranks)", hand),
                         ("tnspec tucker2 at 25%", tensorized),
                         ("tnspec tucker2 at 25%, 1x1 convs flattened (before)", flat)):
        print(f"| {label} | {sum(p.numel() for p in model.parameters()):,} | "
              f"{step_ops(model, x):,} |")
    dense_first = copy.deepcopy(tensorized)
    for m in dense_first.modules():
        if isinstance(m, tnspec.Layer):
            m.planner = "dense-first"
    last = x.contiguous(memory_format=torch.channels_last)
    print("\n| the same, bf16 autocast and channels_last (the GPU step) | ops per fwd+bwd |\n"
          "|---|---|")
    for label, model in (("dense", dense), ("3 convs by hand (tucker2's ranks)", hand),
                         ("tnspec tucker2 at 25%", tensorized),
                         ("tnspec tucker2 at 25%, dense-first", dense_first)):
        model = copy.deepcopy(model).to(memory_format=torch.channels_last)
        print(f"| {label}, bf16 | {step_ops(model, last, amp=True):,} |")
    x = torch.randn(2, 64, 16, 16)
    layer = tnspec.formats.tucker2(64, 64, 3, rank=0.1, padding=1).layer()
    hand_ops = step_ops(by_hand(layer), x)
    print("\n| one 64->64 3x3 layer at 10% | ops per fwd+bwd | / by hand |\n|---|---|---|")
    print(f"| tucker2 by hand (3 convs) | {hand_ops} | 1.00 |")
    for fmt in ("low_rank", "cp", "tucker2", "tt", "tr"):
        ops = step_ops(tnspec.formats.build(fmt, 64, 64, 3, padding=1, rank=0.1).layer(), x)
        print(f"| tnspec {fmt} | {ops} | {ops / hand_ops:.2f} |")
    adapters()


def adapters() -> None:
    """An adapter on one 768 -> 768 linear (a BERT-base projection), 32 x 128 tokens that need
    a gradient (as in a network whose earlier layers train), at the zero start and at
    ``adapt``'s default start (every core drawn, a frozen copy subtracted), PEFT's LoRA r=8
    beside it where peft imports."""
    torch.manual_seed(0)
    x = torch.randn(32, 128, 768, requires_grad=True)

    def base() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(768, 768))
    print("\n| adapter on a 768 -> 768 linear, 32 x 128 tokens needing a gradient | zero start | "
          "default start |\n"
          "|---|---|---|")
    try:
        import peft
        lora = peft.get_peft_model(base(), peft.LoraConfig(r=8, target_modules=["0"]))
        print(f"| PEFT LoRA r=8 | {step_ops(lora, x)} | |")
    except ImportError:
        print("| PEFT LoRA r=8 (peft does not import) | | |")
    for fmt in ("low_rank", "cp", "tt", "tr", "tt_lora"):
        rank = 8 if fmt == "low_rank" else 2 * 768 * 8 / 768 ** 2  # LoRA r=8's share
        ops = [step_ops(tnspec.adapt(base(), fmt, rank=rank, **start)[0], x)
               for start in ({"init": "zero"}, {})]
        print(f"| tnspec {fmt} adapter | {ops[0]} | {ops[1]} |")



def bert() -> int:
    """Ops of one training step (SGD) of each BERT-base adapter model of ``gpu_step.py``,
    32 x 128 tokens, float32, on the CPU (minutes: each step is a BERT-base step)."""
    import gpu_step
    print(f"torch {torch.__version__}, tnspec {tnspec.__version__}; BERT-base, 32 x 128 "
          "tokens, float32, calibration off\n")
    print("| BERT-base adapters | ops per training step |\n|---|---|")
    cpu = torch.device("cpu")
    for v in gpu_step.bert_variants(32, 128, cpu, False):
        step = gpu_step.make_step(v, v.model, cpu, None)
        step()
        with Count() as counted:
            step()
        print(f"| {v.label} | {sum(counted.ops.values()):,} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
