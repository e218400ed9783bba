"""Channel mixing as a product: ``torch.bmm`` / ``torch.mm`` over views against ``torch.einsum``.

    python benchmarks/mixing.py                  # RESULTS.md, "Channel mixing: bmm against einsum"
    python benchmarks/mixing.py --channels-last  # channels-last data: torch.mm of its matrix

A channel-mixing step (``x[b, c, h, w] * A[c, r]``, no convolution) that runs as a product is
lowered, over a contiguous input, as ``torch.bmm`` of the weight expanded over the batch and a
view of the data. ``torch.einsum`` permutes such data channels-last and reshapes it, which
copies it, and keeps the copy for backward. This builds each benchmark format's layer (96 ->
96 channels, rank 10, 3x3, batch 32) held to the cost model's order with every mixing step a
product, once as lowered now and once with the einsum (lowering's batched-matmul path turned
off for that build), and times both forward and backward, interleaved, in one process.
With ``--channels-last`` the input is channels-last and the product is ``torch.mm`` of the
``(b h w, c)`` matrix the data is stored as (``Products.matmul_last``) against the einsum that
lowering emitted there before; the ops each dispatches per step are counted too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchors import conv_formats  # noqa: E402
from harness import (Count, activation_bytes, fwd_bwd, interleaved, machine,  # noqa: E402
                     steady_malloc)

import tnspec  # noqa: E402
from tnspec.emit import products, runtime  # noqa: E402

ROUNDS, BATCH = 21, 32


def build(spec: str, sizes: dict, bmm: bool, channels_last: bool = False) -> torch.nn.Module:
    """The layer's generated module, its mixing steps products, lowered with or without the
    (batched) matmul over views of the data (for a ``channels_last`` input, or contiguous)."""
    method = "matmul_last" if channels_last else "matmul"
    keep = getattr(products.Products, method)
    if not bmm:
        setattr(products.Products, method, lambda *a, **k: None)
    try:
        torch.manual_seed(0)  # the same cores both ways
        layer = tnspec.layer(spec, autotune=False, **sizes)
        shape = (BATCH, 96, 32, 32)
        source = runtime.source_of(runtime.layer_class(
            layer.network, layer.plan(shape), channels_last).forward)
    finally:
        setattr(products.Products, method, keep)
    scope: dict = {}
    exec(compile(source, f"<mixing {'bmm' if bmm else 'einsum'}>", "exec"), scope)
    module = scope["TensorNetworkLayer"](**sizes)
    module.load_state_dict(layer.state_dict())
    return module


def contiguous(module: torch.nn.Module, x: torch.Tensor):
    """Forward and backward with a contiguous gradient of the output."""
    inputs = [x, *module.parameters()]
    grad = torch.ones(module(x).shape)

    def run() -> None:
        torch.autograd.grad(module(x), inputs, grad)
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--contiguous-grad", action="store_true",
                        help="hand backward a contiguous gradient (default: one in the "
                        "output's layout, as speed.py does; the einsum's output is "
                        "channels-last strided, so a contiguous gradient costs it a copy)")
    parser.add_argument("--channels-last", action="store_true",
                        help="a channels-last input: torch.mm of its matrix against the einsum")
    args = parser.parse_args(argv)
    rounds, last = args.rounds, args.channels_last
    print(machine())
    print(steady_malloc())
    # every mixing a product
    tnspec.planning.calibration.chooser = lambda *a, **k: lambda step: "einsum"
    torch.manual_seed(0)
    x = torch.randn(BATCH, 96, 32, 32)
    x = x.contiguous(memory_format=torch.channels_last if last else torch.contiguous_format)
    x.requires_grad_()
    mm = "mm" if last else "bmm"
    print(f"forward + backward, median of {rounds} interleaved rounds, input {tuple(x.shape)}"
          f"{' channels-last' if last else ''}, "
          f"{'contiguous gradient' if args.contiguous_grad else 'gradient in the output layout'}")
    print(f"{'format':>10} {'einsum ms':>10} {mm + ' ms':>8} {'ratio':>6} {'einsum MB':>10} "
          f"{mm + ' MB':>7}" + (f" {'einsum ops':>10} {'mm ops':>7}" if last else ""))
    for fmt in conv_formats(96, 96, 10, 3, 1, (6, 4, 4)):
        old, new = (build(fmt.spec, fmt.sizes, bmm, last) for bmm in (False, True))
        torch.testing.assert_close(new(x), old(x), rtol=1e-4, atol=1e-4)
        runs = [contiguous(old, x) if args.contiguous_grad else fwd_bwd(old, x),
                contiguous(new, x) if args.contiguous_grad else fwd_bwd(new, x)]
        for run in runs:
            run()
        a, b = (statistics.median(t) * 1e3 for t in interleaved(runs, rounds))
        mb = [activation_bytes(m, x) / 2**20 for m in (old, new)]
        ops = [_ops(run) for run in runs] if last else []
        print(f"{fmt.name:>10} {a:10.1f} {b:8.1f} {b / a:6.2f} {mb[0]:10.1f} {mb[1]:7.1f}" +
              "".join(f" {n:{w}d}" for n, w in zip(ops, (10, 7))))


def _ops(run) -> int:
    """Ops one forward and backward dispatches."""
    with Count() as counted:
        run()
    return sum(counted.ops.values())


if __name__ == "__main__":
    main()
