"""A model's whole state, to check that a workflow which raised left it exactly as it was: every
parameter and buffer (values and ``requires_grad``), the module structure, which parameters
are tied, and which adapter is active where (with each adapter's scaling, zeroed core,
padding and frozen copy)."""

from __future__ import annotations

import torch
from torch import nn

import tnspec


def snapshot(model: nn.Module) -> dict[str, object]:
    """Everything a workflow could change, by name, as plain comparable values."""
    state: dict[str, object] = {
        f"param {n}": (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}
    state |= {f"buffer {n}": b.detach().clone() for n, b in model.named_buffers()}
    state["structure"] = [(n, type(m).__name__, m.training) for n, m in model.named_modules()]
    holders: dict[int, list[str]] = {}  # which names share one tensor: the ties
    for n, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(n)
    state["ties"] = sorted(names for names in holders.values() if len(names) > 1)
    state["adapters"] = [(n, m.active, m.disabled, dict(m.scaling), dict(m.zeroed),
                          dict(m.pads), list(m.offsets)) for n, m in model.named_modules()
                         if isinstance(m, tnspec.Adapted)]
    return state


def unchanged(before: dict[str, object], model: nn.Module) -> bool:
    """Whether ``model`` is as :func:`snapshot` saw it."""
    after = snapshot(model)
    if before.keys() != after.keys():
        return False
    for key, old in before.items():
        new = after[key]
        if isinstance(old, tuple) and isinstance(old[0], torch.Tensor):
            if not (torch.equal(old[0], new[0]) and old[1] == new[1]):
                return False
        elif isinstance(old, torch.Tensor):
            if not torch.equal(old, new):
                return False
        elif old != new:
            return False
    return True
