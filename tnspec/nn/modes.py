"""What besides the input's shape and layout picks the class a layer runs: autocast's dtype on
the input's device, whether autograd records (a layer called under ``no_grad`` or
``inference_mode`` is served, and its channel mixing is timed for the forward alone), and the
layer's settings that its plans depend on (``Replans``)."""

from __future__ import annotations

from typing import Any, Callable

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


class Replans:
    """A layer setting its plans depend on (``planner``, ``max_bytes``): checked by ``check``
    when set, and once changed, the classes the layer keeps are dropped (``_drop_code``), so
    that it plans anew at its next call; kept in the instance's ``__dict__`` as ``_<name>``.
    """

    def __init__(self, check: Callable[[str, Any], Any], doc: str) -> None:
        self.check, self.__doc__ = check, doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.key = name, "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else obj.__dict__[self.key]

    def __set__(self, obj: Any, value: Any) -> None:
        value = self.check(self.name, value)
        if obj.__dict__.setdefault(self.key, value) != value:
            obj.__dict__[self.key] = value
            obj._drop_code()  # the classes kept were planned by the setting before
