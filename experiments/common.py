"""What the experiments share: the digits and Fashion-MNIST data, training loops, progress
bars, tables."""

from __future__ import annotations

import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

import tnspec

RESULTS = Path(__file__).resolve().parent / "results"


def digits(seed: int = 0, images: bool = False) -> tuple[torch.Tensor, ...]:
    """scikit-learn's 1,797 8x8 digits, split 80/20 (stratified, fixed seed), standardized
    with the training set's mean and std (one number each, like torchvision's Normalize):
    ``(x_train, y_train, x_test, y_test)``, x as (N, 64) or, with ``images``, (N, 1, 8, 8)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(
        data.data.astype(np.float32), data.target, test_size=0.2, random_state=seed,
        stratify=data.target)
    mean, std = x_tr.mean(), x_tr.std()
    shape = (-1, 1, 8, 8) if images else (-1, 64)
    return (torch.from_numpy((x_tr - mean) / std).reshape(shape), torch.from_numpy(y_tr),
            torch.from_numpy((x_te - mean) / std).reshape(shape), torch.from_numpy(y_te))


def fashion(train: int | None = None, test: int | None = None) -> tuple[torch.Tensor, ...]:
    """Fashion-MNIST as ``(x_train, y_train, x_test, y_test)``, x as (N, 1, 28, 28) standardized
    with the training set's mean and std (one number each): the first ``train`` / ``test``
    images of each split (all 60,000 / 10,000 by default). Raises ``assets.Missing`` naming
    the Debian package where the files are not installed."""
    from . import assets
    x_tr, y_tr = assets.fashion_mnist("train", train)
    x_te, y_te = assets.fashion_mnist("test", test)
    x_tr, x_te = x_tr.float().unsqueeze(1), x_te.float().unsqueeze(1)
    mean, std = x_tr.mean(), x_tr.std()
    return (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te


def progress(items: Iterable, desc: str, total: int | None = None) -> Iterable:
    """A tqdm progress bar on standard error (none when that is not a terminal)."""
    from tqdm import tqdm
    return tqdm(items, desc=desc, total=total, leave=False, dynamic_ncols=True, disable=None)


@dataclass
class History:
    """Per-epoch training loss, test loss and test accuracy (NaN loss once diverged)."""

    train_loss: list[float] = field(default_factory=list)
    test_loss: list[float] = field(default_factory=list)
    test_acc: list[float] = field(default_factory=list)

    @property
    def final_acc(self) -> float:
        return self.test_acc[-1] if self.test_acc else float("nan")


def train(model: nn.Module, data: Sequence[torch.Tensor],
          optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], *,
          epochs: int, batch: int, seed: int) -> History:
    """Train ``model`` with cross-entropy; evaluate on the test split after every epoch."""
    x_tr, y_tr, x_te, y_te = data
    opt = optimizer(model.parameters())
    gen = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    hist = History()
    for _ in range(epochs):
        model.train()
        total, seen = 0.0, 0
        for idx in torch.randperm(len(x_tr), generator=gen).split(batch):
            loss = loss_fn(model(x_tr[idx]), y_tr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, seen = total + loss.item() * len(idx), seen + len(idx)
        test_loss, acc = _evaluate(model, x_te, y_te, loss_fn)
        hist.train_loss.append(total / seen)
        hist.test_loss.append(test_loss)
        hist.test_acc.append(acc)
        if not math.isfinite(total):
            break  # diverged: the remaining epochs would only repeat NaN
    return hist


def train_steps(model: nn.Module, data: Sequence[torch.Tensor],
                optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], *,
                steps: int, batch: int, seed: int, evals: int = 10, probe: int = 2000,
                milestones: Sequence[int] = (), gamma: float = 1.0) -> History:
    """Train ``model`` for ``steps`` steps with cross-entropy, on batches drawn from a fresh
    permutation of the training set each epoch. ``evals`` times, evenly, record the mean
    training loss since the last record and the test loss and accuracy: on the first ``probe``
    test images, the last record on the whole test set (so ``final_acc`` is the test accuracy).
    The learning rate is multiplied by ``gamma`` at each step in ``milestones``."""
    x_tr, y_tr, x_te, y_te = data
    opt = optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, list(milestones), gamma)
    gen = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    hist = History()
    marks = {round(steps * (k + 1) / evals) for k in range(evals)}
    order = torch.empty(0, dtype=torch.long)
    total, seen = 0.0, 0
    model.train()
    for step in range(1, steps + 1):
        if len(order) < batch:
            order = torch.randperm(len(x_tr), generator=gen)
        idx, order = order[:batch], order[batch:]
        loss = loss_fn(model(x_tr[idx]), y_tr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        total, seen = total + loss.item() * len(idx), seen + len(idx)
        if step in marks or not math.isfinite(total):
            n = len(x_te) if step == steps or not math.isfinite(total) else probe
            test_loss, acc = _evaluate(model, x_te[:n], y_te[:n], loss_fn)
            hist.train_loss.append(total / seen)
            hist.test_loss.append(test_loss)
            hist.test_acc.append(acc)
            total, seen = 0.0, 0
            model.train()
            if not math.isfinite(hist.train_loss[-1]):
                break  # diverged: the remaining steps would only repeat NaN
    return hist


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module,
              batch: int = 1000) -> tuple[float, float]:
    model.eval()
    loss, right = 0.0, 0
    with torch.no_grad():
        for xb, yb in zip(x.split(batch), y.split(batch)):
            logits = model(xb)
            loss += loss_fn(logits, yb).item() * len(yb)
            right += int((logits.argmax(1) == yb).sum())
    return loss / len(y), right / len(y)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table; floats with 3 decimals."""
    def cell(v: object) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def formats_chosen(report: tnspec.CompressReport) -> str:
    """``"dense x 6, low_rank x 30"``: how many layers ``compress`` gave each format."""
    counts: dict[str, int] = {}
    for c in report.choices:
        counts[c.chosen.format] = counts.get(c.chosen.format, 0) + 1
    return ", ".join(f"{f} x {n}" for f, n in sorted(counts.items()))


def inference_rows(models: dict[str, nn.Module], batches: dict[str, object], rounds: int,
                   feed: Callable[[nn.Module, object], object]) -> list[tuple[str, ...]]:
    """``(model, batch, ms per forward, x the model named "original")`` rows: ``feed(model,
    batch)`` under ``no_grad``, each model's first call untimed (planning, autotuning), then
    interleaved rounds (every model once per round), medians."""
    times: dict[tuple[str, str], list[float]] = {(m, b): [] for m in models for b in batches}
    with torch.no_grad():
        for model in models.values():
            for batch in batches.values():
                feed(model, batch)
        for _ in range(rounds):
            for (m, b), spent in times.items():
                start = time.perf_counter()
                feed(models[m], batches[b])
                spent.append(time.perf_counter() - start)
    medians = {key: float(np.median(spent)) for key, spent in times.items()}
    return [(m, b, f"{medians[m, b] * 1e3:.1f}", f"{medians[m, b] / medians['original', b]:.2f}")
            for b in batches for m in models]


def environment() -> str:
    """One line naming the machine and versions the numbers were measured with."""
    import sklearn
    cpu = " ".join(filter(None, (platform.machine(), platform.processor())))
    return (f"{cpu}, {torch.get_num_threads()} "
            f"threads, Python {platform.python_version()}, torch {torch.__version__}, "
            f"tnspec {tnspec.__version__}, scikit-learn {sklearn.__version__}")


def svd_factors(w: torch.Tensor, moment: torch.Tensor | None, rank: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, second)``, ``(rank, in)`` and ``(out, rank)`` in float64, whose product
    truncates the weight ``w`` ``(out, in)`` to ``rank``: its SVD (``moment`` None), or that of
    ``W S`` with ``S`` the square root of the inputs' second moment ``moment``, damped by 1% of
    its mean eigenvalue, mapped back by ``S^-1`` (activation-aware SVD, as SVD-LLM and ASVD).
    Written from scratch, apart from tnspec: the baselines the experiments compare with."""
    w = w.double()
    inp = w.shape[1]
    root = inverse = torch.eye(inp, dtype=torch.float64)
    if moment is not None:
        m = moment + 0.01 * moment.diagonal().mean() * torch.eye(inp, dtype=torch.float64)
        values, vectors = torch.linalg.eigh(m)
        root = (vectors * values.sqrt()) @ vectors.T
        inverse = (vectors * values.rsqrt()) @ vectors.T
    u, s, vh = torch.linalg.svd(w @ root, full_matrices=False)
    return vh[:rank] @ inverse, u[:, :rank] * s[:rank]


def save(name: str, text: str, started: float) -> Path:
    """Write ``results/NAME.md`` with the runtime and environment appended."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(f"{text}\n\nRuntime {time.time() - started:.0f} s on {environment()}.\n")
    return path


def plt():
    """matplotlib.pyplot with a non-interactive backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot
    return pyplot
