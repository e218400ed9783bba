"""Why a TT linear layer cannot come within 1.05x of ``nn.Linear`` on this CPU: its parts timed.

    python benchmarks/linear_floor.py     # RESULTS.md, "TT-linear 784->500: the floor"

The layer ``x[b, (i0 i1)], A[i0, o0, r], B[r, i1, o1] -> y[b, (o0 o1)]`` (28 x 28 -> 20 x 25,
r = 10, batch 128) run reconstruct-first is ``nn.Linear``'s work plus building the 500 x 784
weight from the cores and taking its gradient back to them. This times, interleaved, forward
and backward: ``nn.Linear``, the tnspec layer held to that order, the weight build alone (one
matmul of K = r, one permuted copy, their backward), the matmul alone, and the copy alone.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import interleaved, machine, steady_malloc  # noqa: E402

import tnspec  # noqa: E402

I0, I1, O0, O1, R, BATCH = 28, 28, 20, 25, 10, 128


def main() -> None:
    print(machine())
    print(steady_malloc())
    torch.manual_seed(0)
    layer = tnspec.layer("x[b, (i0 i1)], A[i0, o0, r], B[r, i1, o1] -> y[b, (o0 o1)]",
                         i0=I0, i1=I1, o0=O0, o1=O1, r=R, planner="dense-first",
                         autotune=False)
    dense = nn.Linear(I0 * I1, O0 * O1)
    x = torch.randn(BATCH, I0 * I1, requires_grad=True)
    grad_y = torch.randn(BATCH, O0 * O1)
    grad_w = torch.randn(O0 * O1, I0 * I1)
    a, b = layer.A, layer.B

    def product() -> torch.Tensor:  # as the generated code builds it
        return torch.matmul(a.permute(1, 0, 2).reshape(O0 * I0, R),
                            b.permute(0, 2, 1).reshape(R, O1 * I1))

    def weight() -> torch.Tensor:
        return product().reshape(O0, I0, O1, I1).permute(0, 2, 1, 3).reshape(O0 * O1, I0 * I1)

    runs = {
        "nn.Linear": lambda: torch.autograd.grad(dense(x), [x, *dense.parameters()], grad_y),
        "tnspec, reconstruct-first": lambda: torch.autograd.grad(
            layer(x), [x, *layer.parameters()], grad_y),
        "the weight build alone": lambda: torch.autograd.grad(weight(), [a, b], grad_w),
        "its matmul alone": lambda: torch.autograd.grad(
            product(), [a, b], grad_w.view(O0 * I0, O1 * I1)),
        "its permuted copy alone": lambda: grad_w.view(O0, O1, I0, I1).permute(
            0, 2, 1, 3).contiguous(),
    }
    for run in runs.values():
        run()
    times = interleaved(list(runs.values()), 41)
    base = statistics.median(times[0])
    print(f"forward + backward, median of 41 interleaved rounds, batch {BATCH}")
    for name, t in zip(runs, times):
        med = statistics.median(t)
        print(f"{name:>26} {med * 1e3:7.3f} ms  {med / base:5.2f}x nn.Linear")


if __name__ == "__main__":
    main()
