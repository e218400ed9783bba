"""Fine-tuning all-MiniLM-L6-v2 on Rotten Tomatoes (fresh vs rotten) with adapters on every
linear layer of the encoder and a new linear head on the mean-pooled embedding (trained in
full): tnspec's low_rank, cp, tucker2, tt and tr against PEFT's LoRA, LoHa and LoKr, at about the
same trainable parameters, on the same batches, one learning rate (AdamW 1e-3), 3 seeds.

    python -m experiments.models.minilm_adapters            # ~40 min alone on 2 cores
    python -m experiments.models.minilm_adapters --smoke
    python -m experiments.models.minilm_adapters --seeds 2 --rates 1e-3 3e-3 1e-2 \\
        --methods tt "tt +rule" tr "tr +rule" LoRA   # the step rule at three rates
    python -m experiments.models.minilm_adapters --seeds 3 --rates 1e-3 3e-3 1e-2 \\
        --methods "tt offset" "tr offset" "tt_lora offset" LoRA \\
        --out minilm_adapters_offset                 # adapt(init="offset") at three rates
    python -m experiments.models.minilm_adapters --seeds 1 --rates 3e-3 1e-2 \\
        --methods "tt offset" "tr offset" --scale 0.1 \\
        --out minilm_adapters_offset_scale           # the offset init at a tenth of the scale
    python -m experiments.models.minilm_adapters --seeds 1 --rates 1e-3 3e-3 \\
        --methods "low_rank principal" "tt principal" PiSSA LoRA \\
        --out minilm_adapters_principal              # the principal start against PiSSA
    python -m experiments.models.minilm_adapters --seeds 3 --rates 1e-3 3e-3 \\
        --methods "tt default" "tr default" "tt_lora default" LoRA --share 0.006 \\
        --peft-r 8 --out minilm_adapters_half  # at a fifth of PEFT LoRA's default r=8
    python -m experiments.models.minilm_adapters --seeds 3 --curve 25 --methods \\
        "low_rank zero" "low_rank principal" "tucker2 zero" "tucker2 principal" \\
        "tt zero" "tt principal" "tr zero" "tr principal" \\
        --out minilm_adapters_curve   # how many steps the principal start needs
    python -m experiments.models.minilm_adapters --seeds 1 --rates 1e-3 3e-3 1e-2 \\
        --methods "low_rank default" "cp default" "tt default" "tr default" \\
        "tt_lora default" LoRA --out minilm_adapters_multiplier  # the drawn scale a multiplier
    python -m experiments.models.minilm_adapters --seeds 2 --rates 1e-3 3e-3 1e-2 \\
        --methods "low_rank default" "cp default" "tt default" "tr default" \\
        "tt_lora default" LoRA --out minilm_adapters_multiplier_2seeds  # the same, 2 seeds
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import tnspec

from .. import assets
from ..common import markdown_table, save

TNSPEC = ("low_rank", "cp", "tucker2", "tt", "tr")
PEFT = ("LoRA", "LoHa", "LoKr", "PiSSA")
SHARE = 0.011  # the adapters' share of each layer's parameters (tnspec's float rank)


class Classifier(nn.Module):
    """The encoder, mean pooling over the tokens, a linear head."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(384, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                **other: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                              **other).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden)
        return self.head((hidden * mask).sum(1) / mask.sum(1))


def targets(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".encoder.layer." in f".{n}"]


def peft_model(base: Classifier, method: str, r: int) -> nn.Module:
    import peft
    names = targets(base)
    config = {"LoRA": lambda: peft.LoraConfig(r=r, lora_alpha=r, target_modules=names,
                                              modules_to_save=["head"]),
              "LoHa": lambda: peft.LoHaConfig(r=r, alpha=r, target_modules=names,
                                              modules_to_save=["head"]),
              "LoKr": lambda: peft.LoKrConfig(r=r, alpha=r, target_modules=names,
                                              modules_to_save=["head"]),
              "PiSSA": lambda: peft.LoraConfig(r=r, lora_alpha=r, target_modules=names,
                                               modules_to_save=["head"],
                                               init_lora_weights="pissa")}[method]()
    return peft.get_peft_model(base, config)


def matched_rank(base: Classifier, method: str, trainable: int) -> int:
    """PEFT's ``r`` whose trainable parameters come nearest ``trainable``."""
    best = None
    for r in range(1, 17):
        n = sum(p.numel() for p in peft_model(copy.deepcopy(base), method, r).parameters()
                if p.requires_grad)
        if best is None or abs(n - trainable) < abs(best[1] - trainable):
            best = (r, n)
    return best[0]


def accuracy(model: nn.Module, test: list[dict], y_test: torch.Tensor) -> float:
    """Held-out accuracy, the model in eval mode and back in training mode after."""
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(**b).argmax(1) for b in test])
    model.train()
    return float((pred == y_test).float().mean())


def run(model: nn.Module, batches: list[dict], test: list[dict], y_test: torch.Tensor,
        lr: float = 1e-3, every: int = 0
        ) -> tuple[float, float, float, list[tuple[int, float]]]:
    """Train on ``batches``; ``(test accuracy, final training loss, ms per step, curve)``; a
    loss that is not finite ends the training (the final loss reads nan). With ``every``, the
    curve holds ``(step, held-out accuracy)`` after every that many steps and at the end
    (measured outside the timed steps); else it is empty."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    spent, curve = 0.0, []
    for step, batch in enumerate(batches, 1):
        start = time.perf_counter()
        labels = batch.pop("labels")
        loss = nn.functional.cross_entropy(model(**batch), labels)
        batch["labels"] = labels
        if not torch.isfinite(loss):
            losses.append(float("nan"))
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        spent += time.perf_counter() - start
        if every and step % every == 0 and step < len(batches):
            curve.append((step, accuracy(model, test, y_test)))
    final = accuracy(model, test, y_test)
    if every:
        curve.append((len(batches), final))
    model.eval()
    return final, statistics.mean(losses[-20:]), 1000 * spent / len(batches), curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version")
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds (3)")
    parser.add_argument("--steps", type=int, default=200, help="training steps (200)")
    parser.add_argument("--test", type=int, default=1000, help="held-out snippets (1000)")
    parser.add_argument("--rates", type=float, nargs="+", default=[1e-3],
                        help="AdamW learning rates (1e-3)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="a subset: tnspec formats (followed by ' +rule': with "
                        "step_rule='spectral'; by ' offset' or ' principal': with that "
                        "init; by ' default': adapt's own init and scale) and LoRA, LoHa, "
                        "LoKr, PiSSA")
    parser.add_argument("--out", default=None, help="the results file's name")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="adapt's scale= for the tnspec adapters (1.0)")
    parser.add_argument("--share", type=float, default=SHARE,
                        help=f"the tnspec adapters' share of each layer ({SHARE})")
    parser.add_argument("--peft-r", type=int, default=None,
                        help="PEFT's r (default: the r whose trainable parameters come "
                        "nearest the first tnspec method's)")
    parser.add_argument("--curve", type=int, default=0,
                        help="also the held-out accuracy every that many steps, and the step "
                        "at which each principal start reaches its format's zero start's "
                        "final accuracy (0: no curve)")
    args = parser.parse_args(argv)
    started = time.time()
    encoder, tokenizer = assets.minilm()
    texts, labels = assets.rotten_tomatoes()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0))
    steps, n_test, seeds = (2, 32, (0,)) if args.smoke else \
        (args.steps, args.test, tuple(range(args.seeds)))
    methods = tuple(args.methods) if args.methods else \
        ("tt", "LoRA") if args.smoke else (*TNSPEC, *PEFT)
    rates = tuple(args.rates)
    test_idx = order[:n_test]

    def tokens(idx: torch.Tensor) -> dict:
        out = dict(tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                             max_length=48, return_tensors="pt"))
        out["labels"] = labels[idx]
        return out
    test = [tokens(test_idx[i:i + 128]) for i in range(0, n_test, 128)]
    for b in test:
        b.pop("labels")
    y_test = labels[test_idx]
    pool = order[n_test:]
    results: dict[tuple[str, float], list[tuple[float, float, float, int]]] = {
        (m, lr): [] for m in methods for lr in rates}
    curves: dict[tuple[str, float], list[list[tuple[int, float]]]] = {
        key: [] for key in results}
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        batches = [tokens(pool[torch.randint(0, len(pool), (16,), generator=gen)])
                   for _ in range(steps)]
        torch.manual_seed(seed)
        base = Classifier(copy.deepcopy(encoder))  # the same head init for every method
        reference = None
        for method in methods:
            fmt, *flags = method.split()
            for lr in rates:
                model = copy.deepcopy(base)
                if fmt in tnspec.formats.NAMES:
                    start = {} if "default" in flags else dict(
                        init="offset" if "offset" in flags else
                        "principal" if "principal" in flags else "zero", scale=args.scale)
                    model, report = tnspec.adapt(
                        model, fmt, rank=args.share, include=lambda n, m: n in targets(base),
                        modules_to_save=["head"],
                        step_rule="spectral" if "+rule" in flags else None, **start)
                    reference = reference or report.trainable
                else:
                    r = args.peft_r or matched_rank(base, method, reference or 120_000)
                    model = peft_model(model, method, r)
                trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
                acc, loss, ms, curve = run(model, copy.deepcopy(batches), test, y_test, lr,
                                           args.curve)
                results[(method, lr)].append((acc, loss, ms, trainable))
                curves[(method, lr)].append(curve)
                print(seed, method, lr, trainable, f"{acc:.3f}", f"{loss:.3f}",
                      f"{ms:.0f} ms", flush=True)
    rows = []
    for (method, lr), runs in results.items():
        accs = [r[0] for r in runs]
        rows.append(((("tnspec " if method not in PEFT else "PEFT ") + method),
                     *((f"{lr:g}",) if len(rates) > 1 else ()),
                     f"{runs[0][3]:,}", statistics.mean(accs),
                     statistics.pstdev(accs) if len(accs) > 1 else 0.0,
                     ", ".join(f"{a:.3f}" for a in accs),
                     statistics.mean(r[1] for r in runs),
                     f"{statistics.median(r[2] for r in runs):.0f}"))
    rate_text = ", ".join(f"{lr:g}" for lr in rates)
    text = ("# all-MiniLM-L6-v2 fine-tuned on Rotten Tomatoes with adapters\n\n"
            f"Adapters on the encoder's 36 linear layers and a new linear head on the "
            f"mean-pooled embedding (trained in full); {steps} steps of 16 snippets (at most "
            f"48 tokens), AdamW {rate_text}, seeds {', '.join(map(str, seeds))}; accuracy on "
            f"{n_test:,} held-out snippets (0.5 is chance). Trainable parameters include the "
            "head (770). +rule: `adapt(step_rule=\"spectral\")`; offset, principal: "
            f"`adapt(init=...)`; tnspec's scale={args.scale:g}; default: `adapt` unasked "
            f"(its init and scale); tnspec's share of each layer {args.share:g}"
            + (f", PEFT's r={args.peft_r}" if args.peft_r else "")
            + ". Final train loss: the mean of the last 20 steps; nan where a loss was not "
            "finite.\n\n"
            + markdown_table(["method", *(["lr"] if len(rates) > 1 else []), "trainable",
                              "accuracy (mean)", "std", "per seed", "final train loss",
                              "ms per step"], rows))
    if args.curve:
        text += "\n\n" + curve_tables(curves, rates)
    print(text)
    if not args.smoke:  # a smoke run writes nothing
        name = args.out or ("minilm_adapters" if rates == (1e-3,) and not args.methods else
                            "minilm_adapters_rates")
        print(f"wrote {save(name, text, started)}")
    return 0


def curve_tables(curves: dict[tuple[str, float], list[list[tuple[int, float]]]],
                 rates: tuple[float, ...]) -> str:
    """The held-out accuracy along training (mean over seeds) of every method, and for each
    ``<format> principal`` run beside ``<format> zero`` at the same rate, the first step at
    which its mean accuracy reaches the zero start's final mean accuracy."""
    steps = [s for s, _ in next(iter(curves.values()))[0]]
    mean = {key: [statistics.mean(run[k][1] for run in runs) for k in range(len(steps))]
            for key, runs in curves.items() if runs and all(len(r) == len(steps) for r in runs)}
    rows = [(method, *((f"{lr:g}",) if len(rates) > 1 else ()), *(f"{a:.3f}" for a in accs))
            for (method, lr), accs in mean.items()]
    text = ("Held-out accuracy along training, mean over seeds (the last column is the "
            "table's):\n\n" + markdown_table(
                ["method", *(["lr"] if len(rates) > 1 else []), *(f"step {s}" for s in steps)],
                rows))
    reached = []
    for (method, lr), accs in mean.items():
        fmt, *flags = method.split()
        zero = mean.get((f"{fmt} zero", lr))
        if flags != ["principal"] or zero is None:
            continue
        first = next((s for s, a in zip(steps, accs) if a >= zero[-1]), None)
        reached.append((fmt, *((f"{lr:g}",) if len(rates) > 1 else ()), f"{zero[-1]:.3f}",
                        f"{accs[-1]:.3f}", "not reached" if first is None else str(first),
                        "" if first is None else f"{first / steps[-1]:.2f}"))
    if reached:
        text += ("\n\nThe step at which the principal start's mean accuracy first reaches the "
                 "zero start's final one (checked every "
                 f"{steps[0]} steps), and that step's share of the {steps[-1]}:\n\n"
                 + markdown_table(["format", *(["lr"] if len(rates) > 1 else []),
                                   "zero start, final", "principal, final", "principal "
                                   "reaches it at step", "share of the steps"], reached))
    return text


if __name__ == "__main__":
    raise SystemExit(main())
