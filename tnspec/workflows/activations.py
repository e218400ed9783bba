"""Which activation follows each ``nn.Linear`` and ``nn.ConvNd`` of a model: read from the order
of an ``nn.Sequential`` and, where ``torch.fx`` can trace it, from what ``forward`` does, so
that ``tensorize`` initializes each new layer for the nonlinearity after it."""

from __future__ import annotations

import torch
from torch import nn

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_PASS_THROUGH = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity,
                 nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_MODULE_ACTIVATIONS = {nn.ReLU: "relu", nn.ReLU6: "relu", nn.Tanh: "tanh", nn.GELU: "gelu",
                       nn.SiLU: "silu", nn.Sigmoid: "sigmoid"}
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
    try:  # ...then what forward() does, where torch.fx can trace it
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # noqa: BLE001 - untraceable models keep the Sequential reading
        return found
    modules = dict(model.named_modules())
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target),
                                                      _LAYERS):
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


def _module_activation(module: nn.Module) -> str | None:
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
