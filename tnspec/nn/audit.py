"""``tnspec.audit``: will this model train from step one? One forward and one backward pass with
hooks measure, for every layer with parameters, how much it scales the variance of what flows
through it, forward and backward.

A stack trains from the first step when these ratios stay near ``1 / p_a`` forward (so that,
after the activation's factor ``p_a``, each layer keeps the variance) and near ``1 / p_a``
backward: products of ratios far from that vanish or explode with depth. For tnspec layers the
audit also gives what Graph-in/Graph-out's theory predicts from the cores' actual variances,
``prod_c Var(W_c) * S`` (``S_in`` forward, ``S_out`` backward), so that a measured ratio can be
told apart from the theory. That prediction assumes inputs of mean zero, independent of the
cores, with no normalization between layers: an input of mean ``m`` and variance ``v`` scales
the forward ratio by ``1 + m^2 / v``, and a BatchNorm before the layer rescales what it sees.
Rows whose input breaks these assumptions are flagged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..analysis.backbone import backbone
from .module import Layer

__all__ = ["Audit", "audit"]


@dataclass(frozen=True)
class Audit:
    """The measured ratios. ``rows``: one dict per layer in call order, with ``name``, ``type``,
    ``forward`` (Var(output) / Var(input)), ``backward`` (Var(grad input) / Var(grad output),
    None without a backward pass), ``predicted`` ((forward, backward) from the theory for
    tnspec layers, else None), ``input_mean`` (the input's mean over its standard deviation),
    ``after`` (the normalization module called since the previous layer, else None) and
    ``flags`` (why the prediction's assumptions fail for that row, in words). A ratio whose
    variance is 0 (a zero layer before, dead ReLUs, a constant input) is inf or nan."""

    rows: tuple[dict[str, Any], ...]

    def __str__(self) -> str:
        lines = [f"{'layer':<24}{'type':<20}{'forward':>10}{'backward':>10}"
                 f"{'predicted':>20}  note"]
        for r in self.rows:
            pred = r["predicted"]
            lines.append((f"{r['name'][:23]:<24}{r['type'][:19]:<20}{_num(r['forward']):>10}"
                          f"{_num(r['backward']):>10}"
                          f"{(_num(pred[0]) + ' / ' + _num(pred[1])) if pred else '':>20}"
                          f"  {'; '.join(r.get('flags', ()))}").rstrip())
        if any(r["predicted"] for r in self.rows):
            lines.append("predicted: prod Var(W_c) * S_in / S_out, for inputs of mean 0, "
                         "independent of the cores, with no normalization between layers; an "
                         "input of mean m and variance v makes the forward ratio (1 + m^2/v) "
                         "times the prediction")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """The forward and backward ratios by depth on a log scale (needs matplotlib)."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:  # an optional extra
            raise ImportError("audit.plot() needs matplotlib: pip install matplotlib") from exc
        if ax is None:
            _, ax = plt.subplots(figsize=(7, 3.5))
        depth = range(1, len(self.rows) + 1)
        ax.plot(depth, [r["forward"] for r in self.rows], "o-", label="forward")
        if any(r["backward"] is not None for r in self.rows):
            ax.plot(depth, [r["backward"] for r in self.rows], "s-", label="backward")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(yscale="log", xlabel="layer (call order)", ylabel="variance ratio")
        ax.legend()
        return ax


def audit(model: nn.Module, x: torch.Tensor | Mapping[str, torch.Tensor], *,
          backward: bool = True, seed: int = 0) -> Audit:
    """Run ``model(x)`` once (``model(**x)`` for a dict, as a Hugging Face tokenizer returns
    it) and a backward pass from a unit-variance random gradient, and measure each layer's
    variance ratios. Layers are the modules that own parameters (directly
    or through submodules they do not call, as other libraries' factorized layers do) and have
    no called descendant that owns parameters. The global RNG (Dropout's masks are drawn from
    a copy of it), gradients, train/eval mode and buffers (BatchNorm's running statistics) are
    left as they were; a model that changes its input in place is fed a copy."""
    owners = {m for m in model.modules() if any(True for _ in m.parameters())}
    names = {m: n or type(m).__name__ for n, m in model.named_modules()}
    calls: dict[nn.Module, dict[str, Any]] = {}
    order: list[nn.Module] = []
    grads: dict[nn.Module, dict[str, torch.Tensor]] = {}
    handles = []

    def keep(module: nn.Module, which: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            grads.setdefault(module, {}).setdefault(which, grad.detach())
        return hook

    # gradients are caught by hooks on the tensors themselves, not by full backward hooks on
    # the modules: a tensor hook sees the gradient of the value it was registered on even when
    # the tensor is then changed in place (nn.ReLU(inplace=True), F.relu(y, inplace=True))
    def before(module: nn.Module, args: tuple) -> tuple | None:
        at = next((k for k, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
        if not backward or module in calls or at is None or not args[at].requires_grad:
            return None
        alias = args[at].view_as(args[at])  # this module's own use of its input
        alias.register_hook(keep(module, "in"))
        return args[:at] + (alias,) + args[at + 1:]

    last_norm: list[str] = []  # the normalization called since the previous layer

    def normed(module: nn.Module, inputs: tuple, output: Any) -> None:
        last_norm[:] = [names.get(module, type(module).__name__)]

    def after(module: nn.Module, inputs: tuple, output: Any) -> None:
        x_in, y = _first_tensor(inputs), _first_tensor(output)
        if x_in is None or y is None or module in calls:
            return
        order.append(module)
        calls[module] = {"forward": _ratio(_var(y), _var(x_in)), "backward": None,
                         "input_mean": _mean_over_sd(x_in),
                         "after": last_norm.pop() if last_norm else None}
        if backward and y.requires_grad:
            y.register_hook(keep(module, "out"))

    for m in owners:
        handles.append(m.register_forward_pre_hook(before))
        handles.append(m.register_forward_hook(after))
    for m in model.modules():
        if isinstance(m, _NORMS):
            handles.append(m.register_forward_hook(normed))
    given = dict(x) if isinstance(x, Mapping) else {"": x}
    first = next(iter(given.values()))
    generator = torch.Generator(device=first.device).manual_seed(seed)
    buffers = [(b, b.clone()) for b in model.buffers()]  # BatchNorm's running statistics
    devices = [first.device] if first.is_cuda else []
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=devices):
            leaves = {k: v.detach().clone().requires_grad_(backward and v.is_floating_point())
                      for k, v in given.items()}
            # not leaves: a first layer may change its input in place
            inputs = {k: v.clone() for k, v in leaves.items()}
            y = _first_tensor(model(**inputs) if isinstance(x, Mapping) else model(inputs[""]))
            if backward and y is not None and y.requires_grad:
                g = torch.randn(y.shape, generator=generator, device=y.device, dtype=y.dtype)
                params = [p for p in model.parameters() if p.requires_grad]
                wrt = [v for v in leaves.values() if v.requires_grad] + params
                torch.autograd.grad(y, wrt, g, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    for m, caught in grads.items():
        if m in calls and "in" in caught and "out" in caught:
            calls[m]["backward"] = _ratio(_var(caught["in"]), _var(caught["out"]))
    called = set(order)
    rows = []
    for m in order:
        if any(d in called and d in owners for d in m.modules() if d is not m):
            continue  # a container: its layers are reported instead
        row = {"name": names.get(m, type(m).__name__), "type": type(m).__name__,
               **calls[m], "predicted": _predicted(m)}
        row["flags"] = _flags(row)
        rows.append(row)
    return Audit(tuple(rows))


#: an input mean past this many standard deviations moves the forward ratio by over 25%
MEAN_FLAG = 0.5
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
          nn.modules.instancenorm._InstanceNorm)


def _flags(row: dict[str, Any]) -> tuple[str, ...]:
    """Why the theory's assumptions fail for ``row`` (only where it makes a prediction)."""
    flags = []
    mean = row["input_mean"]
    if row["predicted"] is not None and math.isfinite(mean) and abs(mean) > MEAN_FLAG:
        flags.append(f"input not centred: mean {mean:+.2g} sd (ratio x{1 + mean ** 2:.2g})")
    if row["predicted"] is not None and row["after"] is not None:
        flags.append(f"after {row['after']} (normalized input)")
    return tuple(flags)


def _mean_over_sd(t: torch.Tensor) -> float:
    if t.numel() < 2 or not t.is_floating_point():
        return math.nan
    t = t.detach().double()
    return _ratio(float(t.mean()), math.sqrt(float(t.var())))


def _ratio(num: float, den: float) -> float:
    """``num / den``; inf (or nan for 0/0) where ``den`` is 0."""
    if den == 0:
        return math.nan if num == 0 or math.isnan(num) else math.copysign(math.inf, num)
    return num / den


def _predicted(module: nn.Module) -> tuple[float, float] | None:
    """Graph-in/out's ratios for a tnspec layer: prod_c Var(W_c) * S_in (and S_out)."""
    if not isinstance(module, Layer):
        return None
    net = module.network
    with torch.no_grad():
        prod = math.prod(_var(getattr(module, c.name)) for c in net.cores)
    exact = net.options.stride_count == "exact"
    return prod * backbone(net, "in", exact).S, prod * backbone(net, "out", exact).S


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):  # a Hugging Face ModelOutput: its first tensor
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


def _var(t: torch.Tensor) -> float:
    return float(t.detach().double().var()) if t.numel() > 1 else math.nan


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:.3g}"
