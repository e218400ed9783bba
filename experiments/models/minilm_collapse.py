"""Why offset adapters collapse on MiniLM at high rates: the fine-tuning of
``experiments.models.minilm_adapters`` (all-MiniLM-L6-v2, Rotten Tomatoes, 200 steps of 16
snippets, AdamW, a new head trained in full), watched every 10 steps:

- the training loss, and the pooled embedding's spread over a fixed batch of 64 training
  snippets (the mean over features of the std across snippets, over its value before
  training): a collapsed model maps every snippet to one embedding and the head outputs the
  majority class (accuracy 0.598, loss ln 2);
- per kind of layer (query, key, value, attention output, intermediate, output) and per block,
  the adapter's change of the layer's output over the base output, ``||y - base(x)|| /
  ||base(x)||``, on that batch;
- per core name, the move from init, ``||G_t - G_0|| / ||G_0||``, the mean over layers.

    python -m experiments.models.minilm_collapse                  # the four runs, ~8 min
    python -m experiments.models.minilm_collapse --runs "tt_lora offset 3e-3"
    python -m experiments.models.minilm_collapse --smoke
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
from torch import nn

import tnspec

from .. import assets
from ..common import markdown_table, save
from .minilm_adapters import SHARE, Classifier, targets

RUNS = ("tt_lora offset 3e-3", "tt_lora offset 1e-3", "tt_lora zero 3e-3", "tr offset 1e-2")
KINDS = ("query", "key", "value", "attention.output", "intermediate", "output")
EVERY = 10


def kind(name: str) -> str:
    """The kind of an encoder linear layer, from its name."""
    for k in ("query", "key", "value", "attention.output", "intermediate"):
        if k in name:
            return k
    return "output"


def block(name: str) -> int:
    return int(name.split(".layer.")[1].split(".")[0])


def watch(model: nn.Module, batches: list[dict], probe: dict, lr: float
          ) -> list[dict[str, float]]:
    """Train, returning the measurements at step 0 and every ``EVERY`` steps."""
    adapted = {n: m for n, m in model.named_modules() if isinstance(m, tnspec.Adapted)}
    cores0 = {(n, c): p.detach().clone() for n, m in adapted.items()
              for c, p in m.adapters[m.active].named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def measure(step: int, loss: float) -> dict[str, float]:
        ratios: dict[str, float] = {}

        def hook(name: str):
            def record(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
                base = module.base(args[0])
                ratios[name] = float((out - base).norm() / base.norm())
            return record
        handles = [m.register_forward_hook(hook(n)) for n, m in adapted.items()]
        model.eval()
        with torch.no_grad():
            hidden = model.encoder(input_ids=probe["input_ids"],
                                   attention_mask=probe["attention_mask"]).last_hidden_state
        for h in handles:
            h.remove()
        model.train()
        mask = probe["attention_mask"].unsqueeze(-1).to(hidden)
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        row = {"step": step, "loss": loss, "spread": float(pooled.std(0).mean())}
        for k in KINDS:
            row[k] = statistics.mean(v for n, v in ratios.items() if kind(n) == k)
        for b in range(6):
            row[f"block {b}"] = statistics.mean(v for n, v in ratios.items() if block(n) == b)
        moves: dict[str, list[float]] = {}
        for (n, c), p0 in cores0.items():
            p = dict(adapted[n].adapters[adapted[n].active].named_parameters())[c]
            moves.setdefault(c, []).append(float((p.detach() - p0).norm() / p0.norm()))
        row |= {f"move {c}": statistics.mean(v) for c, v in moves.items()}
        return row
    rows = [measure(0, math.nan)]
    losses = []
    for step, batch in enumerate(batches, 1):
        labels = batch.pop("labels")
        loss = nn.functional.cross_entropy(model(**batch), labels)
        batch["labels"] = labels
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % EVERY == 0:
            rows.append(measure(step, statistics.mean(losses[-EVERY:])))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version")
    parser.add_argument("--runs", nargs="+", default=list(RUNS),
                        help="'FORMAT INIT LR' or 'FORMAT INIT LR scale=S'")
    parser.add_argument("--out", default="minilm_collapse", help="the results file's name")
    args = parser.parse_args(argv)
    started = time.time()
    encoder, tokenizer = assets.minilm()
    texts, labels = assets.rotten_tomatoes()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0))
    steps = 20 if args.smoke else 200
    pool = order[1000:]

    def tokens(idx: torch.Tensor) -> dict:
        out = dict(tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                             max_length=48, return_tensors="pt"))
        out["labels"] = labels[idx]
        return out
    gen = torch.Generator().manual_seed(0)
    batches = [tokens(pool[torch.randint(0, len(pool), (16,), generator=gen)])
               for _ in range(steps)]
    probe = tokens(pool[:64])
    torch.manual_seed(0)
    base = Classifier(copy.deepcopy(encoder))
    sections = []
    for spec in args.runs[:1] if args.smoke else args.runs:
        fmt, init, lr, *rest = spec.split()
        scale = float(rest[0].split("=")[1]) if rest else 1.0
        model, _ = tnspec.adapt(copy.deepcopy(base), fmt, rank=SHARE,
                                include=lambda n, m: n in targets(base),
                                modules_to_save=["head"], init=init, scale=scale)
        rows = watch(model, copy.deepcopy(batches), probe, float(lr))
        spread0 = rows[0]["spread"]
        cores = [k for k in rows[0] if k.startswith("move ")]
        shown = [r for r in rows if r["step"] in (0, 10, 20, 30, 50, 100, 150, 200)]
        table = markdown_table(
            ["step", "loss", "spread", *KINDS, *[f"block {b}" for b in range(6)], *cores],
            [(r["step"], r["loss"], r["spread"] / spread0, *(r[k] for k in KINDS),
              *(r[f"block {b}"] for b in range(6)), *(r[c] for c in cores)) for r in shown])
        sections.append(f"## {fmt}, init={init!r}, lr {lr}"
                        + (f", scale={scale:g}" if rest else "") + "\n\n" + table)
        print(sections[-1], flush=True)
    text = ("# Offset adapters on MiniLM, watched\n\n"
            "all-MiniLM-L6-v2 with adapters at 1.1% on the encoder's 36 linear layers and a new "
            f"head, {steps} steps of 16 Rotten Tomatoes snippets, AdamW, seed 0. Every "
            f"{EVERY} steps: the mean training loss of the last {EVERY} steps; the pooled "
            "embedding's spread over 64 fixed snippets, over its value at step 0; per kind of "
            "layer and per block, the adapter's change of the output over the base output "
            "(mean over layers); per core, its move from init (mean over layers).\n\n"
            + "\n\n".join(sections))
    if not args.smoke:
        print(f"wrote {save(args.out, text, started)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
