"""Adapters on MobileNetV2's 1x1 convs (ImageNet weights, Fashion-MNIST at 96x96), every
tnspec format with ``adapt``'s default start and with ``init="zero"``, against PEFT's LoRA at
the same trainable parameters, at three learning rates: the task of
``experiments.models.mobilenet_fashion``, part 2 (150 steps of 32, AdamW, the new head
trained in full; test accuracy on 1,000 images).

    python -m experiments.models.mobilenet_adapters          # one seed: ~25 min on 2 cores
    python -m experiments.models.mobilenet_adapters --seeds 3
    python -m experiments.models.mobilenet_adapters --smoke
    python -m experiments.models.mobilenet_adapters --seeds 3 --share 0.008 \\
        --methods "head only" "low_rank default" "cp default" "tucker2 default" \\
        "tt default" "PEFT LoRA" --out mobilenet_adapters_half
                    # tnspec's adapters at most half of PEFT LoRA's (the head aside), ~15 min
    python -m experiments.models.mobilenet_adapters --seeds 3 --rank 1 \\
        --methods "low_rank default" "low_rank zero" "PEFT LoRA" --out mobilenet_adapters_rank1
                    # low_rank at rank 1 on all 34 convs: PEFT LoRA r=1's structure, ~25 min
    python -m experiments.models.mobilenet_adapters --seeds 3 --rank 1 \\
        --methods "low_rank default" "PEFT LoRA" --out mobilenet_adapters_rank1_multiplier
                    # the same since the drawn scale is the output's multiplier, ~17 min
    python -m experiments.models.mobilenet_adapters --methods "head only" "low_rank default" \\
        "cp default" "tucker2 default" "tt default" "tr default" "tt_lora default" \\
        "PEFT LoRA" --out mobilenet_adapters_multiplier   # every format's default, ~15 min
    python -m experiments.models.mobilenet_adapters --seeds 3 --methods "head only" \\
        "low_rank default" "cp default" "tucker2 default" "tt default" "tr default" \\
        "tt_lora default" "PEFT LoRA" --out mobilenet_adapters_multiplier_3seeds
                    # the same, 3 seeds, ~45 min alone
    python -m experiments.models.mobilenet_adapters --seeds 3 --methods "low_rank principal" \\
        "cp principal" "tucker2 principal" "PEFT LoRA" --out mobilenet_adapters_principal
                    # the principal start (init="principal"), ~23 min
"""

from __future__ import annotations

import argparse
import statistics
import time

from .. import assets
from . import mobilenet
from .mobilenet_fashion import fine_tune, with_adapters
from ..common import markdown_table, save

FORMATS = ("low_rank", "cp", "tucker2", "tt", "tr", "tt_lora")
RATES = (1e-3, 3e-3, 1e-2)
SPECIAL = ("head only", "PEFT LoRA")  # methods that are no "<format> <start>"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version")
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds (1)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="'<format> default', '<format> zero', '<format> principal', "
                        "'head only', 'PEFT LoRA'")
    parser.add_argument("--out", default="mobilenet_adapters", help="the results file's name")
    parser.add_argument("--share", type=float, default=0.01,
                        help="tnspec's adapters and the head together, a share of the "
                        "network's parameters (0.01)")
    parser.add_argument("--rank", type=int, default=None,
                        help="tnspec's adapters at this integer rank on every 1x1 conv "
                        "instead of a share of each (--share then applies to PEFT's only)")
    parser.add_argument("--peft-share", type=float, default=0.01,
                        help="the same for PEFT's LoRA (0.01)")
    args = parser.parse_args(argv)
    started = time.time()
    n_train, n_test, steps, size = (64, 64, 2, 32) if args.smoke else (3000, 1000, 150, 96)
    images, labels = assets.fashion_mnist("train", n_train)
    test_images, test_labels = assets.fashion_mnist("test", n_test)
    data = (mobilenet.fashion_inputs(images, size), labels,
            mobilenet.fashion_inputs(test_images, size), test_labels)
    methods = args.methods or (("low_rank default", "PEFT LoRA") if args.smoke else
                               ("head only", *(f"{f} default" for f in FORMATS),
                                *(f"{f} zero" for f in FORMATS), "PEFT LoRA"))
    rates = (1e-2,) if args.smoke else RATES
    seeds = range(args.seeds)
    rows = []
    for method in methods:
        cells, trainable = [], 0
        for lr in rates:
            accs = []
            for seed in seeds:
                fmt, *start = method.split() if method not in SPECIAL else (method,)
                net, trainable = with_adapters(
                    fmt, args.peft_share if fmt == "PEFT LoRA" else args.share,
                    None if not start or start[0] == "default" else start[0],
                    None if fmt in SPECIAL else args.rank)
                acc, _ = fine_tune(net, data, steps, seed=seed, lr=lr)
                accs.append(acc)
                print(method, lr, seed, f"{acc:.3f}", flush=True)
            cells.append(f"{statistics.mean(accs):.3f}" + (f" ({min(accs):.3f})"
                                                           if len(accs) > 1 else ""))
        rows.append((method, f"{trainable:,}", *cells))
    text = ("# Adapters on MobileNetV2's 1x1 convs, Fashion-MNIST, three rates\n\n"
            f"ImageNet MobileNetV2, {n_train:,} training / {n_test:,} test images at "
            f"{size}x{size}; adapters on the 34 1x1 convs of the features, with the new head "
            + (f"(trained in full); tnspec's at rank {args.rank} on every conv" if args.rank
               else f"(trained in full) about {args.share:.2%} of the network's parameters")
            + f" (PEFT's LoRA {args.peft_share:.2%}); {steps} steps of 32, AdamW; test "
            f"accuracy, mean over {len(seeds)} seed(s)"
            + (" (the lowest in brackets)" if len(seeds) > 1 else "") + ". default: `adapt` "
            "unasked (every core drawn, a frozen copy subtracted, `scale = min(1, 4 / n)`); "
            "zero: `init=\"zero\"`; principal: `init=\"principal\"`.\n\n"
            + markdown_table(["method", "trainable", *(f"lr {lr:g}" for lr in rates)], rows))
    print(text)
    if not args.smoke:
        print(f"wrote {save(args.out, text, started)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
