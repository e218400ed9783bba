"""The module class: :class:`Layer`, a tensor-network layer as a ``torch.nn.Module``.

A Layer runs generated code: for each input shape it plans, lowers and prints the module's
source (``codegen``) and executes that source's ``forward`` (``runtime``), so the inline layer
and the file ``tnspec compile`` writes are the same code by construction. Where calibration
measures, the first call for a shape times the distinct candidate orders and keeps the fastest
(in the calibration cache, so another process times nothing). Under ``torch.compile`` it traces
the class its last eager call ran.
"""

from __future__ import annotations

import math
import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..ir import DEFAULT_MAX_BYTES, Network, Role, is_unit
from ..shapes import (bind_shape, check_shape, embedding_attributes, example_shape,
                      expected_axes, geometry, guard_bytes, lookup_shape, nn_attributes)
from ..language.settings import positive_limit
from ..fit import moments
from ..planning import calibration
from ..planning.measure import size_class
from ..planning.plan import Plan, check_planner, plan
from ..emit import runtime, safe
from ..emit.lower import Program, bias_shape, lower
from . import autotune, fitting
from .modes import AUTOCAST_DEVICES, Replans, autocast_dtype, mode

__all__ = ["Layer"]

logger = logging.getLogger("tnspec")


class Layer(nn.Module):
    """A tensor-network layer: one ``nn.Parameter`` per core, named as in the spec.

    Attributes: ``spec`` (the canonical expression), ``sizes`` (every bound index size),
    ``network`` (the IR). ``forward`` runs the generated code of the plan for the input's shape
    (planned once per size class: batch and spatial sizes within a factor of two share a plan;
    the last ``plan_cache_size`` are kept, settable per layer); :meth:`source` shows that code.
    Autotuning spends at most ``autotune_seconds`` per layer timing orders (settable per
    layer); past it, new size classes are planned by the cost model alone. ``keep_built``
    (settable, off): reuse what ``forward`` builds of the cores alone (a kernel, factor matrices)
    while no core needs a gradient and none changed (in-place ops, optimizer steps, ``.to``, a
    replaced core are seen; a write through ``.data`` is not). Frozen adapter copies set it.
    """

    plan_cache_size = 64
    autotune_seconds = 10.0
    #: the layer whose planned code this one runs (None: its own). A frozen copy of an adapter
    #: (``adapt(init="offset")``) runs its adapter's code, so that the two compute alike, bit
    #: for bit, while their cores are equal. Set through ``__dict__``: not a submodule.
    code_of: Layer | None = None
    keep_built: bool = False
    planner = Replans(check_planner, """How the order is chosen (``"auto"``, ``"dense-first"``, a
        planner of ``tnspec.planning.paths``); set, the layer plans anew at its next call.""")
    max_bytes = Replans(positive_limit, """The largest tensor of the forward pass a plan may
        make, in bytes; set, the layer plans anew at its next call.""")

    def __init__(self, network: Network, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, planner: str = "auto",
                 autotune: bool | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        super().__init__()
        safe.network(network)  # public dataclasses: a Network may be built by hand
        self.autotune = autotune
        self.network = network
        self.spec = network.spec
        # the sizes the spec is given: a unit axis (1) has none
        self.sizes = {i: n for i, n in network.sizes.items() if not is_unit(i)}
        self.planner, self.max_bytes = planner, max_bytes  # checked as set (Replans)
        for core in network.cores:
            shape = tuple(network.sizes[i] for i in core.indices)
            self.register_parameter(core.name, nn.Parameter(
                torch.empty(shape, dtype=dtype, device=device)))
        shape = bias_shape(network)
        if network.options.bias and shape:
            self.bias = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        geo = geometry(network)
        self._unbatched_dims = len(network.input.axes) - 1 if geo else -1
        self._image = geo is not None and len(geo.convs) == 2  # NCHW: channels-last exists
        axes = network.input.axes
        self._batch_first = bool(axes) and all(network.index(i).role is Role.BATCH
                                               for i in axes[0])
        self._spatial = tuple(k for k, axis in enumerate(axes)  # input axes a conv slides on
                              if any(network.index(i).role is Role.SPATIAL_IN for i in axis))
        if network.lookup:  # num_embeddings, ... as nn.Embedding has
            self.__dict__.update(embedding_attributes(network, self.sizes.__getitem__))
            self._unbatched_dims, self._spatial = -1, ()
        elif geo is not None:  # in_channels, kernel_size, ... as nn.Conv2d / nn.Linear have
            self.__dict__.update(nn_attributes(geo, self.sizes.__getitem__))
        self._drop_code()
        self.reset_parameters()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any,
                              **kwargs: Any) -> None:
        # a core saved without its unit axes loads (tucker2's 1x1 factors of a conv were 2-D)
        for core in self.network.cores:
            key, shape = prefix + core.name, getattr(self, core.name).shape
            saved = state_dict.get(key)
            if isinstance(saved, torch.Tensor) and saved.shape != shape and saved.shape == \
                    tuple(n for n, i in zip(shape, core.indices) if not is_unit(i)):
                state_dict[key] = saved.reshape(shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _drop_code(self) -> None:
        """Forget the loaded code (it is planned again on the next call); name the layer for
        tracing anew (a copy is another layer)."""
        self.__dict__["_trace_name"] = runtime.traced_as(self)
        self.__dict__.pop("_traced_class", None)
        self.__dict__.pop("_kept", None)
        self._classes: OrderedDict[tuple, type] = OrderedDict()
        self._plans: dict[tuple, tuple[tuple[int, ...], Plan]] = {}  # each class's shape, plan
        self._last_class: type | None = None
        self._last_shape: torch.Size | None = None
        self._last_stride: tuple[int, ...] | None = None
        self._last_mode: tuple | None = None  # autocast's dtype, grad mode (modes.mode)
        self._last_channels_last = False  # whether the last eager input was channels-last
        self.__dict__.setdefault("_tuning_spent", 0.0)  # seconds spent timing orders

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # generated classes are rebuilt, not pickled
        for name in ("_classes", "_plans", "_last_class", "_last_shape", "_last_stride",
                     "_last_mode", "_last_channels_last", "_trace_name"):
            del state[name]
        for name in ("_traced_class", "_kept", "_doubled", "_rows_class"):  # built as needed
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in ("planner", "max_bytes"):  # pickled before they were Replans
            if name in state:
                state["_" + name] = state.pop(name)
        super().__setstate__(state)
        self._drop_code()

    def reset_parameters(self) -> None:
        """Draw every core for the layer's init (respects ``torch.manual_seed``); zero the bias.
        Runs the generated ``reset_parameters``."""
        runtime.layer_class(self.network, None).reset_parameters(self)

    def plan(self, shape: Sequence[int]) -> Plan:
        """The contraction plan a contiguous input of ``shape`` runs (print ``.report()`` to see
        it): the ``planner``'s order, or, where the layer autotunes, the order timed fastest
        (timed now if that shape was not run yet)."""
        shape = tuple(int(n) for n in shape)
        if self.network.lookup:  # the shape of the indices
            shape = lookup_shape(self.network, shape)
        key = self._key(shape, False)
        if key not in self._plans and self._tunes():
            self._class(shape)
        return self._plans[key][1] if key in self._plans else self._plan(shape)

    def _plan(self, shape: tuple[int, ...], channels_last: bool = False) -> Plan:
        return plan(bind_shape(self.network, shape), self.planner, max_bytes=self.max_bytes,
                    itemsize=self._itemsize(), **self._measured(channels_last))

    def _where(self) -> tuple[torch.device, torch.dtype]:
        """The device the cores live on and the dtype the contraction runs in there: the
        cores' own, or autocast's where it is on for that device and the cores are float32."""
        first = next(self.parameters(), None)
        if first is None:
            return torch.device("cpu"), torch.float32
        # autocast raises when asked about a device it does not know (meta, where large
        # models are built before their weights are loaded)
        known = first.device.type in AUTOCAST_DEVICES
        lower = autocast_dtype(first.device.type) if first.dtype == torch.float32 and known \
            else None
        return first.device, lower or first.dtype

    def _itemsize(self) -> int:
        return self._where()[1].itemsize

    def _measured(self, channels_last: bool = False) -> dict[str, Any]:
        """The cost model and op chooser of the device and dtype the contraction runs in (the
        chooser times the data laid out as the input arrives: ``channels_last`` or not)."""
        where = self._where()
        return dict(model=calibration.cost_model(*where), choose=calibration.chooser(
            *where, training=torch.is_grad_enabled(), channels_last=channels_last))

    def program(self, shape: Sequence[int], channels_last: bool = False) -> Program:
        """The lowered program for an input of ``shape`` (laid out channels-last if asked)."""
        return lower(self.plan(shape), channels_last)

    def dense_weight(self) -> torch.Tensor:
        """The equivalent dense weight, differentiable in the cores: for an index input the
        ``(num_embeddings, embedding_dim)`` table ``nn.Embedding`` holds (the ``padding_idx``
        row zero, as the layer reads it); else ``(out, in // groups,
        *kernel)`` as ``nn.Conv1d/2d/3d`` holds it, or ``(out, in)`` as ``nn.Linear``, grouped
        modes flattened row-major as the layer's input and output are. So
        ``F.conv2d(x, layer.dense_weight(), layer.bias, layer.stride, layer.padding,
        layer.dilation, layer.groups)`` equals ``layer(x)``. A SpecError for a network that is
        neither conv-like nor linear-like."""
        return fitting.dense_weight(self.network, self._cores())

    def fit_(self, weight: torch.Tensor, *, inputs: torch.Tensor | None = None,
             max_iter: int = 200, tol: float = 1e-7, starts: int = 4, hops: int = 64,
             max_seconds: float | None = 60.0) -> float:
        """Set the cores, in place, so that :meth:`dense_weight` approximates ``weight`` (an
        ``nn.ConvNd``/``nn.Linear`` weight of that shape); return the relative error
        ``||dense_weight() - weight|| / ||weight||`` reached, computed from the cores as set.

        Alternating least squares from an SVD start (Tucker factors, chain ends) or, for cores
        without one, the best of ``starts`` Graph-in random starts, then up to ``hops`` basin
        hops (a few cores of the best fit redrawn and the sweeps run again, kept when better:
        what lets loopy networks such as Odd reach their optimum); at most ``max_iter``
        sweeps a run, stopping when one improves the error by less than ``tol`` of it. Works
        for any conv-like or linear-like network, on the layer's device, in float64
        internally. ``max_seconds`` bounds the whole fit (None: no limit): past it the best
        fit so far is kept, and a ``tnspec`` log record at INFO says so. The bias is left
        alone. The global RNG is untouched.

        ``inputs`` (sample inputs of the layer, as its ``forward`` takes them: the activations
        that reach it) fits the layer's *outputs* instead: ``E ||(W_fit - W) p||^2`` over the
        inputs' patches ``p`` (``tnspec.fit.moments``), from the weight-only fit; the return value
        is then the relative output error on ``inputs``, ``||(W_fit - W) p|| / ||W p||`` (bias
        aside)."""
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"fit_ takes the dense weight as a torch.Tensor, got "
                            f"{type(weight).__name__}")
        metric = None if inputs is None else moments.of_inputs(self, inputs)
        return self._fit(weight, metric, max_iter=max_iter, tol=tol, starts=starts, hops=hops,
                         max_seconds=max_seconds)

    def _fit(self, weight: torch.Tensor, metric: torch.Tensor | None, **options: Any) -> float:
        """:meth:`fit_` with the inputs' metric factor (``tnspec.fit.moments``) already built."""
        table = (self.num_embeddings, self.embedding_dim) if self.network.lookup else None
        return fitting.fit(self.network, self._cores, weight, metric, table, **options)

    def _cores(self) -> dict[str, torch.Tensor]:
        """The cores by name, read as attributes: a core under a parametrization is read as the
        network reads it."""
        return {c.name: getattr(self, c.name) for c in self.network.cores}

    def source(self, shape: Sequence[int]) -> str:
        """The generated module whose ``forward`` this layer runs for an input of ``shape``:
        the text ``tnspec compile`` writes for that plan."""
        shape = tuple(int(n) for n in shape)
        if self.network.lookup:  # the shape of the indices
            shape = lookup_shape(self.network, shape)
        return runtime.source_of(self._class(shape).forward)

    def _class(self, shape: tuple[int, ...], channels_last: bool = False) -> type:
        """The generated class for ``shape``, planned once per size class (and layout: orders
        are timed on a ``channels_last`` input when the caller's is), then cached (least
        recently used first out beyond ``plan_cache_size``). Batch sizes within a factor of
        two share a class (see :func:`~tnspec.planning.measure.size_class`): any plan computes any
        shape, and a smaller last batch is not worth planning again. Under autocast the
        class is planned (and timed) for autocast's dtype, apart from the cores' own."""
        key = self._key(shape, channels_last)
        classes = self._classes
        if key in classes:
            classes.move_to_end(key)
            planned, the_plan = self._plans[key]
            if shape != planned:  # another size in the class: the size guard, at this size
                bound = bind_shape(self.network, shape)
                guard_bytes(bound, [(str(s.result), math.prod(bound.sizes[i] for i in
                                                              s.result.indices))
                                    for s in the_plan.steps], self.max_bytes, self._itemsize())
            return classes[key]
        start = time.perf_counter()
        if self._tunes():
            cls, the_plan, work = autotune.fastest(self, shape, channels_last)
            self._tuning_spent += time.perf_counter() - start
            if self._tuning_spent >= self.autotune_seconds:
                logger.info("%s: %.1f s spent timing orders, past autotune_seconds=%g: new "
                            "size classes are planned by the cost model alone", self.spec,
                            self._tuning_spent, self.autotune_seconds)
        else:
            the_plan, work = self._plan(shape, channels_last), "planned, nothing timed"
            cls = runtime.layer_class(self.network, the_plan, channels_last)
        self._plans[key] = (shape, the_plan)
        spent = time.perf_counter() - start
        # a first call that blocks for seconds should not be silent (docs/performance.md)
        logger.log(logging.INFO if spent > 1.0 else logging.DEBUG,
                   "%s for %s: first call took %.2f s (%s)%s", self.spec,
                   # a lookup's planned shape ends in the one-hot axis the caller never sees
                   f"{list(shape[:-1])} indices" if self.network.lookup else
                   f"input {list(shape)}",
                   spent, work, "; to avoid it: warm up with one call per shape, keep the "
                   "calibration cache, or autotune=False" if spent > 1.0 else "")
        classes[key] = cls
        while len(classes) > self.plan_cache_size:
            self._plans.pop(classes.popitem(last=False)[0], None)
        return cls

    def _key(self, shape: tuple[int, ...], channels_last: bool) -> tuple:
        """What a class is planned and kept for: the shape's size class, the layout, under
        autocast the dtype the contraction runs in, and whether it is served (no autograd:
        its channel mixing is timed forward alone)."""
        where = self._where()
        return self._shape_key(shape) + (("channels_last",) if channels_last else ()) + \
            ((str(where[1]),) if where[1] != next(self.parameters()).dtype else ()) + \
            (() if torch.is_grad_enabled() else ("served",))

    def _shape_key(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape's size class: batch and spatial sizes to the nearest power of two."""
        classed = {0} if self._batch_first else set()
        classed |= {k + len(shape) - len(self.network.input.axes) for k in self._spatial}
        return tuple(size_class(n) if k in classed else n for k, n in enumerate(shape))

    def _tunes(self) -> bool:
        """``autotune``, which by default (None) is on where calibration measures; never for a
        planner other than ``auto``: the order asked for is the order that runs."""
        if self.planner != "auto" or self._tuning_spent >= self.autotune_seconds or \
                calibration.capturing():  # nothing is timed inside a CUDA graph capture
            return False
        if self.autotune is not None:
            return self.autotune
        first = next(self.parameters(), None)
        return first is not None and calibration.measures(first.device)

    def _planned(self, shape: tuple[int, ...], channels_last: bool = False) -> type:
        return runtime.layer_class(self.network, self._plan(shape, channels_last),
                                   channels_last)

    def _compilable_class(self) -> type:
        """The class a ``torch.compile``-d call traces: the one the last eager call ran, or,
        before any eager call, the plan of the example shape (the default sizes, 32 for the
        others) with its channel mixing as 1x1 convolutions, since timing which op is faster
        has no place in a trace. Any plan computes any shape."""
        if self._last_class is not None:
            return runtime.compiled_form(self._last_class, self._last_channels_last)
        shape = tuple(example_shape(self.network, {}))
        if len(shape) == self._unbatched_dims:
            shape = (1, *shape)
        # traced: nothing is measured now (under torch.export's fake tensors it cannot be)
        model = calibration.cost_model(*self._where(), measure_now=False)
        the_plan = plan(bind_shape(self.network, shape), self.planner, max_bytes=self.max_bytes,
                        itemsize=self._itemsize(), model=model, choose=lambda step: "conv1x1")
        return runtime.layer_class(self.network, the_plan, compiled=True)

    def _time(self, classes: list[type], shape: tuple[int, ...], repeats: int,
              channels_last: bool = False) -> list[autotune.Timing]:
        """The median and spread of each class's forward and backward, or forward alone
        where called without autograd (see :func:`autotune.time_orders`)."""
        return autotune.time_orders(self, classes, shape, repeats, channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:  # free unless raised: a list fails on .shape, an array inside the generated code
            return self._running(x).forward(self, x)
        except AttributeError:
            if isinstance(x, torch.Tensor):
                raise
            raise TypeError(f"{type(self).__name__} takes a torch.Tensor, not "
                            f"{type(x).__name__}; convert it with torch.as_tensor(x)") from None

    def _running(self, x: torch.Tensor) -> type:
        """The generated class ``forward`` runs on ``x`` (planned and timed now where not yet)."""
        owner = self if self.code_of is None else self.code_of
        if _is_compiling():
            # planning is plain Python that dynamo should not trace: it runs once, at
            # trace time, as a constant, and leaves the class on the layer (see
            # runtime.compilable_key)
            runtime.compilable_key(owner._trace_name)
            cls = owner._traced_class
        elif x.shape == owner._last_shape and x.stride() == owner._last_stride and \
                mode(x) == owner._last_mode:
            cls = owner._last_class  # the hot path: the same shape, layout, precision, mode
        else:
            shape = lookup_shape(self.network, x.shape) if self.network.lookup else \
                tuple(x.shape)
            if owner._unbatched_dims >= 0:  # checked here, to quote the shape as given
                net, unbatched = self.network, len(shape) == owner._unbatched_dims
                check_shape(net.input.name, expected_axes(net.input, net.sizes), shape,
                            unbatched)
                if unbatched:  # planned as a batch of one
                    shape = (1, *shape)
            last = x.dim() == 4 and not x.is_contiguous() and \
                x.is_contiguous(memory_format=torch.channels_last)
            cls = owner._class(shape, last)  # also keeps the cache's order LRU
            # not through nn.Module.__setattr__, which is slow
            owner.__dict__.update(
                _last_class=cls, _last_shape=x.shape, _last_stride=x.stride(),
                _last_channels_last=last,
                _last_mode=mode(x))
        return cls

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Layer:
        # the generated _apply where the layer has one: cores that model.to(memory_format=...)
        # would fail on are converted flat (see codegen)
        own = vars(runtime.layer_class(self.network, None)).get("_apply")
        return own(self, fn, recurse) if own else super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        opts = self.network.options
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        return f"{self.spec!r}, {sizes}, init={opts.init!r}, activation={opts.activation!r}"


_is_compiling = torch.compiler.is_compiling  # dynamo knows the function itself
