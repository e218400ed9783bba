"""What ``compress``'s pruning leaves out and what it costs: the same call with ``prune=True``
(the default) and ``prune=False`` in one process, on all-MiniLM-L6-v2's encoder at 50% (8
batches of 32 Rotten Tomatoes snippets at 64 tokens, as ``minilm_compress``) and on
MobileNetV2's 34 1x1 convs at 75% (8 batches of 32 Fashion-MNIST images at 96 px, keeping the
pooled features, as ``mobilenet_compress``). Per layer: every format's error at the budget's
share (fitted with ``prune=False``), which of them the pruned call left out, each call's pick;
per call: seconds, candidates pruned, the predicted model error.

    python -m experiments.models.compress_pruning           # ~9 min on 2 cores
    python -m experiments.models.compress_pruning --smoke   # a tiny version (the tests run it)
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any, Callable

import torch
from torch import nn

import tnspec
from tnspec.workflows.convert.compress import FORMATS

from .. import assets
from ..common import markdown_table, save
from . import mobilenet
from .mobilenet_fashion import _pooled, pointwise


def minilm(smoke: bool) -> tuple[nn.Module, list, dict[str, Any]]:
    model, tokenizer = assets.minilm()
    texts, _ = assets.rotten_tomatoes()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0))
    n = 32 if smoke else 256
    fit_texts = [texts[i] for i in order[-n:]]
    batches = [dict(tokenizer(fit_texts[i:i + 32], padding=True, truncation=True,
                              max_length=64, return_tensors="pt")) for i in range(0, n, 32)]
    include = "encoder.layer.5.*" if smoke else "encoder.*"
    return model, batches, {"include": include}


def mobilenet_convs(smoke: bool) -> tuple[nn.Module, list, dict[str, Any]]:
    images, _ = assets.fashion_mnist("train", 64 if smoke else 3000)
    x = mobilenet.fashion_inputs(images, 32 if smoke else 96)
    batches = [x[i:i + 32] for i in range(0, min(256, len(x)), 32)]
    return mobilenet.pretrained(), batches, {"include": pointwise, "run": _pooled,
                                             "max_seconds": 240}


def compare(label: str, load: Callable, budget: float, smoke: bool) -> str:
    model, batches, options = load(smoke)
    formats = FORMATS[:2] if smoke else FORMATS
    reports, seconds = {}, {}
    for prune in (True, False):
        start = time.time()
        _, reports[prune] = tnspec.compress(copy.deepcopy(model), budget, formats,
                                            data=batches, prune=prune, **options)
        seconds[prune] = time.time() - start
    rows = []
    for kept, every in zip(reports[True].choices, reports[False].choices):
        errors = {c.format: c.error for c in every.candidates if c.share == budget}
        fitted = {c.format for c in kept.candidates if c.share == budget}
        rows.append((kept.name, ", ".join(f"{f} {e:.4f}" for f, e in errors.items()),
                     ", ".join(sorted(set(errors) - fitted)) or "-",
                     kept.chosen.format, every.chosen.format))
    table = markdown_table(("layer", f"errors at {budget:g} (prune=False)", "left out",
                            "pick, prune=True", "pick, prune=False"), rows)
    summary = [(prune, f"{seconds[prune]:.0f}", reports[prune].pruned,
                f"{reports[prune].predicted_error:.4f}") for prune in (True, False)]
    head = markdown_table(("prune", "seconds", "candidates pruned", "predicted model error"),
                          summary)
    return f"## {label} at {budget:.0%}\n\n{head}\n\n{table}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version")
    args = parser.parse_args(argv)
    started = time.time()
    torch.manual_seed(0)
    parts = []
    for label, load, budget in (("all-MiniLM-L6-v2's encoder", minilm, 0.5),
                                ("MobileNetV2's 1x1 convs", mobilenet_convs, 0.75)):
        text = compare(label, load, budget, args.smoke)
        print(text, flush=True)
        parts.append(text)
    text = "# compress with and without pruning\n\n" + "\n\n".join(parts)
    if not args.smoke:
        print(save("compress_pruning", text, started))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
