"""The blocks of a model that finish before a layer is first called, replayed from a recording.

Measuring a layer's sensitivity runs the whole model once per layer and batch with that layer's
output perturbed. Everything the model computes before the layer is first called is what it
computed in the unperturbed run: the same code on the same inputs, in eval mode without
gradients. So a block (an element of an ``nn.ModuleList`` or ``nn.Sequential``: a transformer
layer, a residual block) that returned before the layer was entered can hand back the output
it returned then, instead of running again; a layer in the last of six blocks runs one block,
not six. The replayed values are the recorded ones, so the measure is the one a full run
gives, to the bit.

A block is replayed only where that holds whatever it does inside: it ran once in the
forward, took and returned only tensors and plain values (a cache object it might fill is
not replayed), left its inputs and buffers as they were (an in-place ReLU is not
replayed), returned no tensor that is, or views, one of its inputs, parameters or buffers
(an identity in eval mode, a reshape: an in-place op on it later writes through to what it
views, which a copy would not), and has no forward hook (it would run again on the replayed
output). Recorded outputs are copies, handed out as copies, at most
:data:`MAX_BYTES` in all."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.utils._pytree
from torch import nn

#: recorded block outputs kept per measure, in bytes, over all batches
MAX_BYTES = 1 << 29

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size)


@dataclass
class _Call:
    """One block's call in the recorded run."""

    module: nn.Module
    parent: _Call | None  # the block whose call encloses this one
    enter: int
    leave: int = -1
    calls: int = 1
    output: Any = None
    replayable: bool = False


@dataclass
class Recording:
    """What one unperturbed run of the model showed: each block's call, and when each layer
    was first entered (a tick of the run's calls)."""

    calls: dict[int, _Call] = field(default_factory=dict)  # by id of the block
    entered: dict[str, int] = field(default_factory=dict)  # layer name -> first tick
    bytes: int = 0

    def before(self, name: str) -> list[_Call]:
        """The outermost replayable blocks that returned before layer ``name`` was first
        entered (none for a layer the run never entered)."""
        tick = self.entered.get(name)
        if tick is None:
            return []

        def done(c: _Call | None) -> bool:
            return c is not None and c.replayable and c.leave < tick

        out = []
        for c in self.calls.values():
            if not done(c):
                continue
            parent = c.parent
            while parent is not None and not done(parent):
                parent = parent.parent
            if parent is None:
                out.append(c)
        return out

    def prune(self, names: list[str]) -> None:
        """Drop the outputs no layer in ``names`` replays."""
        needed = {id(c) for name in names for c in self.before(name)}
        for c in self.calls.values():
            if id(c) not in needed and c.output is not None:
                self.bytes -= _size(c.output)
                c.output, c.replayable = None, False


def blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of every ``nn.ModuleList`` and ``nn.Sequential`` in ``model``, each once."""
    seen: dict[int, nn.Module] = {}
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            for child in m.children():
                seen.setdefault(id(child), child)
    return list(seen.values())


@contextlib.contextmanager
def recording(model: nn.Module, layers: dict[str, nn.Module], budget: int = MAX_BYTES
              ) -> Iterator[Recording]:
    """Record one run of ``model`` (``layers``: name -> the module called for it): each
    block's call and output, each layer's first entry. ``budget``: bytes of outputs kept."""
    rec = Recording()
    stack: list[_Call] = []
    tick = [0]
    versions: dict[int, list[int]] = {}

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        tick[0] += 1
        known = rec.calls.get(id(module))
        if known is not None:  # called again: its output is not one value of the run
            known.calls += 1
            stack.append(known)
            return
        call = _Call(module, stack[-1] if stack else None, tick[0])
        rec.calls[id(module)] = call
        stack.append(call)
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if all(isinstance(x, (torch.Tensor, *_PLAIN)) for x in leaves):
            versions[id(module)] = _versions(module, leaves)

    def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        tick[0] += 1
        call = stack.pop()
        call.leave = tick[0]
        before = versions.pop(id(module), None)
        if id(module) in hooked:
            return
        if call.calls > 1:
            rec.bytes -= _size(call.output) if call.replayable else 0
            call.output, call.replayable = None, False
            return
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        outputs = torch.utils._pytree.tree_leaves(output)
        if before is None or before != _versions(module, leaves) \
                or not all(isinstance(x, (torch.Tensor, *_PLAIN)) for x in outputs) \
                or _storages(outputs) & _storages([*leaves, *module.parameters(),
                                                   *module.buffers()]):
            return  # an output that is its input (or a view of it) is not a copy to hand out
        size = _size(output)
        if rec.bytes + size > budget:
            return
        rec.bytes += size
        call.output, call.replayable = _copied(output), True
        # what ran inside it is replayed only for a layer first entered inside it after it
        inside = [t for t in rec.entered.values() if call.enter < t]
        for c in rec.calls.values():
            if c.replayable and c is not call and call.enter < c.enter \
                    and not any(c.leave < t for t in inside):
                rec.bytes -= _size(c.output)
                c.output, c.replayable = None, False

    def first(name: str) -> Any:
        def hook(_: nn.Module, args: tuple) -> None:
            tick[0] += 1
            rec.entered.setdefault(name, tick[0])
        return hook

    # a forward hook would run again on the replayed output (twice, where it changes it)
    found = blocks(model)
    hooked = {id(m) for m in found if m._forward_hooks} if \
        not nn.modules.module._global_forward_hooks else {id(m) for m in found}
    handles = []
    try:
        for m in found:
            handles.append(m.register_forward_pre_hook(enter, with_kwargs=True))
            handles.append(m.register_forward_hook(leave, with_kwargs=True))
        for name, m in layers.items():
            handles.append(m.register_forward_pre_hook(first(name)))
        yield rec
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def replaying(calls: list[_Call]) -> Iterator[None]:
    """Each block of ``calls`` returns (a copy of) its recorded output instead of running."""
    saved = []
    try:
        for c in calls:
            saved.append((c.module, c.module.__dict__.get("forward")))
            c.module.forward = _returning(c.output)
        yield
    finally:
        for module, forward in saved:
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def _returning(output: Any) -> Any:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return _copied(output)
    return forward


def _copied(output: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, output)


def _versions(module: nn.Module, leaves: list[Any]) -> list[int]:
    """The version counters of the tensors a call reads and of the module's buffers: an
    in-place change to any of them bumps its counter."""
    return [x._version for x in leaves if isinstance(x, torch.Tensor)] + \
        [b._version for b in module.buffers()]


def _storages(leaves: list[Any]) -> set[int]:
    return {x.untyped_storage().data_ptr() for x in leaves if isinstance(x, torch.Tensor)}


def _size(output: Any) -> int:
    return sum(x.numel() * x.element_size() for x in torch.utils._pytree.tree_leaves(output)
               if isinstance(x, torch.Tensor))
