"""Fine-tuning with tensor-network adapters (``tnspec.adapt``) against full fine-tuning, LoRA
and PEFT's LoRA/LoHa/LoKr, on scikit-learn's digits.

A CNN (conv 1->64, conv 64->256, 2x2 max-pool, conv 256->256, linear 4096->10, ReLUs; 0.78 M
parameters) and an MLP (64->1024->1024->10, ReLUs; 1.13 M) are trained on upright digits
(Adam, lr 1e-3, 20 epochs), then adapted to the same digits rotated by 90 degrees (the shifted
task; accuracy before adapting is shown). Every linear and conv layer but the 1-channel stem
gets an adapter with a share of its parameters (0.5%, 2%, 8%: the largest rank within it, per
layer; a layer where rank 1 is over it gets none); the rest is frozen. tnspec adapters:
low_rank (LoRA under tnspec's init rule), tt, tr, tucker2, cp; PEFT's LoRA, LoHa and LoKr
(where peft is installed) at the largest rank whose total stays within the same share of the
adapted layers. Adam, 10 epochs, batch 64, 3 seeds; the learning rate of each method is chosen
on seed 0 at 2%, by accuracy on a validation split of the training digits, from (3e-3, 1e-2)
for adapters and (1e-3, 3e-3) for full fine-tuning.

Reported: test accuracy (mean, min-max), the steps to reach 95% of the run's final accuracy
(evaluated every 10 steps), and one training step's time at batch 256 relative to the frozen
base's forward and backward (interleaved rounds, medians).

    python -m experiments.models.adapters               # about 30 minutes (plot: results/adapters.png)
    python -m experiments.models.adapters --geometries  # seconds: merge errors over conv geometries
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time
import warnings
from typing import Callable

import torch
from torch import nn

import tnspec

from ..common import digits, markdown_table, plt, save

TNSPEC = ("low_rank", "tt", "tr", "tucker2", "cp")
PEFT = ("peft-lora", "peft-loha", "peft-lokr")
SHARES = (0.005, 0.02, 0.08)
RATES = {"full": (1e-3, 3e-3)}  # adapters: (3e-3, 1e-2)


# (a base layer, the input shape) over what nn.Conv1d/2d/3d and nn.Linear accept: the matrix
# tests/workflows/test_adapters.py checks tnspec's adapters on, and --geometries runs PEFT's through
GEOMETRIES = {
    "linear": (lambda: nn.Linear(12, 10), (5, 12)),
    "linear-3d-input": (lambda: nn.Linear(12, 10, bias=False), (2, 3, 12)),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, padding=1), (2, 4, 11)),
    "conv1d-stride-dilation-circular": (
        lambda: nn.Conv1d(4, 8, 5, stride=2, dilation=2, padding=3, padding_mode="circular"),
        (2, 4, 13)),
    "conv2d-same-reflect": (lambda: nn.Conv2d(4, 8, 3, padding="same", padding_mode="reflect"),
                            (2, 4, 7, 6)),
    "conv2d-same-even-kernel": (lambda: nn.Conv2d(4, 8, 4, padding="same"), (2, 4, 7, 7)),
    "conv2d-groups-replicate": (
        lambda: nn.Conv2d(8, 8, 3, groups=2, padding=1, padding_mode="replicate"), (2, 8, 6, 6)),
    "conv2d-stride-dilation-groups": (
        lambda: nn.Conv2d(8, 16, 3, stride=2, dilation=2, padding=2, groups=4, bias=False),
        (2, 8, 9, 9)),
    "conv2d-depthwise": (lambda: nn.Conv2d(8, 16, 3, groups=8, padding=1), (2, 8, 5, 5)),
    "conv2d-valid": (lambda: nn.Conv2d(4, 6, (3, 2), padding="valid"), (2, 4, 6, 5)),
    "conv3d-circular": (lambda: nn.Conv3d(4, 6, 3, padding=1, padding_mode="circular"),
                        (2, 4, 4, 5, 4)),
    "conv3d-anisotropic": (lambda: nn.Conv3d(4, 8, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1)),
                           (2, 4, 3, 7, 7)),
}


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 64, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(64, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(256 * 4 * 4, 10))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                         nn.ReLU(), nn.Linear(1024, 10))


def rotated(data: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    x_tr, y_tr, x_te, y_te = data
    return (torch.rot90(x_tr, 1, (2, 3)).contiguous(), y_tr,
            torch.rot90(x_te, 1, (2, 3)).contiguous(), y_te)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def fit(model: nn.Module, data: tuple[torch.Tensor, ...], lr: float, epochs: int, seed: int,
        every: int = 10) -> list[tuple[int, float]]:
    """Adam on the trainable parameters; ``[(step, test accuracy)]`` every ``every`` steps."""
    x_tr, y_tr, x_te, y_te = data
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    curve, step = [(0, accuracy(model, x_te, y_te))], 0
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x_tr), generator=gen).split(64):
            loss = nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % every == 0:
                curve.append((step, accuracy(model, x_te, y_te)))
    if step % every:
        curve.append((step, accuracy(model, x_te, y_te)))
    return curve


def peft_available() -> bool:
    return importlib.util.find_spec("peft") is not None


def _targets(model: nn.Module) -> list[str]:
    """Every linear and conv layer but a 1-channel stem (too small for any adapter)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) or
            (isinstance(m, nn.Conv2d) and m.in_channels > 1)]


def _peft(model: nn.Module, method: str, r: int) -> nn.Module:
    import peft
    targets = _targets(model)
    config = {"peft-lora": lambda: peft.LoraConfig(r=r, lora_alpha=r, target_modules=targets),
              "peft-loha": lambda: peft.LoHaConfig(r=r, alpha=r, target_modules=targets),
              "peft-lokr": lambda: peft.LoKrConfig(r=r, alpha=r, target_modules=targets),
              # PiSSA: A and B the principal singular part, the base holds the residual
              "peft-pissa": lambda: peft.LoraConfig(r=r, lora_alpha=r, target_modules=targets,
                                                    init_lora_weights="pissa"),
              "peft-dora": lambda: peft.LoraConfig(r=r, lora_alpha=r, target_modules=targets,
                                                   use_dora=True)}
    return peft.get_peft_model(model, config[method]())


def adapted(base: nn.Module, method: str, share: float) -> nn.Module:
    """``base`` (copied) with ``method``'s adapters at ``share`` of its parameters."""
    model = copy.deepcopy(base)
    if method == "full":
        return model.requires_grad_(True)
    if method in tnspec.formats.NAMES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # modes of small channel counts
            return tnspec.adapt(model, method, rank=share, include=_targets(model),
                                init="zero")[0]
    budget = share * sum(base.get_submodule(n).weight.numel() for n in _targets(base))
    best = None
    for r in range(1, 65):  # the largest rank within the budget
        candidate = _peft(copy.deepcopy(base), method, r)
        if sum(p.numel() for p in candidate.parameters() if p.requires_grad) > budget:
            break
        best = candidate
    return best if best is not None else _peft(model, method, 1)


def trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def steps_to(curve: list[tuple[int, float]], fraction: float = 0.95) -> int:
    final = curve[-1][1]
    return next(step for step, acc in curve if acc >= fraction * final)


def step_times(models: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor,
               rounds: int) -> dict[str, float]:
    """Median seconds of one training step per model, interleaved; "frozen base": forward and
    backward (to the input) of the base with nothing trained."""
    def step(model: nn.Module) -> Callable[[], None]:
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=1e-3) if params else None
        xin = x.clone().requires_grad_(not params)

        def run() -> None:
            loss = nn.functional.cross_entropy(model(xin), y)
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            else:
                xin.grad = None
        return run
    runs = {name: step(m) for name, m in models.items()}
    for run in runs.values():  # warm-up: plans, autotuning, allocator
        for _ in range(3):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def geometry_table() -> str:
    """Each method over GEOMETRIES: the relative error of the merged model against the adapted
    one (adapter cores random, rank 2), or why it does not run."""
    import peft
    methods: dict[str, Callable[[nn.Module], nn.Module]] = {
        f"tnspec {f}": (lambda m, f=f: tnspec.adapt(m, f, rank=2, init="zero")[0]) for f in ("low_rank", "tt")}
    methods.update({
        "PEFT LoRA": lambda m: peft.get_peft_model(m, peft.LoraConfig(
            r=2, target_modules=["0"], init_lora_weights=False)),
        "PEFT LoHa": lambda m: peft.get_peft_model(m, peft.LoHaConfig(
            r=2, target_modules=["0"], init_weights=False)),
        "PEFT LoKr": lambda m: peft.get_peft_model(m, peft.LoKrConfig(
            r=2, target_modules=["0"], init_weights=False))})
    rows = []
    for geometry, (make, shape) in GEOMETRIES.items():
        row = [f"`{make()!r}`".replace("|", "/")]
        for name, method in methods.items():
            torch.manual_seed(0)
            x = torch.randn(shape)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = method(nn.Sequential(make()))
                    if name.startswith("tnspec"):
                        with torch.no_grad():
                            for p in model.parameters():
                                if p.requires_grad:
                                    p.normal_()
                    y = model(x)
                    model(x[0])  # unbatched input
                    merged = (tnspec.merge_adapters(model) if name.startswith("tnspec")
                              else model.merge_and_unload())
                    row.append(f"{((merged(x) - y).norm() / y.norm()).item():.0e}")
            except Exception as exc:  # what the library says, shortened
                row.append(f"fails: {type(exc).__name__}")
        rows.append(row)
    return ("Relative error of the merged model against the adapted one (adapter weights "
            f"random, rank 2), peft {peft.__version__}; 'fails' names the exception at "
            "adapt, forward or merge time:\n\n"
            + markdown_table(["layer", *methods], rows))


def merge_precision() -> str:
    """Merged against adapted outputs in float32 and bfloat16, both against float64."""
    rows = []
    for fmt in ("low_rank", "cp", "tucker2", "tt", "tr"):
        for geometry in ("linear", "conv2d-same-reflect", "conv2d-stride-dilation-groups"):
            make, shape = GEOMETRIES[geometry]
            errors = []
            for dtype in (torch.float32, torch.bfloat16):
                torch.manual_seed(0)
                x = torch.randn(shape, dtype=torch.float64)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = tnspec.adapt(nn.Sequential(make()).double(), fmt, rank=2,
                                         init="zero")[0]
                with torch.no_grad():
                    for p in model.parameters():
                        if p.requires_grad:
                            p.normal_()
                exact = model(x)
                low = copy.deepcopy(model).to(dtype)
                merged = tnspec.merge_adapters(low)
                for out in (low(x.to(dtype)), merged(x.to(dtype))):
                    errors.append(((out.double() - exact).norm() / exact.norm()).item())
            rows.append((fmt, geometry, *(f"{e:.1e}" for e in errors)))
    return ("Relative error against the float64 adapted model of the same weights:\n\n"
            + markdown_table(["format", "layer", "float32 adapted", "float32 merged",
                              "bf16 adapted", "bf16 merged"], rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version (tests)")
    parser.add_argument("--geometries", action="store_true",
                        help="merge errors of tnspec's and PEFT's adapters over conv geometries")
    args = parser.parse_args(argv)
    started = time.time()
    if args.geometries:
        text = "# Adapters over conv geometries\n\n" + geometry_table() + "\n\n" + \
            merge_precision()
        print(text)
        save("adapters_geometries", text, started)
        return 0
    images = digits(images=True)
    if args.smoke:
        images = (images[0][:200], images[1][:200], images[2][:100], images[3][:100])
    seeds, epochs, shares = ((0, 1, 2), 10, SHARES) if not args.smoke else ((0,), 1, (0.08,))
    methods = ["full", *TNSPEC] + ([*PEFT] if peft_available() and not args.smoke else [])
    text = ["# Fine-tuning with tensor-network adapters (digits, rotated 90 degrees)\n",
            f"Seeds {', '.join(map(str, seeds))}; adapting {epochs} epochs; test accuracy "
            "on the 360 rotated test digits, mean (min-max); steps to 95% of the final "
            "accuracy, mean; trainable parameters as a share of the base model's.\n"]
    plot: dict[str, dict[str, list]] = {}
    for model_name, make in (("CNN", cnn), ("MLP", mlp))[args.smoke:]:  # smoke: the MLP
        torch.manual_seed(0)
        base = make()
        fit(base.requires_grad_(True), images, 1e-3, 20 if not args.smoke else 1, seed=0)
        base.requires_grad_(False)
        task = rotated(images)
        n = len(task[0]) * 4 // 5
        validation = (task[0][:n], task[1][:n], task[0][n:], task[1][n:])
        total = sum(p.numel() for p in base.parameters())
        rates = {}
        for method in methods:  # the learning rate, chosen on a validation split
            scores = {}
            for lr in RATES.get(method, (3e-3, 1e-2)) if not args.smoke else (1e-2,):
                torch.manual_seed(0)
                scores[lr] = fit(adapted(base, method, 0.02), validation, lr, epochs, 0)[-1][1]
            rates[method] = max(scores, key=scores.get)
        rows, accs = [], {}
        for method in methods:
            for share in (shares if method != "full" else (1.0,)):
                finals, steps, params = [], [], 0
                for seed in seeds:
                    torch.manual_seed(seed)
                    model = adapted(base, method, share)
                    params = trainable(model)
                    curve = fit(model, task, rates[method], epochs, seed)
                    finals.append(curve[-1][1])
                    steps.append(steps_to(curve))
                accs[(method, share)] = finals
                rows.append((method, "-" if method == "full" else f"{share:.1%}",
                             f"{params:,} ({100 * params / total:.2f}%)", f"{rates[method]:g}",
                             f"{statistics.mean(finals):.3f} ({min(finals):.3f}-"
                             f"{max(finals):.3f})", f"{statistics.mean(steps):.0f}"))
        before = accuracy(base, task[2], task[3])
        models = {"frozen base": base}
        models.update({m: adapted(base, m, 0.02) for m in methods})
        x = task[0][:256] if len(task[0]) >= 256 else task[0]
        times = step_times(models, x, task[1][:len(x)], 2 if args.smoke else 40)
        timing = [(name, f"{times[name] * 1e3:.2f}", f"{times[name] / times['frozen base']:.2f}")
                  for name in times]
        text += [f"\n## {model_name} ({total:,} parameters; {before:.3f} on rotated digits "
                 "before adapting)\n",
                 markdown_table(["method", "share per layer", "trainable", "lr",
                                 "accuracy", "steps to 95%"], rows),
                 "\nOne training step at batch 256 (adapters at 2%), median of interleaved "
                 "rounds:\n",
                 markdown_table(["method", "ms", "x frozen base fwd+bwd"], timing)]
        plot[model_name] = {"accs": accs, "methods": methods, "shares": shares}
    out = "\n".join(text)
    print(out)
    if not args.smoke:
        path = save("adapters", out, started)
        fig, axes = plt().subplots(1, 2, figsize=(10, 3.8))
        for ax, (model_name, p) in zip(axes, plot.items()):
            for method in p["methods"]:
                if method == "full":
                    ax.axhline(statistics.mean(p["accs"][("full", 1.0)]), color="k", ls="--",
                               label="full fine-tuning")
                    continue
                ax.plot([s * 100 for s in p["shares"]],
                        [statistics.mean(p["accs"][(method, s)]) for s in p["shares"]],
                        marker="o", label=method)
            ax.set(xscale="log", xlabel="adapter share of each layer (%)",
                   ylabel="test accuracy", title=model_name)
        axes[1].legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
