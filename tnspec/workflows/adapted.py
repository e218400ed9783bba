"""The modules every workflow knows: :class:`Adapted`, a frozen base layer with named tnspec
adapters beside it, and :class:`Saved`, a module trained in full with them (``adapt``'s
``modules_to_save``). ``adapt`` builds them, ``adapter_state`` merges, saves and switches them;
``tensorize``, ``compress`` and ``merge`` leave what is inside one alone
(:func:`inside_adapted`), since replacing its base or an adapter would break it."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from ..errors import SpecError
from ..fit import decompose
from ..ir import Formula, Network, Role
from ..nn.module import Layer
from ..nn.modes import mode
from .padded import Padded
from .stand_ins import TensorizedConv, TensorizedLinear


class Adapted(nn.Module):
    """A frozen ``base`` module (``nn.Linear`` or ``nn.Conv1d/2d/3d``, untouched, or one in a
    :class:`Padded`) and named tnspec ``adapters`` of its geometry: ``forward(x) = base(x) +
    scaling * adapter(x)`` for the active adapter, run as its planned network on the input as
    the base pads it. An adapter built with ``init="offset"`` has a frozen copy of itself at
    init in ``offsets``, subtracted: ``scaling * (adapter(x) - offset(x))``, in one run where
    it can be (:func:`less`). An adapter whose plan is one product by a weight of its cores
    runs inside the base's product (:func:`folded`)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.adapters = nn.ModuleDict()
        self.offsets = nn.ModuleDict()  # frozen copies at init (init="offset"), by adapter
        self.scaling: dict[str, float] = {}  # the zero core's Graph-in std, per adapter
        self.pads: dict[str, tuple[tuple[int, ...], str] | None] = {}  # F.pad before it
        self.zeroed: dict[str, str] = {}  # the core in Graph-in units (zero at init, or drawn)
        self.active: str | None = None
        self.disabled = False

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight (the adapters are not in it; see ``merge_adapters``)."""
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        """The base layer's bias (adapters have none)."""
        return self.base.bias

    def add(self, name: str, layer: Layer, scaling: float,
            pad: tuple[tuple[int, ...], str] | None, zeroed: str,
            offset: Layer | None = None) -> None:
        """Register ``layer`` as adapter ``name`` (it replaces one of that name), less
        ``offset`` where given (a frozen layer of the same network)."""
        self.adapters[name] = layer
        if offset is not None:
            self.offsets[name] = offset
        elif name in self.offsets:
            del self.offsets[name]
        self.scaling[name], self.pads[name], self.zeroed[name] = scaling, pad, zeroed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.disabled or self.active is None:
            return self.base(x)
        y = folded(self, x)
        if y is not None:
            return y
        y = self.base(x)
        if isinstance(self.base, Padded):  # a conv that padded in its forward: as it pads
            x = self.base.pad(x)
        pad = self.pads[self.active]
        if pad is not None:
            x = F.pad(x, pad[0], mode=pad[1])
        if self.active in self.offsets:
            a = less(self.adapters[self.active], self.offsets[self.active], x)
        else:
            a = self.adapters[self.active](x)
        scaling = self.scaling[self.active]
        # not torch.add(..., alpha=): inductor (torch 2.13) drops alpha after a matmul; at
        # scaling 1 (the principal start) no multiply, forward or back
        return y + (a if scaling == 1.0 else scaling * a)

    def delta_weight(self, name: str) -> torch.Tensor:
        """Adapter ``name`` (less its offset) as a dense weight of the base's shape, in
        float64."""
        delta = delta_weight(self.adapters[name], self.scaling[name])
        if name in self.offsets:
            delta = delta - delta_weight(self.offsets[name], self.scaling[name])
        return delta

    def extra_repr(self) -> str:
        return f"active={self.active!r}" + (", disabled" if self.disabled else "")


class Saved(nn.Module):
    """A module trained in full with the adapters (``adapt(modules_to_save=...)``, as PEFT's):
    the ``original``, frozen and untouched, and a trainable copy per adapter in ``copies``.
    It runs the active adapter's copy; the original where that adapter has none, or while
    adapters are disabled. Attributes it does not have are read from the module it runs."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.original = original
        self.copies = nn.ModuleDict()
        self.active: str | None = None
        self.disabled = False

    def add(self, name: str) -> nn.Module:
        """A copy of the original for adapter ``name`` (replacing one of that name)."""
        self.copies[name] = copy.deepcopy(self.original)
        return self.copies[name]

    def running(self) -> nn.Module:
        """The module ``forward`` runs now."""
        if self.disabled or self.active not in self.copies:
            return self.original
        return self.copies[self.active]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.running()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # its own attributes, and any private one, are never forwarded: while a copy is
            # being unpickled they are missing, and forwarding them would recurse
            if name.startswith("_") or name in ("original", "copies", "active", "disabled"):
                raise
            return getattr(self.running(), name)

    def extra_repr(self) -> str:
        return f"active={self.active!r}" + (", disabled" if self.disabled else "")


def folded(module: Adapted, x: torch.Tensor) -> torch.Tensor | None:
    """``module``'s output as one linear or conv of ``x`` by ``W + scaling * (A - A0)`` and the
    base's bias, where the base is a plain ``nn.Linear`` or ungrouped ``nn.Conv1d/2d/3d``
    (weight ``W``) and the active adapter's plan for ``x`` is that op, of the base's geometry,
    by one weight ``A`` built of its cores (``applied``; ``A0`` its frozen copy's, kept built):
    what ``base(x) + scaling * (adapter(x) - offset(x))`` computes, with one product of the
    data where it took two (three, with the copy) and as many fewer backward. At init ``A -
    A0`` is zero, so the output is ``base(x)``'s, bit for bit, autograd or not. None where it
    does not apply (then the parts run as modules): another plan, a base of another class,
    geometry or dtype, padding of the adapter's own, hooks (they would not fire), a compiled
    trace."""
    base, name = module.base, module.active
    layer = module.adapters[name]
    offset = module.offsets[name] if name in module.offsets else None
    parts = (base, layer) if offset is None else (base, layer, offset)
    if module.pads[name] is not None or torch.compiler.is_compiling() or x.dim() == 0 or \
            any(m._forward_hooks or m._forward_pre_hooks for m in parts) or \
            nn.modules.module._global_forward_hooks or \
            nn.modules.module._global_forward_pre_hooks:
        return None
    if type(base) is nn.Linear and isinstance(layer, TensorizedLinear):
        cls = _rows_class(layer, x)
    elif type(base) in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and \
            isinstance(layer, TensorizedConv) and base.groups == 1 and \
            base.padding_mode == "zeros" and \
            all(tuple(getattr(base, a)) == tuple(getattr(layer, a))
                for a in ("stride", "padding", "dilation")):
        cls = layer._running(x)
    else:
        return None
    if not getattr(cls, "applied", None) or layer.bias is not None:
        return None
    reused = cls.forward.__globals__["_reused"]  # the generated module's (see emit.weights)
    (weight,) = reused(layer, cls._weights)
    if offset is not None:
        (kept,) = reused(offset, cls._weights)  # a frozen copy builds once (keep_built)
        weight = weight - kept
    if cls.applied == "torch.matmul":  # x @ A: A built inputs first
        weight = weight.t()
    if weight.shape != base.weight.shape or weight.dtype != base.weight.dtype:
        return None
    scaling = module.scaling[name]
    weight = base.weight + weight if scaling == 1.0 else \
        torch.add(base.weight, weight, alpha=scaling)  # eager only: see forward
    if isinstance(base, nn.Linear):
        return F.linear(x, weight, base.bias)
    return base._conv_forward(x, weight, base.bias)  # with the base's padding mode


def _rows_class(layer: TensorizedLinear, x: torch.Tensor) -> type:
    """The class ``layer`` runs on ``x`` flattened to rows, found by the rows' shape (no view
    of ``x`` made, which would cost an op where nothing folds) and kept for the next call at
    that shape and mode, as ``Layer._running`` keeps its last class: ``Layer._class`` takes
    about 0.1 ms, a step's worth of it over a transformer's adapters. ``layer._classes`` is
    replaced when the layer plans anew (a planner set, a copy), which ends what was kept."""
    rows, now = (math.prod(x.shape[:-1]), x.shape[-1]), mode(x)
    seen = layer.__dict__.get("_rows_class")
    if seen is not None and seen[0] == rows and seen[1] == now and seen[2] is layer._classes:
        return seen[3]
    cls = layer._class(rows)
    layer.__dict__["_rows_class"] = (rows, now, layer._classes, cls)
    return cls


def less(layer: Layer, offset: Layer, x: torch.Tensor) -> torch.Tensor:
    """``layer(x) - offset(x)`` for a frozen ``offset`` of ``layer``'s network (``adapt``'s
    default start), in one run where it can be. Where the plan applies one weight built of the
    cores to the data, that is one contraction with the difference of the two weights (the
    generated ``_reused`` does it, asked by ``_minus``: exact at init). Else, while ``layer``
    trains on data that needs a gradient, a network whose cores all carry one bond and no
    other (low_rank, CP, a two-core TT) runs once at twice that bond, each core beside its
    copy along it, the copy's last core negated: the sum of the two networks, to float
    rounding; or, where the plan applies two weights built of the cores one after the other
    (TR), one chain at twice the bond between them (``_reused``, asked by ``_minus``). Else
    both run. The layers run as ``Layer.forward`` (a linear one on the data
    flattened to 2-D, once for all of them); an adapter with forward hooks of its own (a
    user's, FSDP's) runs as a module, with its copy apart, so that they fire as they did."""
    if torch.compiler.is_compiling() or layer._forward_hooks or layer._forward_pre_hooks:
        return layer(x) - offset(x)
    if isinstance(layer, TensorizedLinear):  # any leading dimensions, as its forward takes
        y = _less(layer, offset, x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return _less(layer, offset, x)


def _less(layer: Layer, offset: Layer, x: torch.Tensor) -> torch.Tensor:
    cls = layer._running(x)  # the offset runs the same class (its code is the adapter's)
    # the sum pays where the copy would run backward too: the data needs a gradient
    summed = not cls.alone and torch.is_grad_enabled() and x.requires_grad and \
        any(p.requires_grad for p in layer.parameters())
    if summed:
        doubled = _doubled(layer, offset)
        if doubled is not None:
            return _sum_of(layer, offset, doubled, x)
    if not (cls.alone or summed and cls.chain):
        return cls.forward(layer, x) - cls.forward(offset, x)
    layer.__dict__["_minus"] = offset
    try:
        a = cls.forward(layer, x)
    finally:  # _reused takes _minus out where it subtracted (not with a bias: it leaves it)
        unfolded = layer.__dict__.pop("_minus", None) is not None
    return a - cls.forward(offset, x) if unfolded else a


def _bond(net: Network) -> str | None:
    """The one index summed between cores, where every core carries it (None otherwise)."""
    bonds = net.with_role(Role.RANK, Role.HYPEREDGE)
    if len(bonds) != 1 or not all(bonds[0] in c.indices for c in net.cores) or \
            bonds[0] not in dict(net.params) or any(bonds[0] in _names(f) for _, f in net.derived):
        return None
    return bonds[0]


def _names(formula: Formula) -> set[str]:
    if formula[0] == "name":
        return {formula[1]}
    return set().union(*map(_names, formula[2])) if formula[0] == "chain" else set()


def _doubled(layer: Layer, offset: Layer) -> Layer | None:
    """A layer of ``layer``'s network at twice its bond (``doubled_bond`` names it; kept on
    ``offset``, its cores set for each call), or None where the network has no single bond
    or the layer a bias (the doubled network has one bias; the copy runs apart)."""
    if "_doubled" not in offset.__dict__:
        net, bond = layer.network, _bond(layer.network)
        doubled = None
        if bond is not None and layer.bias is None:  # a bias: the copy runs apart
            twice = dataclasses.replace(
                net, indices=tuple(dataclasses.replace(ix, size=2 * ix.size)
                                   if ix.name == bond else ix for ix in net.indices),
                params=tuple((n, 2 * v if n == bond else v) for n, v in net.params))
            cls = parametrize.type_before_parametrizations(layer)
            with torch.device("meta"):  # nothing drawn: the cores are set for each call
                doubled = cls(twice, planner=layer.planner, autotune=layer.autotune,
                              max_bytes=layer.max_bytes)
            doubled.__dict__["doubled_bond"] = bond
        offset.__dict__["_doubled"] = doubled  # not a submodule: nothing of it in the state
    return offset.__dict__["_doubled"]


def _sum_of(layer: Layer, offset: Layer, doubled: Layer, x: torch.Tensor) -> torch.Tensor:
    bond = doubled.doubled_bond
    cores = doubled._parameters  # the cores of this call, in place of its own
    last = layer.network.cores[-1]
    for core in layer.network.cores:
        theirs = getattr(offset, core.name)
        cores[core.name] = torch.cat((getattr(layer, core.name),
                                      theirs.neg() if core is last else theirs),
                                     core.indices.index(bond))
    try:
        return Layer.forward(doubled, x)
    finally:
        for core in layer.network.cores:  # hold no step's tensors between calls
            cores[core.name] = None


def delta_weight(layer: Layer, scaling: float) -> torch.Tensor:
    """``scaling`` times the adapter ``layer`` as a dense weight, from float64 copies of its
    cores (what merging adds to the base weight)."""
    # as attributes: a core bounded by a step rule is read as the network reads it, without
    # autograd (whose singular values may differ in the last bit), as a frozen copy was read
    with torch.no_grad():
        cores = {c.name: getattr(layer, c.name).double() for c in layer.network.cores}
    return decompose.dense_weight(layer.network, cores) * scaling


def frozen_copy(layer: Layer) -> Layer:
    """A layer of ``layer``'s network and class holding, as frozen plain parameters, the values
    ``layer``'s network reads now (a core under a step rule's parametrization included) and its
    bias. It runs ``layer``'s planned code (:attr:`Layer.code_of`), so it computes what
    ``layer`` computes until ``layer`` trains: bit for bit without autograd, to float rounding
    with it (a matmul may pick another kernel for a weight that requires grad)."""
    cls = parametrize.type_before_parametrizations(layer)
    first = next(layer.parameters())
    with torch.device("meta"):  # nothing drawn: the values are copied below
        twin = cls(layer.network, dtype=first.dtype, planner=layer.planner,
                   autotune=layer.autotune, max_bytes=layer.max_bytes)
    twin = twin.to_empty(device=first.device)
    with torch.no_grad():  # every parameter: to_empty left them uninitialized (the bias too)
        for name, p in twin.named_parameters():
            p.copy_(getattr(layer, name))
    twin.__dict__["code_of"] = layer  # not a submodule: no second copy in the state
    twin.keep_built = True  # frozen: what it builds of its cores is built once
    return twin.requires_grad_(False)


def inside_adapted(model: nn.Module) -> dict[int, str]:
    """``{id(module): name of its Adapted}`` for every module inside an :class:`Adapted` or a
    :class:`Saved` of ``model`` (its base, its adapters, its copies, and their parts)."""
    inside: dict[int, str] = {}
    for path, module in model.named_modules():
        if isinstance(module, (Adapted, Saved)):
            for _, part in module.named_modules(prefix=path):
                if part is not module:
                    inside.setdefault(id(part), path or "the model")
    return inside


def adapted_parts(model: nn.Module) -> dict[str, str]:
    """``{name: why}`` for every module inside an :class:`Adapted` of ``model``: what
    ``tensorize`` and ``compress`` leave alone."""
    inside = inside_adapted(model)
    return {name: f"inside the adapted module {inside[id(m)]!r}: merge_adapters first (or "
            "tensorize and compress before adapt)"
            for name, m in model.named_modules() if id(m) in inside}


def adapted_modules(model: nn.Module) -> list[tuple[str, Adapted | Saved]]:
    """The adapted layers and the modules trained in full, by name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (Adapted, Saved))]


def set_adapter(model: nn.Module, name: str) -> None:
    """Make adapter ``name`` the active one in every layer that has it (layers without it run
    their base alone) and the only trainable adapter; other parameters keep their flags. The
    modules trained in full (:class:`Saved`) run and train their copy for ``name``."""
    modules = [m for _, m in adapted_modules(model)]
    if not any(name in parts(m) for m in modules):  # checked before anything changes
        names = sorted({k for m in modules for k in parts(m)})
        raise SpecError(f"no layer has an adapter named {name!r}",
                        hint=f"the adapters are {', '.join(names) or 'none (call adapt)'}")
    for module in modules:
        module.active = name if name in parts(module) else None
        for key, layer in parts(module).items():
            layer.requires_grad_(key == name)


def parts(module: Adapted | Saved) -> nn.ModuleDict:
    """An adapted layer's adapters, or a saved module's copies, by adapter name."""
    return module.adapters if isinstance(module, Adapted) else module.copies
