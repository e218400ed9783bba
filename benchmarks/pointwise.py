"""A factorized 1x1 conv planned as before this benchmark (its first core the conv it always
was, every mixing op timed forward and backward) against as planned now (that core a mixing
step too, and a served layer's mixing and order timed forward alone).

    python benchmarks/pointwise.py            # RESULTS.md, "A 1x1 conv's core as ..."
    python benchmarks/pointwise.py --smoke    # tiny sizes, a few rounds (the tests run it)

The layers are MobileNetV2's pointwise convs at the sizes they see at 224 px, each replaced by
a low-rank one at half its parameters (``tnspec.formats.low_rank``, ``U[r, c, kh, kw]`` at
``kh = kw = 1``, then ``V[o, r]``). Each is built twice with the same cores: "before" is
planned as every tree before this benchmark planned it, the identity relations hidden from the
chooser (its first core stays a conv) and one class for training and serving, planned and
timed for training; "now" as planned by default (a served layer's mixing ops and orders timed
forward alone). Both and the dense conv are timed in one process, interleaved: the forward
under ``no_grad`` (serving) at batch 1 and 32, and forward and backward (training) at batch 8,
with the calibrated chooser of this machine.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import fwd_bwd, interleaved, machine  # noqa: E402

import tnspec  # noqa: E402
from tnspec.planning.problem import Problem  # noqa: E402

#: (channels in, channels out, spatial size) of MobileNetV2's pointwise convs at 224 px
LAYERS = ((24, 144, 56), (144, 24, 56), (64, 384, 14), (576, 96, 14), (960, 160, 7),
          (320, 1280, 7))


def pair(c: int, o: int) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The dense 1x1 conv, and its low-rank layer at half its parameters twice (same cores)."""
    dense = nn.Conv2d(c, o, 1, bias=False)
    rank = max(1, (c * o) // (2 * (c + o)))
    now = tnspec.formats.build("low_rank", c, o, 1, rank=rank).layer()
    return dense, copy.deepcopy(now), now


def plan(before: nn.Module, now: nn.Module, shape: tuple[int, ...]) -> None:
    """Plan both for ``shape``, trained and served: ``before`` as trees before these changes
    planned it, the identity relations hidden from the chooser and one class for both modes
    (the one planned and timed for training, set in the served class's place)."""
    x = torch.randn(shape)
    with mock.patch.object(Problem, "identities", lambda self, convs: False):
        before(x).sum().backward()
    trained = before._key(tuple(shape), False)
    with torch.no_grad():
        served = before._key(tuple(shape), False)
        before._classes[served], before._plans[served] = \
            before._classes[trained], before._plans[trained]
    now(x).sum().backward()
    with torch.no_grad():
        now(x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 3 rounds")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    layers = ((8, 16, 6), (16, 8, 6)) if args.smoke else LAYERS
    rounds = 3 if args.smoke else args.rounds
    print(machine())
    print("\n| 1x1 conv | input | dense ms | before / dense | now / dense |\n"
          "|---|---|---|---|---|")
    for c, o, size in layers:
        dense, before, now = pair(c, o)
        for label, batch, train in (("serve, batch 1", 1, False), ("serve, batch 32", 32, False),
                                    ("train, batch 8", 8, True)):
            shape = (batch, c, size, size)
            plan(before, now, shape)
            x = torch.randn(shape, requires_grad=train)

            def served(m: nn.Module) -> object:
                def run() -> None:
                    with torch.no_grad():
                        m(x)
                return run
            runs = [(fwd_bwd if train else lambda m, x: served(m))(m, x)
                    for m in (dense, before, now)]
            times = [statistics.median(t) for t in interleaved(runs, rounds)]
            print(f"| {c} -> {o} at {size}x{size} | {label} | {times[0] * 1e3:.3f} | "
                  f"{times[1] / times[0]:.2f} | {times[2] / times[0]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
