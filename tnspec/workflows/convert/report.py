"""What ``compress`` reports: the candidates fitted per layer, the choice, the totals, the
predicted error, and (where asked) what the sequential refit and the healing pass did."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .heal import Healed


@dataclass(frozen=True)
class Candidate:
    """One fitted option for a layer (``format`` "dense": the layer as it is)."""

    format: str
    share: float
    params: int
    error: float
    seconds: float | None = None  # at the data's shape, where latency was measured


@dataclass(frozen=True)
class Choice:
    """What ``compress`` chose for one layer, and the options it had."""

    name: str
    dense_params: int
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    sensitivity: float
    dense_seconds: float | None = None


@dataclass(frozen=True)
class CompressReport:
    """The choice per layer, the skipped layers, the totals and the objective."""

    budget: float
    choices: tuple[Choice, ...]
    skipped: tuple[tuple[str, str], ...]
    data: bool
    seconds: float
    extra: Mapping[str, Any] = field(default_factory=dict)
    unfitted: int = 0  # candidates max_seconds left no time for
    pruned: int = 0  # candidates not fitted: their format was beaten before (see pruning)
    other: tuple[tuple[str, int, str], ...] = ()  # (kind, count, why) of those never replaced
    over_budget: bool = False  # max_seconds ran out before candidates within budget were fitted
    #: sequential=True: (layer, error before, after) on the compressed model's inputs
    refits: tuple[tuple[str, float, float], ...] = ()
    healed: Healed | None = None  # heal=steps: what the healing pass did
    threads: str = ""  # torch's threads where compress changed them, and why

    @property
    def params_before(self) -> int:
        """The parameters of the layers considered, as they were (dense)."""
        return sum(c.dense_params for c in self.choices)

    @property
    def params_after(self) -> int:
        """Their parameters after ``compress`` (at most ``budget * params_before``)."""
        return sum(c.chosen.params for c in self.choices)

    @property
    def predicted_error(self) -> float:
        """``sqrt(sum_l s_l^2 e_l^2)``: the model's relative output error the allocation
        predicts (layers' errors independent)."""
        return math.sqrt(sum((c.sensitivity * c.chosen.error) ** 2 for c in self.choices))

    def __str__(self) -> str:
        kind = "output" if self.data else "weight"
        width = max([24, *(len(c.name) for c in self.choices)])
        lines = [f"compress: {len(self.choices)} layer(s) at budget {self.budget:.0%}: "
                 f"{self.params_before:,} -> {self.params_after:,} parameters "
                 f"({self.params_after / max(self.params_before, 1):.1%}); predicted model "
                 f"error {self.predicted_error:.4f}; {self.seconds:.0f} s",
                 f"  {'layer':<{width}} {'chosen':<14} {'params':>20} {kind + ' error':>13} "
                 f"{'sensitivity':>11} {'time':>6}"]
        for c in self.choices:
            chosen = c.chosen.format + ("" if c.chosen.format == "dense"
                                        else f" {c.chosen.share:.0%}")
            ratio = "" if c.chosen.seconds is None or not c.dense_seconds else \
                f"{c.chosen.seconds / c.dense_seconds:.2f}x"
            lines.append(f"  {c.name:<{width}} {chosen:<14} "
                         f"{f'{c.dense_params:,} -> {c.chosen.params:,}':>20} "
                         f"{c.chosen.error:>13.4f} {c.sensitivity:>11.3f} {ratio:>6}")
        for name, why in self.skipped:
            lines.append(f"  skipped {name}: {why}")
        if self.pruned:
            lines.append(f"  {self.pruned} candidate(s) not fitted: their format was beaten "
                         "at the layer's two smallest shares, or far behind at the first two "
                         "layers of its kind and shape (prune=False fits them)")
        if self.unfitted:
            lines.append(f"  {self.unfitted} candidate(s) not fitted: max_seconds was spent")
        if self.over_budget:
            lines.append("  over the budget: max_seconds was spent before every layer had a "
                         "candidate small enough; each layer holds its smallest fitted one "
                         "(a larger max_seconds reaches the budget)")
        if self.refits:
            better = sum(after < before for _, before, after in self.refits)
            lines.append(f"  sequential: {len(self.refits)} layer(s) refitted on the compressed "
                         f"model's inputs, {better} improved; their mean output error there "
                         f"{_mean(b for _, b, _ in self.refits):.4f} -> "
                         f"{_mean(a for _, _, a in self.refits):.4f}")
        if self.healed is not None and self.healed.why:
            lines.append(f"  not healed: {self.healed.why}")
        elif self.healed is not None:
            h = self.healed
            lines.append(f"  healed: {h.steps} step(s); distance to the original's outputs "
                         f"{h.before:.4g} -> {h.after:.4g}" +
                         ("" if h.kept else " (not lower: the fitted layers kept)"))
        if self.threads:
            lines.append(f"  ran on {self.threads}")
        for kind, n, why in self.other:
            lines.append(f"  left alone {n} x {kind}: {why}")
        return "\n".join(lines)

    def plot(self, path: str | None = None) -> Any:
        """Per layer, the candidates' error against their parameters (the Pareto front) and the
        choice; saved to ``path`` when given. Needs matplotlib. Returns the figure."""
        import matplotlib.pyplot as plt
        n = len(self.choices)
        cols = min(n, 4)
        fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(3.2 * cols,
                                 2.6 * ((n + cols - 1) // cols)), squeeze=False)
        for ax, c in zip(axes.flat, self.choices):
            for fmt in sorted({k.format for k in c.candidates} - {"dense"}):
                pts = [(k.params, k.error) for k in c.candidates if k.format == fmt]
                ax.plot(*zip(*sorted(pts)), marker=".", label=fmt)
            ax.plot([c.chosen.params], [c.chosen.error], "k*", markersize=12, label="chosen")
            ax.axvline(c.dense_params, color="grey", ls=":")
            ax.set(title=c.name, xscale="log", xlabel="parameters", ylabel="error")
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=6)
        fig.tight_layout()
        if path:
            fig.savefig(path, dpi=120)
        return fig


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / max(len(values), 1)
