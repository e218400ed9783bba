"""What the experiments share: the digits data, a training loop, progress bars, tables."""

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
        model.eval()
        with torch.no_grad():
            logits = model(x_te)
            test_loss = loss_fn(logits, y_te).item()
            acc = (logits.argmax(1) == y_te).float().mean().item()
        hist.train_loss.append(total / seen)
        hist.test_loss.append(test_loss)
        hist.test_acc.append(acc)
        if not math.isfinite(total):
            break  # diverged: the remaining epochs would only repeat NaN
    return hist


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table; floats with 3 decimals."""
    def cell(v: object) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def environment() -> str:
    """One line naming the machine and versions the numbers were measured with."""
    import sklearn
    cpu = " ".join(filter(None, (platform.machine(), platform.processor())))
    return (f"{cpu}, {torch.get_num_threads()} "
            f"threads, Python {platform.python_version()}, torch {torch.__version__}, "
            f"tnspec {tnspec.__version__}, scikit-learn {sklearn.__version__}")


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
