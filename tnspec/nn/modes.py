"""What besides the input's shape and layout picks the class a layer runs: autocast's dtype on
the input's device, and whether autograd records (a layer called under ``no_grad`` or
``inference_mode`` is served, and its channel mixing is timed for the forward alone)."""

from __future__ import annotations

import torch

#: the device types autocast can be asked about (``meta`` makes torch raise)
AUTOCAST_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "ipu"})


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """Autocast's dtype where it is on for ``device_type`` (one of ``AUTOCAST_DEVICES``),
    else None."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
        else None


def mode(x: torch.Tensor) -> tuple[torch.dtype | None, bool]:
    """Autocast's dtype on ``x``'s device, and whether autograd records: a class planned for
    one mode is run only in it."""
    return autocast_dtype("cuda" if x.is_cuda else "cpu"), torch.is_grad_enabled()
