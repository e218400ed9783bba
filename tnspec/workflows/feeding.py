"""Running a model on a batch as its users feed it, in eval mode without gradients, its
train/eval modes restored after whatever happens: what ``compress`` observes layers by and what
``adapt(sample=...)`` probes the forward with."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ..errors import SpecError

#: runs the model on one batch: ``run(model, batch)``
Runner = Callable[[nn.Module, Any], Any]


def call(model: nn.Module, batch: Any, run: Runner | None = None, given: str = "data=") -> Any:
    """The model on one batch, as its users feed it: ``run(model, batch)`` where given, else
    ``model(x)`` for a tensor, ``model(*batch)`` for a tuple, ``model(**batch)`` for a dict
    (``given``: the argument the batch came in, for the message)."""
    if run is not None:
        return run(model, batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        try:
            return model(*batch)
        except TypeError as exc:  # most likely an (inputs, labels) pair
            raise SpecError(f"the model does not take a batch of {given} as model(*batch): "
                            f"{exc}", hint="for (inputs, labels) batches pass run=lambda model, "
                            "batch: model(batch[0])" if given == "data=" else
                            f"give {given} as the model takes it") from None
    return model(batch)


@contextlib.contextmanager
def evaluated(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode (no batch statistics updated) without gradients; every module's
    mode restored on exit, whatever happens."""
    training = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            yield model
    finally:
        for m, flag in training.items():
            m.training = flag
