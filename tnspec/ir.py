"""The intermediate representation: a tensor network as plain, frozen data.

A :class:`Network` is one *data tensor* flowing through *cores* into one *result tensor*::

    Network
      input:   Tensor   the data operand (x in a forward network, dy in a backward one)
      cores:   Tensor*  the learnable factors, in written order
      output:  Tensor   the result (y, or dx)
      indices: Index*   every index once, with its size and its Role
      convs:   Conv*    the convolution relations (the paper's dummy tensors)

- ``Tensor.axes`` lists one tuple of index names per tensor dimension; a tuple of two or more
  names is a group ``(i0 i1)`` whose dimension is the row-major product (einops convention).
  Cores have single-name axes. ``Tensor.flipped`` names kernel indices read in reverse (the
  reversal matrix R of the reproducing transformation; empty in forward networks).
- ``Index.size`` is None for sizes bound from the data at run time (batch, spatial) until
  :meth:`Network.bind` sets them (and ``Index.runtime``).
- A :class:`Conv` relates a data-side spatial index ``source`` (j), a result-side index
  ``target`` (j') and a kernel index ``kernel`` (k) by ``P[j, j', k] = 1 iff
  j = stride * j' + dilation * k - padding``; data positions outside the tensor read as zero.
  ``input_dilation`` > 1 first spreads the data with zeros (the transformation matrix T; backward
  networks only). The source index of a forward relation is named by its canonical affine text,
  e.g. ``"2*h+kh-1"``, so the name is also how the spec writes it.
- Roles are derived from which tensors carry an index (see :func:`assign_roles`); the same rule
  serves forward and backward networks, so nothing here assumes which tensor is "x".

Nothing in this module imports torch or a later stage: the stages are functions of a Network
(``tnspec.backward``, ``tnspec.backbone``, ``tnspec.explain``, ``Layer.plan``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Iterable, Mapping

#: the largest core (or bias) a spec may declare, in elements
DEFAULT_MAX_ELEMENTS = 2**31
#: the most one tensor of the forward pass (padded input, intermediate, output) may take, in
#: bytes at the batch the layer is called with
DEFAULT_MAX_BYTES = 2**33
#: attributes of torch.nn.Module (torch 2.x) and of tnspec modules; a core named like one of
#: these could not be registered under its own name (tests keep this in step with torch)
RESERVED_NAMES = frozenset("""
    T_destination add_module apply bfloat16 buffers call_super_init children compile cpu cuda
    double dump_patches eval extra_repr float forward get_buffer get_extra_state get_parameter
    get_submodule half ipu load_state_dict modules mtia named_buffers named_children
    named_modules named_parameters parameters register_backward_hook register_buffer
    register_forward_hook register_forward_pre_hook register_full_backward_hook
    register_full_backward_pre_hook register_load_state_dict_post_hook
    register_load_state_dict_pre_hook register_module register_parameter
    register_state_dict_post_hook register_state_dict_pre_hook requires_grad_ set_extra_state
    set_submodule share_memory state_dict to to_empty train training type xpu zero_grad
    bias spec sizes network plan program planner autotune max_elements reset_parameters self
    source plan_cache_size autotune_seconds max_bytes in_channels out_channels kernel_size stride
    padding dilation groups in_features out_features dense_weight fit_ code_of keep_built
    torch
""".split())
#: torch has conv1d, conv2d and conv3d: one step resolves at most three relations
MAX_CONV_DIMS = 3


def unit_name(core: str, axis: int) -> str:
    """The index name of a unit axis (written ``1``) at position ``axis`` of ``core``: it starts
    with a digit, so no written name is like it, and it is unique to that axis."""
    return f"1.{core}.{axis}"


def is_unit(name: str) -> bool:
    """Whether an index name is a unit axis's (:func:`unit_name`)."""
    return name[:2] == "1."  # no written name, nor a conv's affine text (2*h+k-1), is so


def without_units(net: "Network") -> "Network":
    """``net`` with its cores' unit axes left out: the same layer, each core reshaped (``net``
    itself where there are none)."""
    if not any(ix.role is Role.UNIT for ix in net.indices):
        return net
    cores = tuple(replace(c, axes=tuple(a for a in c.axes if not is_unit(a[0])))
                  for c in net.cores)
    return replace(net, cores=cores,
                   indices=tuple(ix for ix in net.indices if ix.role is not Role.UNIT))


def clashes(core: str) -> bool:
    """Whether a core of this name cannot be an attribute of the generated module under its own
    name: one of :data:`RESERVED_NAMES`, or a leading underscore (Python mangles
    ``self.__W`` inside the generated class; ``_W`` is the module's private space)."""
    return core in RESERVED_NAMES or core.startswith("_")


class Role(str, Enum):
    """What an index does in the network (docs/language.md)."""

    BATCH = "batch"              # data and result, no core: carried through untouched
    PARALLEL = "parallel"        # data, core and result: depthwise / grouped
    INPUT_MODE = "input-mode"    # data and core, not result: summed
    OUTPUT_MODE = "output-mode"  # core and result, not data
    RANK = "rank"                # two cores only: summed
    HYPEREDGE = "hyperedge"      # three or more cores only (the paper's phi): summed
    KERNEL = "kernel"            # the window of a conv relation, carried by cores: summed
    SPATIAL_IN = "spatial-in"    # data-side axis of a conv relation
    SPATIAL_OUT = "spatial-out"  # result-side axis of a conv relation
    UNIT = "unit"                # a unit axis of one core (written 1): length 1, summed

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Index:
    name: str
    size: int | None
    role: Role
    runtime: bool = False  # the size was bound from the data (Network.bind), not the spec


@dataclass(frozen=True)
class Conv:
    """One convolution relation: ``source = stride*target + dilation*kernel - padding``."""

    source: str
    target: str
    kernel: str | None
    stride: int = 1
    dilation: int = 1
    padding: int = 0
    input_dilation: int = 1

    @property
    def text(self) -> str:
        """The affine text, e.g. ``2*h+kh-1``."""
        text = self.target if self.stride == 1 else f"{self.stride}*{self.target}"
        if self.kernel is not None:
            text += "+" + (self.kernel if self.dilation == 1 else f"{self.dilation}*{self.kernel}")
        if self.padding:
            text += f"-{self.padding}" if self.padding > 0 else f"+{-self.padding}"
        return text


@dataclass(frozen=True)
class Tensor:
    name: str
    axes: tuple[tuple[str, ...], ...]
    flipped: frozenset[str] = frozenset()

    @property
    def indices(self) -> tuple[str, ...]:
        """Every index name of the tensor, groups flattened, in written order."""
        return tuple(n for axis in self.axes for n in axis)


INITS = ("graph-in", "graph-out", "graph-avg", "kaiming-in", "kaiming-out", "xavier",
         "orthogonal", "naive")
ACTIVATIONS = ("linear", "relu", "leaky_relu", "tanh", "sigmoid", "gelu", "silu")
DISTRIBUTIONS = ("normal", "uniform")
STRIDE_COUNTS = ("paper", "exact")


@dataclass(frozen=True)
class Options:
    """Per-layer options. ``activation`` is a name from ACTIVATIONS or a number (the scale p_a);
    ``activation_param`` is the slope of leaky_relu. ``init_weights`` is set from Python only."""

    init: str = "graph-in"
    activation: str | float = "relu"
    activation_param: float | None = None
    bias: bool = True
    distribution: str = "normal"
    stride_count: str = "paper"  # "exact": graph-out counts K/s taps on a strided axis
    init_weights: tuple[tuple[str, float], ...] = ()  # relative shares of prod Var, by core
    # an index input only: the row whose output is zero and gets no gradient, and the
    # vocabulary when it is smaller than the product of the modes (None: that product)
    padding_idx: int | None = None
    num_embeddings: int | None = None


#: a size formula: ("int", 3), ("name", "k"), or ("chain", operators, formulas): the formulas
#: joined left to right by the operators (+ - or * //), e.g. ("chain", ("+",), (a, b))
Formula = tuple


@dataclass(frozen=True)
class Network:
    input: Tensor
    cores: tuple[Tensor, ...]
    output: Tensor
    indices: tuple[Index, ...]
    convs: tuple[Conv, ...] = ()
    name: str | None = None
    options: Options = field(default_factory=Options)
    #: the layer's size parameters with their (bound) values, and its derived sizes in order;
    #: for an inline expression every given size is a parameter
    params: tuple[tuple[str, int], ...] = ()
    derived: tuple[tuple[str, Formula], ...] = ()
    #: an index input (``x[b] in (v0 v1)``): the data holds integers into the modes of its
    #: last axis, the one-hot input the network contracts, which is never built
    lookup: bool = False

    # ---- lookups ----------------------------------------------------------------------------

    def index(self, name: str) -> Index:
        """The :class:`Index` called ``name`` (KeyError if there is none)."""
        for ix in self.indices:
            if ix.name == name:
                return ix
        raise KeyError(name)

    @property
    def sizes(self) -> dict[str, int]:
        """Every bound index size (run-time sizes are absent until bound)."""
        return {ix.name: ix.size for ix in self.indices if ix.size is not None}

    def with_role(self, *roles: Role) -> tuple[str, ...]:
        """The names of the indices having one of ``roles``, in the network's order."""
        return tuple(ix.name for ix in self.indices if ix.role in roles)

    def conv_of(self, name: str) -> Conv | None:
        """The relation whose source, target or kernel is ``name``."""
        for c in self.convs:
            if name in (c.source, c.target, c.kernel):
                return c
        return None

    # ---- derived data -----------------------------------------------------------------------

    @property
    def spec(self) -> str:
        """The canonical one-line expression, without sizes."""
        def axis(names: tuple[str, ...]) -> str:
            if len(names) == 1:
                return "1" if is_unit(names[0]) else names[0]
            return "(" + " ".join(names) + ")"

        def operand(t: Tensor) -> str:
            return f"{t.name}[{', '.join(axis(a) for a in t.axes)}]"
        data = operand(self.input)
        if self.lookup:
            data = operand(replace(self.input, axes=self.input.axes[:-1])) + \
                " in " + axis(self.input.axes[-1])
        return ", ".join([data] + [operand(t) for t in self.cores]) + " -> " + \
            operand(self.output)

    @property
    def vocabulary(self) -> int:
        """An index input's number of valid indices (``num_embeddings``, default the product
        of its modes)."""
        return self.options.num_embeddings or self.table_rows

    @property
    def table_rows(self) -> int:
        """An index input's rows: the product of its modes (the one-hot axis's length)."""
        return math.prod(self.sizes[i] for i in self.input.axes[-1])

    @property
    def embedded(self) -> tuple[str, ...]:
        """An index input's output indices per lookup: the output's after the axes it repeats
        from the input."""
        return tuple(i for axis in self.output.axes[len(self.input.axes) - 1:] for i in axis)

    def core_numel(self, core: Tensor) -> int:
        """Elements of ``core`` at the bound sizes."""
        return math.prod(self.index(n).size or 1 for n in core.indices)

    @property
    def num_parameters(self) -> int:
        """Elements of all cores (the bias excluded)."""
        return sum(self.core_numel(c) for c in self.cores)

    @property
    def dense_parameters(self) -> int:
        """Elements of the equivalent dense kernel: every mode, kernel and parallel index once."""
        dense_roles = (Role.INPUT_MODE, Role.OUTPUT_MODE, Role.KERNEL, Role.PARALLEL)
        return math.prod(self.index(n).size or 1 for n in self.with_role(*dense_roles))

    def summary(self) -> str:
        """One line: cores, parameters against the dense kernel, conv dimensions, hyperedges."""
        n, dense = self.num_parameters, self.dense_parameters
        text = (f"{len(self.cores)} core{'s' * (len(self.cores) != 1)}, {n:,} parameters "
                f"(dense {dense:,}, {dense / max(n, 1):.1f}x fewer)")
        if self.convs:
            text += f", {len(self.convs)}-D conv"
        hyper = self.with_role(Role.HYPEREDGE)
        if hyper:
            text += f", hyperedge{'s' * (len(hyper) > 1)} {', '.join(hyper)}"
        return text

    def bind(self, sizes: Mapping[str, int]) -> "Network":
        """The same network with run-time sizes (batch, spatial) bound."""
        known = {ix.name for ix in self.indices}
        unknown = set(sizes) - known
        if unknown:
            raise KeyError(f"no index named {sorted(unknown)[0]!r}")
        new = tuple(replace(ix, size=int(sizes[ix.name]), runtime=True) if ix.name in sizes
                    else ix for ix in self.indices)
        return replace(self, indices=new)


def assign_roles(data: Tensor, cores: Iterable[Tensor], result: Tensor,
                 convs: Iterable[Conv]) -> dict[str, Role]:
    """The role of every index, from which tensors carry it (see :class:`Role`).

    Indices that fit no role (a core index on one core only, say) are left out; the checker
    reports them.
    """
    convs = tuple(convs)
    cores = tuple(cores)
    sources = {c.source for c in convs}
    targets = {c.target for c in convs}
    kernels = {c.kernel for c in convs if c.kernel is not None}
    in_cores = Counter(n for c in cores for n in dict.fromkeys(c.indices))  # set order varies
    data_names, result_names = set(data.indices), set(result.indices)
    names = dict.fromkeys([*data.indices, *in_cores, *result.indices])
    roles: dict[str, Role] = {}
    for name in names:
        in_data = name in data_names
        in_result = name in result_names
        n_cores = in_cores[name]
        if is_unit(name):
            roles[name] = Role.UNIT
        elif name in sources:
            roles[name] = Role.SPATIAL_IN
        elif name in targets:
            roles[name] = Role.SPATIAL_OUT
        elif name in kernels:
            roles[name] = Role.KERNEL
        elif in_data and in_result:
            roles[name] = Role.PARALLEL if n_cores else Role.BATCH
        elif in_data and n_cores:
            roles[name] = Role.INPUT_MODE
        elif in_result and n_cores:
            roles[name] = Role.OUTPUT_MODE
        elif n_cores >= 3:
            roles[name] = Role.HYPEREDGE
        elif n_cores == 2:
            roles[name] = Role.RANK
    return roles
