"""Does a compressed MobileNetV2 serve faster? CPU inference time of torchvision's ImageNet
MobileNetV2 with its 1x1 convs compressed to 50% of their parameters by ``tnspec.compress``
(the default, and with ``latency=True``, which drops candidates slower than the dense layer),
against the original, in one process on the same inputs.

Inputs: Fashion-MNIST images at 224 x 224 px (repeated to 3 channels, normalized as for
ImageNet), batch 1 and batch 32; ``torch.no_grad``, eval mode. Each model's first call plans
its layers (untimed); then interleaved rounds (every model once per round; 200 at batch 1, 15
at batch 32), medians; the ratio
is to the original in the same rounds. ``compress`` sees 4 other batches of 16 images at that
size and keeps the pooled features. Then, at batch 1, each compressed layer against the 1x1
conv it replaced on the input it gets inside the model (recorded by a hook), interleaved: what
the layers save in place, beside the whole forward's time.

    python -m experiments.models.mobilenet_inference            # about 7 minutes on 2 cores
    python -m experiments.models.mobilenet_inference --smoke    # the tests run it (seconds)
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import tnspec

from .. import assets
from ..common import formats_chosen, inference_rows, markdown_table, save
from . import mobilenet
from .mobilenet_fashion import _pooled, _replaced, params_of, pointwise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version (seconds)")
    args = parser.parse_args(argv)
    started = time.time()
    torch.manual_seed(0)
    size, n_fit, big = (32, 16, 4) if args.smoke else (224, 64, 32)
    images, _ = assets.fashion_mnist("train", n_fit + 1 + big)
    x = mobilenet.fashion_inputs(images, size)
    fit = [x[i:i + 16] for i in range(0, n_fit, 16)]
    batches = {"batch 1": x[n_fit:n_fit + 1], f"batch {big}": x[n_fit + 1:n_fit + 1 + big]}
    model = mobilenet.pretrained()
    formats = ("low_rank",) if args.smoke else ("low_rank", "cp", "tucker2", "tt", "tr")
    include = (lambda n, m: pointwise(n, m) and n.startswith(("features.17", "features.18"))) \
        if args.smoke else pointwise  # smoke: the last two blocks' 1x1 convs
    models, notes = {"original": model}, []
    for label, latency in (("compress 50%", False), ("compress 50%, latency=True", True)):
        t = time.time()
        made, report = tnspec.compress(copy.deepcopy(model), 0.5, formats, data=fit,
                                       include=include, run=_pooled, latency=latency,
                                       max_seconds=60 if args.smoke else 600)
        made.eval()
        models[label] = made
        notes.append(f"{label}: {params_of(made, _replaced):,} of {params_of(model):,} 1x1 "
                     f"conv parameters, compressed in {time.time() - t:.0f} s; formats chosen: "
                     + formats_chosen(report))
        print(notes[-1], flush=True)
    # batch 1: 200 rounds, since what the layers save there (about 5% of a forward, see
    # in_place) is inside the spread of 15 rounds on a shared machine (0.96-1.04x)
    rows = [row for label, rounds in (("batch 1", 200), (f"batch {big}", 15))
            for row in inference_rows(models, {label: batches[label]},
                                      3 if args.smoke else rounds, lambda m, b: m(b))]
    for label in list(models)[1:]:
        notes.append(in_place(model, models[label], batches["batch 1"], label,
                              3 if args.smoke else 40))
        print(notes[-1], flush=True)
    text = ("# MobileNetV2 (ImageNet) with its 1x1 convs compressed to 50%: CPU inference time\n\n"
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; {size} x {size} px, "
            "no_grad, eval; medians of interleaved rounds after a first call per model.\n\n"
            + markdown_table(["model", "input", "ms per forward", "x original"], rows)
            + "\n\n" + "\n".join(f"- {line}" for line in notes))
    print(text)
    if not args.smoke:
        print(f"wrote {save('mobilenet_inference', text, started)}")
    return 0


def in_place(original: torch.nn.Module, made: torch.nn.Module, x: torch.Tensor, label: str,
             rounds: int) -> str:
    """What ``made``'s tnspec layers take against the modules they replaced, each on the input
    it gets inside ``made`` at ``x`` (a forward hook records it), interleaved rounds, medians
    summed; beside the original's whole forward in the same rounds."""
    replaced = {n: m for n, m in made.named_modules() if isinstance(m, tnspec.Layer)}
    dense = dict(original.named_modules())
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda m, args, y, n=n: seen.__setitem__(n, args[0]))
             for n, m in replaced.items()]
    with torch.no_grad():
        made(x)
    for hook in hooks:
        hook.remove()
    runs = [lambda: original(x)] + [f for n, m in replaced.items() for f in (
        lambda n=n: dense[n](seen[n]), lambda m=m, n=n: m(seen[n]))]
    spent: list[list[float]] = [[] for _ in runs]
    with torch.no_grad():
        for k in range(rounds + 1):  # the first round warms up
            for run, times in zip(runs, spent):
                start = time.perf_counter()
                run()
                if k:
                    times.append(time.perf_counter() - start)
    medians = [sorted(t)[len(t) // 2] for t in spent]
    whole, pairs = medians[0], list(zip(medians[1::2], medians[2::2]))
    before, after = sum(d for d, _ in pairs), sum(c for _, c in pairs)
    slower = sum(c > d for d, c in pairs)
    return (f"{label}, in place at batch 1: its {len(pairs)} compressed layers take "
            f"{after * 1e6:,.0f} us where the 1x1 convs they replaced take {before * 1e6:,.0f} us "
            f"({slower} of them slower), of the original's {whole * 1e3:.1f} ms forward: "
            f"{(before - after) / whole:.1%} of it saved")


if __name__ == "__main__":
    raise SystemExit(main())
