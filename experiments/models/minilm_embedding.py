"""all-MiniLM-L6-v2's word-embedding table (30,522 x 384, 52% of the model) as a TT or TR
embedding fitted to it (``Layer.fit_`` through ``tnspec.tensorize(weights="fit")``) at 10x, 30x
and 100x fewer parameters, against the truncated SVD of the table at the same parameters.

Measured as ``experiments.models.minilm_compress`` measures (Rotten Tomatoes probe on mean-pooled
embeddings, cosine to the original model's). TensorGPT reports GPT-2's table 38x smaller with
TT: compare at equal ratios.

    python -m experiments.models.minilm_embedding           # ~20 min on 2 cores
    python -m experiments.models.minilm_embedding --smoke
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import tnspec

from .. import assets
from ..common import markdown_table, save
from .minilm_compress import embeddings, probe

TABLE = "embeddings.word_embeddings"
RATIOS = (10, 30, 100)


def svd_table(model: nn.Module, ratio: float) -> nn.Module:
    """The table as the product of its truncated SVD, ``ratio`` times fewer parameters."""
    model = copy.deepcopy(model)
    table = model.get_submodule(TABLE)
    w = table.weight.detach().double()
    rank = max(1, round(w.numel() / ratio / sum(w.shape)))
    u, s, vh = torch.linalg.svd(w, full_matrices=False)

    class LowRankEmbedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rows = nn.Embedding.from_pretrained((u[:, :rank] * s[:rank]).float(),
                                                     freeze=False,
                                                     padding_idx=table.padding_idx)
            self.out = nn.Parameter(vh[:rank].float())

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.rows(ids) @ self.out
    parent, _, child = TABLE.rpartition(".")
    setattr(model.get_submodule(parent), child, LowRankEmbedding())
    return model


def table_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.get_submodule(TABLE).parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version")
    args = parser.parse_args(argv)
    started = time.time()
    torch.manual_seed(0)
    model, tokenizer = assets.minilm()
    texts, labels = assets.rotten_tomatoes()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0))
    n_train, n_test = (64, 64) if args.smoke else (2000, 2000)
    train_idx, test_idx = order[:n_train], order[n_train:n_train + n_test]
    train_texts, test_texts = [texts[i] for i in train_idx], [texts[i] for i in test_idx]
    y_train, y_test = labels[train_idx], labels[test_idx]
    reference = embeddings(model, tokenizer, test_texts)
    dense = table_params(model)

    def measure(m: nn.Module) -> tuple[float, float]:
        tr = embeddings(m, tokenizer, train_texts)
        te = embeddings(m, tokenizer, test_texts)
        return probe(tr, y_train, te, y_test), \
            float(nn.functional.cosine_similarity(te, reference).mean())

    acc, _ = measure(model)
    rows = [("original", "1x", f"{dense:,}", "-", acc, 1.0, "-")]
    ratios = (100,) if args.smoke else RATIOS
    fit = {"max_seconds": 5 if args.smoke else 120, "hops": 0, "starts": 1}
    for ratio in ratios:
        for fmt in ("tt", "tr", "svd"):
            t = time.time()
            if fmt == "svd":
                made, error = svd_table(model, ratio), "-"
            else:
                made, report = tnspec.tensorize(copy.deepcopy(model), fmt, rank=1 / ratio,
                                                include=TABLE, weights="fit", fit=fit)
                error = f"{report.replaced[0].fit_error:.3f}"
            seconds = time.time() - t
            params = table_params(made)
            acc, cos = measure(made)
            rows.append((fmt, f"{dense / params:.0f}x", f"{params:,}", error, acc, cos,
                         f"{seconds:.0f}"))
            print(rows[-1], flush=True)
    text = ("# all-MiniLM-L6-v2's word embeddings factorized: Rotten Tomatoes probe and cosine\n\n"
            f"{n_train:,} training / {n_test:,} test snippets (fixed split). The table is "
            f"{dense:,} parameters; the rest of the model is unchanged.\n\n"
            + markdown_table(["table", "fewer parameters", "parameters",
                              "table fit error", "probe accuracy", "cosine to original",
                              "seconds to fit"], rows))
    print(text)
    if not args.smoke:  # a smoke run writes nothing
        print(f"wrote {save('minilm_embedding', text, started)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
