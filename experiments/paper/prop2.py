"""Proposition 2 validation (paper appendix, Table "Scale change in propagation").

X (32 x 96) times W1 ... W10 (96->200->400->600->800->1000->800->600->400->200->100), every W
drawn from N(0, 1). Scale t = Var(X W1..Wt) / Var(X W1..W(t-1)); Proposition 2 predicts the
contracted size (96, 200, ...). X is Gaussian, or real: 48 standardized digit images (8 x 8)
laid out row-major as 32 rows of 96 values (the paper used CIFAR-10 images), so rows cross
image boundaries and neighbouring features are correlated pixels. A third row uses the raw
pixel values (0-16, mean 4.9): Var(X W) then sees E[x^2] = Var(x) + mean^2, not Var(x).

    python -m experiments.paper.prop2            # 500 rounds each (seconds)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ..common import RESULTS, digits, markdown_table, plt, progress, save

WIDTHS = (96, 200, 400, 600, 800, 1000, 800, 600, 400, 200, 100)


def scales(x: torch.Tensor, gen: torch.Generator, widths=WIDTHS) -> list[float]:
    """The 10 scale changes of one round (float64)."""
    out = []
    for n_in, n_out in zip(widths, widths[1:]):
        y = x @ torch.randn(n_in, n_out, generator=gen, dtype=torch.float64)
        out.append((y.var() / x.var()).item())
        x = y / y.std()  # rescaling changes no ratio and keeps 10 products inside float64
    return out


def run(rounds: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``{"Gaussian": ..., "digits": ..., "digits, raw": ...}``, each (rounds, 10)."""
    from sklearn.datasets import load_digits
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.cat(digits()[::2]).reshape(-1).double()  # all 1,797 images, row-major
    raw = torch.from_numpy(load_digits().data).reshape(-1).double()
    results: dict[str, list[list[float]]] = {"Gaussian": [], "digits": [], "digits, raw": []}
    for _ in progress(range(rounds), "prop2"):
        results["Gaussian"].append(scales(torch.randn(32, 96, generator=gen,
                                                      dtype=torch.float64), gen))
        start = torch.randint(0, len(pixels) // 64 - 48, (1,), generator=gen).item() * 64
        results["digits"].append(scales(pixels[start:start + 32 * 96].reshape(32, 96), gen))
        results["digits, raw"].append(scales(raw[start:start + 32 * 96].reshape(32, 96), gen))
    return {k: np.array(v) for k, v in results.items()}


def table(results: dict[str, np.ndarray]) -> str:
    header = ["Data"] + [f"Scale {t}" for t in range(1, 11)]
    rows = [["Ground truth"] + [str(w) for w in WIDTHS[:-1]]]
    for name, s in results.items():
        rows.append([name] + [f"{m:.1f} ± {d:.1f}" for m, d in zip(s.mean(0), s.std(0))])
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--smoke", action="store_true", help="20 rounds, nothing written")
    args = parser.parse_args(argv)
    started = time.time()
    results = run(20 if args.smoke else args.rounds)
    text = table(results)
    print(text)
    if not args.smoke:
        rounds = len(results["Gaussian"])
        _plot(results)
        print(save("prop2", f"# Scale change in propagation ({rounds} rounds each)\n\n{text}"
                   "\n\n![measured over predicted scale](prop2.png)", started))
    return 0


def _plot(results: dict[str, np.ndarray]) -> None:
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(8, 3.5))
    truth = np.array(WIDTHS[:-1], dtype=float)
    steps = np.arange(1, 11)
    for k, (name, s) in enumerate(results.items()):
        ratio = s / truth
        ax.errorbar(steps + 0.15 * (k - 1), ratio.mean(0), yerr=ratio.std(0), fmt="o",
                    capsize=3, label=name)
    ax.axhline(1, color="grey", lw=0.8)
    ax.set_xticks(steps)
    ax.set_xlabel("scale t")
    ax.set_ylabel("measured / predicted (mean ± std)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "prop2.png", dpi=80)


if __name__ == "__main__":
    raise SystemExit(main())
