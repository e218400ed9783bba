"""Which activation follows each dense layer of a model: read from the order of an
``nn.Sequential`` and, where ``torch.fx`` can trace it, from what ``forward`` does (the whole
model, or else each submodule it can trace: a Hugging Face block's MLP), so that
``tensorize`` initializes each new layer for the nonlinearity after it. Hugging Face's
activation modules (``GELUActivation``, ``NewGELUActivation``, ``QuickGELUActivation``, ...)
are read by their class names, without importing ``transformers``."""

from __future__ import annotations

import torch
from torch import nn

from ..dense_layers import is_dense
_PASS_THROUGH = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity,
                 nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_MODULE_ACTIVATIONS = {nn.ReLU: "relu", nn.ReLU6: "relu", nn.Tanh: "tanh", nn.GELU: "gelu",
                       nn.SiLU: "silu", nn.Sigmoid: "sigmoid"}
#: transformers.activations' modules, by class name: the GELU approximations (tanh, sigmoid,
#: clipped) have GELU's gain to 3 digits for unit-variance inputs
_HF_ACTIVATIONS = {"GELUActivation": "gelu", "NewGELUActivation": "gelu",
                   "FastGELUActivation": "gelu", "QuickGELUActivation": "gelu",
                   "AccurateGELUActivation": "gelu", "ClippedGELUActivation": "gelu",
                   "GELUTanh": "gelu", "PytorchGELUTanh": "gelu", "SiLUActivation": "silu",
                   "LinearActivation": "linear"}
_FUNCTION_ACTIVATIONS = {torch.relu: "relu", torch.nn.functional.relu: "relu",
                         torch.tanh: "tanh", torch.nn.functional.tanh: "tanh",
                         torch.nn.functional.gelu: "gelu", torch.nn.functional.silu: "silu",
                         torch.sigmoid: "sigmoid", torch.nn.functional.sigmoid: "sigmoid",
                         "relu": "relu", "relu_": "relu", "tanh": "tanh", "sigmoid": "sigmoid"}


def following_activations(model: nn.Module) -> dict[str, tuple[str, str]]:
    """``{layer name: (activation, how it was found)}`` for the layers followed by one."""
    found: dict[str, tuple[str, str]] = {}
    for seq_name, seq in model.named_modules():  # nn.Sequential order first...
        if isinstance(seq, nn.Sequential):
            children = list(seq.named_children())
            for i, (child, module) in enumerate(children):
                nxt = [m for _, m in children[i + 1:]]
                while nxt and isinstance(nxt[0], _PASS_THROUGH):
                    nxt.pop(0)
                act = _module_activation(nxt[0]) if nxt else None
                if act:
                    found[f"{seq_name}.{child}" if seq_name else child] = \
                        (act, "read from the model")
    modules = dict(model.named_modules())
    for node in _traced(model):  # ...then what forward() does
        if node.op != "call_module" or not is_dense(modules.get(node.target)):
            continue
        user = node
        for _ in range(4):
            if len(user.users) != 1:
                break
            user = next(iter(user.users))
            act = _node_activation(user, modules)
            if act:
                found[node.target] = (act, "read from the model")
                break
            if not (user.op == "call_module" and isinstance(modules.get(user.target),
                                                            _PASS_THROUGH)):
                break
    return found


class _Tracer(torch.fx.Tracer):
    """``torch.fx``'s tracer, with the dense layers and activation modules kept as calls."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return is_dense(m) or _module_activation(m) is not None or \
            type(m).__module__.startswith("tnspec.") or super().is_leaf_module(m, qualname)

    def trace(self, root, concrete_args=None):  # type: ignore[override]
        # fx stores each tensor constant it meets on the traced module as
        # ``_tensor_constant<i>``: reading a model must not add attributes to it
        before = {id(m): set(vars(m)) for m in root.modules()}
        try:
            return super().trace(root, concrete_args)
        finally:
            for m in root.modules():
                for key in set(vars(m)) - before.get(id(m), set()):
                    delattr(m, key)


def _traced(model: nn.Module, prefix: str = "") -> list[torch.fx.Node]:
    """The call nodes of ``model``'s traced ``forward`` (module targets as qualified names in
    the whole model); where it does not trace, those of each child that does."""
    if is_dense(model) or not any(True for _ in model.children()):
        return []
    try:
        graph = _Tracer().trace(model)
    except Exception:  # noqa: BLE001 - what does not trace is read from its children
        return [node for name, child in model.named_children()
                for node in _traced(child, f"{prefix}{name}.")]
    for node in graph.nodes:
        if node.op == "call_module":
            node.target = prefix + node.target
    return list(graph.nodes)


def _module_activation(module: nn.Module) -> str | None:
    if type(module).__module__.startswith("transformers."):
        return _HF_ACTIVATIONS.get(type(module).__name__)
    if isinstance(module, nn.LeakyReLU):
        return f"leaky_relu({module.negative_slope})"
    return next((a for t, a in _MODULE_ACTIVATIONS.items() if isinstance(module, t)), None)


def _node_activation(node: torch.fx.Node, modules: dict[str, nn.Module]) -> str | None:
    if node.op == "call_module":
        return _module_activation(modules[node.target])
    if node.op in ("call_function", "call_method"):
        if node.target is torch.nn.functional.leaky_relu:
            slope = node.kwargs.get("negative_slope", node.args[1] if len(node.args) > 1
                                    else 0.01)
            return f"leaky_relu({slope})" if isinstance(slope, (int, float)) else None
        try:
            return _FUNCTION_ACTIVATIONS.get(node.target)
        except TypeError:  # an unhashable target
            return None
    return None
