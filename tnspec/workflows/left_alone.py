"""Which of a model's layers a workflow must leave as they are, and why: those whose weight
their parent reads itself, and those whose parameters another module shares (tied weights), but
for a language model's head tied to its token embedding, which ``tensorize`` can give one
tensorized table (:func:`tied_heads`)."""

from __future__ import annotations

from torch import nn

from .dense_layers import is_transposed
from .model_tree import parameter_holders


def tied(model: nn.Module) -> dict[str, str]:
    """``{layer name: why}`` for the modules whose parameters are shared with another module,
    or that are registered under two names: replacing one would untie them."""
    found: dict[str, str] = {}
    for holders in parameter_holders(model).values():
        unique = list(dict.fromkeys(name for name, _ in holders))
        for name in unique:
            others = [n for n in unique if n != name]
            if others:
                found[name] = (f"its parameters are shared with {others[0]!r} (tied weights); "
                               "left alone so that they stay tied")
    return found


def read_directly(model: nn.Module) -> dict[str, str]:
    """``{layer name: why}`` for the layers whose weight their parent reads itself:
    ``nn.TransformerEncoderLayer``/``DecoderLayer``'s feed-forward (their eval fast path)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
            for child in ("linear1", "linear2"):
                found[f"{name}.{child}" if name else child] = (
                    f"{type(module).__name__} reads this layer's weight directly (its fast "
                    "path in eval mode)")
    return found


def tied_heads(model: nn.Module) -> dict[str, str]:
    """``{head: embedding}`` for each ``nn.Linear`` whose weight is an ``nn.Embedding``'s
    table, where nothing else shares it (a language model's head tied to its token
    embedding): a tensorized table can serve both (:class:`tnspec.nn.embedding.TiedHead`)."""
    heads: dict[str, str] = {}
    for holders in parameter_holders(model).values():
        modules = {id(m): (n, m) for n, m in holders}
        embeds = [n for n, m in modules.values() if type(m) is nn.Embedding]
        linears = [n for n, m in modules.values()
                   if isinstance(m, nn.Linear) and not is_transposed(m)]
        if len(embeds) == 1 and linears and len(modules) == 1 + len(linears):
            heads |= {n: embeds[0] for n in linears}
    return heads
