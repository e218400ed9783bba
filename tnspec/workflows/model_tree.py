"""A model's module tree as every workflow walks and edits it: which layers a selector chooses,
replacing a submodule by name, which modules hold each parameter (where several do, it is tied),
and how a workflow that changed nothing says why."""

from __future__ import annotations

import fnmatch
from typing import Callable, Mapping, Sequence

from torch import nn

#: what ``include=``/``exclude=`` take: a glob on a layer's qualified name, a list of globs, or
#: a predicate ``f(name, module)``
Selector = str | Sequence[str] | Callable[[str, nn.Module], bool] | None


def selected(name: str, module: nn.Module, include: Selector, exclude: Selector) -> bool:
    """Whether the layer ``name`` is chosen by ``include`` (None: every layer) and not by
    ``exclude``: each a glob on the qualified name, a list of them, or ``f(name, module)``."""
    def matches(selector: Selector) -> bool:
        if callable(selector):
            return bool(selector(name, module))
        patterns = [selector] if isinstance(selector, str) else list(selector or ())
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)
    return (include is None or matches(include)) and not (exclude is not None and
                                                          matches(exclude))


def first_skipped(skipped: Sequence[tuple[str, str]]) -> str:
    """``"layer: why (and 2 more layer(s))"``: why a workflow that changed nothing did not."""
    name, why = skipped[0]
    return f"{name}: {why}" + (f" (and {len(skipped) - 1} more layer(s))"
                               if len(skipped) > 1 else "")


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where the submodule ``name`` (dotted) of ``model`` is."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def parameter_holders(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """Each parameter (by id) -> the modules holding it as their own, with their names (one
    module registered under two names appears twice): where it has more than one, the
    parameter is tied."""
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append((name, module))
    return holders


def set_all(model: nn.Module, chosen: Mapping[str, nn.Module]) -> None:
    """Set every chosen layer, or none: an interruption half-way puts the old ones back."""
    old = {name: model.get_submodule(name) for name in chosen}
    try:
        for name, new in chosen.items():
            set_submodule(model, name, new)
    except BaseException:
        for name, module in old.items():
            set_submodule(model, name, module)
        raise


def set_where_other(model: nn.Module, wanted: Mapping[str, nn.Module]) -> None:
    """Set ``wanted[name]`` at every name where the model holds another module."""
    for name, module in wanted.items():
        if model.get_submodule(name) is not module:
            set_submodule(model, name, module)
