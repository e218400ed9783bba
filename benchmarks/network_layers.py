"""How much of a whole network's training step the tensorized layers can save: each one timed.

    python benchmarks/network_layers.py mobilenet_v2   # RESULTS.md, "Whole networks"
    python benchmarks/network_layers.py resnet18

For a network of ``models.py``, every layer ``tensorize`` replaced is timed alone, forward and
backward, against the dense layer it replaced, on the input it sees in the network (interleaved
rounds, medians), and so are both networks' whole training steps. The dense layers' sum,
against the dense step, bounds what any factorization of those layers can give: with them
free, the network would still take ``1 - sum / step`` of the dense time. Layers timed alone
read somewhat faster than inside the network (warm caches), so the bound is approximate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402
from harness import fwd_bwd, interleaved, machine, steady_malloc  # noqa: E402

import tnspec  # noqa: E402


def replaced_layers(dense: nn.Module, tensorized: nn.Module, image: torch.Tensor
                    ) -> list[tuple[str, nn.Module, nn.Module, torch.Size]]:
    """(name, dense layer, its replacement, the replacement's input shape), in network order."""
    originals = dict(dense.named_modules())
    found: list[tuple[str, nn.Module, nn.Module, torch.Size]] = []
    hooks = []
    for name, module in tensorized.named_modules():
        if isinstance(module, tnspec.Layer) and name in originals:
            hooks.append(module.register_forward_hook(
                lambda m, args, out, name=name: found.append(
                    (name, originals[name], m, args[0].shape)) and None))
    with torch.no_grad():
        tensorized(image)
    for hook in hooks:
        hook.remove()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("network", choices=("resnet18", "mobilenet_v2"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds")
    parser.add_argument("--rank-multiple", type=int, default=1,
                        help="tensorize's rank_multiple (1: the share's own rank)")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc's malloc at its defaults")
    args = parser.parse_args(argv)
    print(machine())
    print(steady_malloc(keep=not args.system_malloc))
    dense, tensorized, what = models.pair(args.network, rank_multiple=args.rank_multiple)
    print(f"{args.network}: {what}")
    torch.manual_seed(0)
    image = torch.randn(args.batch, 3, 32, 32, requires_grad=True)  # as speed.py times them
    layers = replaced_layers(dense, tensorized, image)
    runs = [fwd_bwd(dense, image), fwd_bwd(tensorized, image)]
    for _, old, new, shape in layers:
        x = torch.randn(shape, requires_grad=True)
        runs += [fwd_bwd(old, x), fwd_bwd(new, x)]
    for run in runs:
        run()
    times = [statistics.median(t) * 1e3 for t in interleaved(runs, args.rounds)]
    print(f"\nfwd+bwd ms, batch {args.batch}, median of {args.rounds} interleaved rounds")
    print("| layer | input | dense | tnspec | ratio |\n|---|---|---:|---:|---:|")
    for k, (name, _, _, shape) in enumerate(layers):
        old, new = times[2 + 2 * k], times[3 + 2 * k]
        print(f"| {name} | {tuple(shape)} | {old:.2f} | {new:.2f} | {new / old:.2f} |")
    old, new = sum(times[2::2]), sum(times[3::2])
    print(f"| **all {len(layers)} replaced layers** | | **{old:.1f}** | **{new:.1f}** | "
          f"**{new / old:.2f}** |")
    print(f"\nwhole step: dense {times[0]:.1f} ms, tensorized {times[1]:.1f} ms "
          f"({times[1] / times[0]:.2f}x); the replaced layers are {old / times[0]:.0%} of the "
          f"dense step, so with them free the network would take {1 - old / times[0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
