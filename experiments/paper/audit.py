"""Will it train from step one? ``tnspec.audit`` on two stacks of the same tensor-train conv.

Eight 64 -> 64 3x3 TT convolutions (the weight ``(out, in, kh, kw)`` as a train of four cores,
ranks 1-8-8-8-1), linear activation, 32x32 inputs:

- TensorLy-Torch's ``FactorizedConv(..., factorization="tt")``, initialized as its API invites:
  ``reset_parameters(std)`` with the std a dense conv would get for a linear activation,
  ``1 / sqrt(in * kh * kw)``. Its ``normal_`` draws each core with ``(std / prod(rank))^(1/4)``,
  so the reconstructed weight's std falls short by ``sqrt(prod of the inner ranks)``;
- the same network written in tnspec, Graph-in initialized.

The audit measures each layer's forward and backward variance ratios; the product over the
stack is what the last layer sees.

    python -m experiments.paper.audit            # seconds (plot: results/audit.png)
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import tnspec

from ..common import markdown_table, plt, save

SPEC = ("x[b, c, h+kh-1, w+kw-1], A[o, r1], B[r1, c, r2], C[r2, kh, r3], D[r3, kw]"
        " -> y[b, o, h, w]")


def stacks(layers: int = 8, channels: int = 64, rank: int = 8) -> dict[str, nn.Module]:
    """The two stacks, built with fixed seeds."""
    import tltorch
    torch.manual_seed(0)
    std = 1 / math.sqrt(channels * 9)  # a dense conv's std for a linear activation
    tl_layers = []
    for _ in range(layers):
        conv = tltorch.FactorizedConv(channels, channels, (3, 3), order=2, padding=1,
                                      factorization="tt", rank=(1, rank, rank, rank, 1))
        conv.reset_parameters(std=std)
        tl_layers.append(conv)
    tn_layers = [tnspec.layer(SPEC, c=channels, o=channels, kh=3, kw=3, r1=rank, r2=rank,
                              r3=rank, activation="linear") for _ in range(layers)]
    return {"TensorLy-Torch TT, reset_parameters(std)": nn.Sequential(*tl_layers),
            "tnspec TT, graph-in": nn.Sequential(*tn_layers)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version (tests)")
    args = parser.parse_args(argv)
    started = time.time()
    layers, size = (3, 8) if args.smoke else (8, 32)
    x = torch.randn(16, 64, size, size, generator=torch.Generator().manual_seed(1))
    audits = {name: tnspec.audit(model, x) for name, model in stacks(layers).items()}
    rows = []
    for name, a in audits.items():
        fwd = math.prod(r["forward"] for r in a.rows)
        bwd = math.prod(r["backward"] for r in a.rows)
        rows.append((name, min(r["forward"] for r in a.rows), max(r["forward"] for r in a.rows),
                     f"{fwd:.3g}", f"{bwd:.3g}"))
    text = ("# Audit: TensorLy-Torch's TT conv next to the same network in tnspec\n\n"
            f"{layers} layers 64 -> 64, 3x3, TT ranks 1-8-8-8-1, linear activation, input "
            f"16 x 64 x {size} x {size} (N(0, 1)).\n\n"
            + markdown_table(["stack", "min forward ratio", "max forward ratio",
                              "product forward", "product backward"], rows)
            + "\n\nPer layer:\n\n"
            + "\n\n".join(f"{name}:\n\n```\n{a}\n```" for name, a in audits.items())
            + "\n\nReading: with Graph-in the product over the stack stays near 1, so the signal"
              " reaches the last layer at its scale; single layers scatter around 1 because the"
              " kernel cores are tiny (D[r3, kw] has 24 entries, whose sample variance is far"
              " from the drawn one); the `predicted` column, from the cores' actual variances,"
              " moves with them but not exactly, since a few entries make products far from"
              " independent. TensorLy-Torch's"
              " `reset_parameters(std)` spreads `std / prod(rank)` over the cores: each layer"
              " shrinks the variance by about the product of the inner ranks (8^3 = 512), and"
              " after a few layers nothing is left to train on.")
    print(text)
    if not args.smoke:
        fig, ax = plt().subplots(figsize=(7, 3.5))
        for name, a in audits.items():
            ax.plot(range(1, layers + 1), [r["forward"] for r in a.rows], "o-", label=name)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(yscale="log", xlabel="layer", ylabel="Var(output) / Var(input)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(save("audit", text, started).with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
