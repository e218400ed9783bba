"""While ``compress`` runs, the plain conv that a conv subclass (one that pads "same" or
standardizes its weight in its forward) computes stands at the subclass's name, so that the
model calls the layer the candidates are fitted to; after, the subclass is put back where its
layer was not replaced."""

from __future__ import annotations

from typing import Mapping

from torch import nn

from ..model_tree import set_submodule
from ..padded import Reading


StandIns = Mapping[str, tuple[nn.Module, Reading, str]]  # name: (subclass, reading, layer)


def stand_in(model: nn.Module, stand_ins: StandIns) -> None:
    """Set the plain layer each read subclass computes (in a Padded where it pads) at its
    name."""
    for name, (_, read, _) in stand_ins.items():
        set_submodule(model, name, read.around(read.layer))


def put_back(model: nn.Module, stand_ins: StandIns, replaced: set[str]) -> None:
    """Set each read subclass back at its name, where its layer was not replaced."""
    for name, (original, _, layer) in stand_ins.items():
        if layer not in replaced:
            set_submodule(model, name, original)
