"""Why adapters of some formats train badly: the first few hundred steps, watched.

The digits CNN of ``experiments.models.adapters`` (pretrained on upright digits, adapted to digits
rotated by 90 degrees) gets adapters at 2% of each layer's parameters: tnspec's low_rank, cp,
tucker2, tt, tr and tt_lora, and PEFT's LoRA. Adam at the rates PEFT's LoRA uses (1e-3, 3e-3,
1e-2), one seed, 300 steps of 64. At the 256 -> 256 conv (the largest adapted layer), every
few steps:

- each core's gradient norm and its move from init, ``||W_t - W_0|| / ||W_0||`` (the core that
  starts at zero: ``||W_t||`` over the norm its Graph-in std gives it; PEFT's ``lora_B``: over
  ``lora_A``'s norm, scaled to its shape);
- the adapter's output over the base layer's output, ``||scaling * adapter(x)|| / ||base(x)||``,
  and the share of the last hidden layer's ReLU units that are dead (zero on every image),
  both on a fixed batch of 256 training images; the training loss.

    python -m experiments.models.adapter_dynamics          # about 11 minutes on 2 cores
    python -m experiments.models.adapter_dynamics --smoke
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from typing import Callable

import torch
from torch import nn

import tnspec
from tnspec.workflows.adapters import step_rule

from . import adapters as base_experiment
from ..common import digits, markdown_table, plt, save

METHODS = ("low_rank", "cp", "tucker2", "tt", "tr", "tt_lora", "peft-lora")
RATES = (1e-3, 3e-3, 1e-2)
WATCHED = "5"  # the 256 -> 256 conv of the CNN
LOGGED = (1, 2, 5, 10, 20, 40, 70, 100, 150, 200, 300)


Parts = tuple[nn.Module, dict[str, nn.Parameter], str, float, Callable, Callable]


def _parts(model: nn.Module) -> Parts:
    """The watched layer: (module, cores, zero core's name, its reference norm, base(x),
    adapter's scaled output(x))."""
    layer = model.get_submodule(WATCHED) if not hasattr(model, "base_model") else \
        model.base_model.model.get_submodule(WATCHED)
    if isinstance(layer, tnspec.Adapted):
        net = layer.adapters[layer.active]
        cores = dict(net.named_parameters())
        zero = layer.zeroed[layer.active]
        # Z = scaling * Z' once trained to its Graph-in std: Z' of unit std
        reference = math.sqrt(cores[zero].numel())
        return (layer, cores, zero, reference, layer.base,
                lambda x: layer.scaling[layer.active] * net(x))
    cores = {"lora_A": layer.lora_A["default"].weight, "lora_B": layer.lora_B["default"].weight}
    a = cores["lora_A"]
    reference = float(a.detach().norm()) * math.sqrt(cores["lora_B"].numel() / a.numel())
    return (layer, cores, "lora_B", reference, layer.base_layer,
            lambda x: layer.scaling["default"] * layer.lora_B["default"](
                layer.lora_A["default"](x)))


def watch(model: nn.Module, data: tuple[torch.Tensor, ...], lr: float, steps: int,
          seed: int = 0) -> tuple[list[dict], float]:
    """Train ``model`` ``steps`` steps; the watched quantities at the logged steps, and the
    final test accuracy."""
    x_tr, y_tr, x_te, y_te = data
    layer, cores, zero, reference, base, adapter = _parts(model)
    start = {n: p.detach().clone() for n, p in cores.items()}
    seen: dict[str, torch.Tensor] = {}
    handle = layer.register_forward_hook(lambda m, args, y: seen.__setitem__("x", args[0]))
    hidden = [m for m in model.modules() if isinstance(m, nn.ReLU)][-1]
    hidden.register_forward_hook(lambda m, args, y: seen.__setitem__("h", y))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    probe = x_tr[:256]  # a fixed batch the output ratio and dead units are measured on

    def dead() -> float:
        with torch.no_grad():
            model(probe)
        return float((seen["h"] <= 0).all(0).float().mean())
    rows, step = [{"step": 0, "loss": math.nan, "ratio": 0.0, "grads": {}, "moved": {},
                   "dead": dead()}], 0
    model.train()
    while step < steps:
        for idx in torch.randperm(len(x_tr), generator=gen).split(64):
            loss = nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx])
            opt.zero_grad()
            loss.backward()
            grads = {n: float(p.grad.norm()) if p.grad is not None else 0.0
                     for n, p in cores.items()}
            opt.step()
            step += 1
            if step in LOGGED or step == steps:
                share = dead()
                with torch.no_grad():
                    x = seen["x"]
                    ratio = float(adapter(x).norm() / base(x).norm())
                    moved = {n: float((p - start[n]).norm() / start[n].norm()) if n != zero
                             else float(p.norm()) / reference for n, p in cores.items()}
                rows.append({"step": step, "loss": loss.item(), "ratio": ratio, "grads": grads,
                             "moved": moved, "dead": share})
            if step == steps:
                break
    handle.remove()
    model.eval()
    with torch.no_grad():
        acc = float((model(x_te).argmax(1) == y_te).float().mean())
    return rows, acc


def equal_rate(model: nn.Module, rate: float) -> nn.Module:
    """A trial step rule, applied after ``adapt``: each learning core ``W = m W'`` with ``W'``
    of std ``n / rate`` (``n`` learning cores), ``m`` folded into the adapter's scaling, so
    that Adam moves every format's product by about ``lr * rate`` of itself per step."""
    for module in model.modules():
        if isinstance(module, tnspec.Adapted):
            for name, layer in module.adapters.items():
                learning = [p for core, p in layer.named_parameters()
                            if core != module.zeroed[name]]
                target = len(learning) / rate
                with torch.no_grad():
                    for p in learning:
                        std = float(p.std())
                        p.mul_(target / std)
                        module.scaling[name] *= std / target
    return model


class _FixedNorm(nn.Module):
    """A core of a fixed Frobenius norm: only its direction learns."""

    def __init__(self, norm: float) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, core: torch.Tensor) -> torch.Tensor:
        return core * (self.norm / core.norm())


class _FixedSpectral(nn.Module):
    """A core whose largest singular value over its unfoldings (each index against the rest)
    stays at its init value: the bonds cannot align to grow the product."""

    def __init__(self, core: torch.Tensor) -> None:
        super().__init__()
        self.sigma = float(self.spectral(core.detach()))

    spectral = staticmethod(step_rule.spectral)  # what adapt(step_rule="spectral") holds

    def forward(self, core: torch.Tensor) -> torch.Tensor:
        return core * (self.sigma / self.spectral(core))


def _bonds(layer: nn.Module, core: str) -> int:
    """How many of ``core``'s indices it shares with another core of the adapter's network."""
    cores = {t.name: {i for axis in t.axes for i in axis} for t in layer.network.cores}
    others = set().union(*(ix for name, ix in cores.items() if name != core))
    return len(cores[core] & others)


def fixed_norms(model: nn.Module, spectral: bool | str = False) -> nn.Module:
    """A trial step rule, applied after ``adapt``: every learning core keeps the norm its
    Graph-in init gave it (``W = |W_0| V / |V|``), so that only the zero core carries the
    adapter's magnitude. Then ``|delta W| <= |Z| prod |W_i|`` grows with the zero core alone,
    as LoRA's delta with its B, whatever the number of cores; the other cores turn. With
    ``spectral``, the largest singular value of every unfolding is what stays (so that the
    cores cannot align along their bonds either); with ``spectral="interior"``, only of the
    cores with two bonds or more (a chain's or ring's inner cores, Tucker's core), where the
    alignment compounds; the cores at the ends of the graph stay free, as LoRA's A is."""
    from torch.nn.utils import parametrize
    for module in model.modules():
        if isinstance(module, tnspec.Adapted):
            for name, layer in module.adapters.items():
                for core, p in list(layer.named_parameters()):
                    if core == module.zeroed[name] or \
                            (spectral == "interior" and _bonds(layer, core) < 2):
                        continue
                    fixed = _FixedSpectral(p) if spectral else _FixedNorm(float(p.detach().norm()))
                    parametrize.register_parametrization(layer, core, fixed)
    return model


DRIFT_FORMATS = ("low_rank", "cp", "tucker2", "tt", "tr", "tt_lora")
# as built, norms, spectral, inner cores (the trials); then adapt(step_rule="spectral")
DRIFT_RULES = (None, False, True, "interior", "step_rule")


def drift(fmt: str, share: float, rule: bool | str | None, steps: int = 60,
          channels: int = 64) -> float:
    """The pure-drift probe: one ``channels``-channel 3x3 conv (a batch of ``channels // 2``)
    with ``fmt`` adapters at ``share``, Adam 1e-2 on a loss whose gradient keeps its direction
    (the trap's first phase); the adapter's output over the base's after ``steps`` steps.
    ``rule``: None as ``adapt`` builds it, ``"step_rule"`` as ``adapt(step_rule="spectral")``
    builds it, else :func:`fixed_norms`' ``spectral``."""
    torch.manual_seed(0)
    base = nn.Conv2d(channels, channels, 3, padding=1)
    x = torch.randn(channels // 2, channels, 8, 8)
    direction = torch.randn(1, channels, 1, 1)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = tnspec.adapt(nn.Sequential(base), fmt, rank=share, init="zero",
                                step_rule="spectral" if rule == "step_rule" else None)
    if rule == "step_rule":
        rule = None
    if rule is not None:
        fixed_norms(model, spectral=rule)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        (-(model(x) * direction).mean()).backward()
        opt.step()
    with torch.no_grad():
        dense = model[0].base(x)
        return float((model(x) - dense).norm() / dense.norm())


def _drift_table(shares: tuple[float, ...] = (0.05, 0.2)) -> str:
    rows = [(fmt, f"{share:g}", *(f"{drift(fmt, share, rule):.3g}" for rule in DRIFT_RULES))
            for share in shares for fmt in DRIFT_FORMATS]
    return ("Pure drift: the adapter's output over the base's after 60 Adam steps (lr 1e-2) "
            "whose gradient keeps its direction, one 64-channel 3x3 conv:\n\n"
            + markdown_table(["format", "adapters' share", "as adapt builds it", "fixed norms",
                              "fixed spectral norms", "inner cores' spectral norms",
                              "adapt(step_rule=\"spectral\")"], rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version (tests)")
    parser.add_argument("--equal-rate", type=float, default=None, metavar="R",
                        help="a trial step rule: every tnspec adapter reparametrized so that "
                        "the sum over its learning cores of 1 / std is R (the same function)")
    parser.add_argument("--fixed-norms", action="store_true",
                        help="a trial step rule: every learning core keeps its init norm")
    parser.add_argument("--fixed-spectral", action="store_true",
                        help="a trial step rule: every learning core keeps its init spectral "
                        "norm (the largest over its unfoldings)")
    parser.add_argument("--fixed-interior", action="store_true",
                        help="as --fixed-spectral, for the cores with two bonds or more only")
    parser.add_argument("--methods", nargs="+", choices=METHODS, help="a subset of the methods")
    parser.add_argument("--drift", action="store_true",
                        help="only the pure-drift probe of the trial rules (about a minute)")
    args = parser.parse_args(argv)
    if args.drift:
        print(_drift_table())
        return 0
    started = time.time()
    images = digits(images=True)
    methods = METHODS if base_experiment.peft_available() else METHODS[:-1]
    methods = tuple(args.methods) if args.methods else methods
    rates, steps = (RATES, 300) if not args.smoke else ((1e-2,), 3)
    if args.smoke:
        images = (images[0][:128], images[1][:128], images[2][:64], images[3][:64])
        methods = ("low_rank", "tt")
    torch.manual_seed(0)
    base = base_experiment.cnn()
    base_experiment.fit(base.requires_grad_(True), images, 1e-3, 20 if not args.smoke else 1,
                        seed=0)
    base.requires_grad_(False)
    task = base_experiment.rotated(images)
    runs, table = {}, []
    for method in methods:
        for lr in rates:
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = base_experiment.adapted(base, method, 0.02)
            if args.equal_rate and method != "peft-lora":
                equal_rate(model, args.equal_rate)
            if (args.fixed_norms or args.fixed_spectral or args.fixed_interior) and \
                    method != "peft-lora":
                fixed_norms(model, spectral="interior" if args.fixed_interior
                            else args.fixed_spectral)
            rows, acc = watch(model, task, lr, steps)
            runs[(method, lr)] = rows
            at = {r["step"]: r for r in rows}
            ratios = (f"{at[s]['ratio']:.3g}" for s in (10, 40, 300) if s in at)
            dead = f"{rows[0]['dead']:.0%} -> {max(r['dead'] for r in rows):.0%}"
            table.append((method, f"{lr:g}", *ratios, dead, f"{rows[-1]['loss']:.3f}",
                          f"{acc:.3f}"))
            print(table[-1], flush=True)
    head = ["method", "lr"] + [f"output ratio, step {s}" for s in (10, 40, 300)
                               if s <= steps] + ["dead ReLUs: start -> most", "final loss",
                                                 "accuracy"]
    rule = f", every tnspec adapter at equal rate {args.equal_rate:g}" if args.equal_rate else ""
    rule += ", every learning core at its init norm" if args.fixed_norms else ""
    rule += ", every learning core at its init spectral norm" if args.fixed_spectral else ""
    rule += (", every learning core with two bonds or more at its init spectral norm"
             if args.fixed_interior else "")
    text = (f"# Adapter dynamics (digits CNN, adapters at 2%, the 256 -> 256 conv watched{rule})"
            "\n\n"
            "Output ratio: ||scaling * adapter(x)|| / ||base(x)||. Dead ReLUs: the share of the "
            "last hidden layer's units (channel x position) that are zero on the whole batch, "
            "before adapting and the largest share over the logged steps. Both on a fixed "
            "batch of 256 training images.\n\n" + markdown_table(head, table))
    text += "\n\n" + _costs(base, task, methods, rounds=2 if args.smoke else 40)
    print(text)
    if not args.smoke:
        path = save("adapter_dynamics" + (f"_rate{args.equal_rate:g}" if args.equal_rate
                                          else "") + ("_fixed_norms" if args.fixed_norms
                                                      else "")
                    + ("_fixed_spectral" if args.fixed_spectral else "")
                    + ("_fixed_interior" if args.fixed_interior else ""), text, started)
        _plot(runs, methods, rates, path.with_suffix(".png"))
    return 0


def _costs(base: nn.Module, task: tuple[torch.Tensor, ...], methods: tuple[str, ...],
           rounds: int) -> str:
    """The watched conv's adapter FLOPs (a share of the dense conv's) and one training step at
    batch 256, relative to the frozen base's forward and backward (interleaved, medians)."""
    x, y = task[0][:256], task[1][:256]
    models = {"frozen base": base}
    rows = []
    for method in methods:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            models[method] = base_experiment.adapted(base, method, 0.02)
    times = base_experiment.step_times(models, x, y, rounds)
    dense = 2 * len(x) * 256 * 256 * 9 * 16  # the 256 -> 256 3x3 conv on 4x4 maps
    for method in methods:
        layer, *_ = _parts(models[method])
        if isinstance(layer, tnspec.Adapted):
            flops = layer.adapters[layer.active].plan((len(x), 256, 4, 4)).flops
        else:  # PEFT's LoRA conv: A (3x3, r outputs), then B (1x1)
            r = layer.lora_A["default"].out_channels
            flops = 2 * len(x) * 16 * (256 * 9 * r + r * 256)
        rows.append((method, f"{flops / dense:.1%}",
                     f"{times[method] * 1e3:.1f}", f"{times[method] / times['frozen base']:.2f}"))
    return ("One training step at batch 256 (adapters at 2%), median of interleaved rounds, and "
            "the watched conv's adapter FLOPs as a share of the dense conv's:\n\n"
            + markdown_table(["method", "adapter FLOPs", "ms per step",
                              "x frozen base fwd+bwd"], rows))


def _plot(runs: dict, methods: tuple[str, ...], rates: tuple[float, ...], path) -> None:
    fig, axes = plt().subplots(2, len(methods), figsize=(3.2 * len(methods), 6.4),
                               sharey="row")
    for col, method in enumerate(methods):
        for lr, color in zip(rates, ("C0", "C1", "C3")):
            rows = runs[(method, lr)][1:]
            steps = [r["step"] for r in rows]
            axes[0, col].plot(steps, [r["ratio"] for r in rows], color=color,
                              label=f"lr {lr:g}")
            for name in rows[0]["moved"]:
                axes[1, col].plot(steps, [r["moved"][name] for r in rows], color=color,
                                  alpha=0.7, lw=1)
        axes[0, col].set(title=method, xscale="log", yscale="log")
        axes[1, col].set(xscale="log", yscale="log", xlabel="step")
    axes[0, 0].set_ylabel("adapter / base output")
    axes[1, 0].set_ylabel("each core's move from init")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
