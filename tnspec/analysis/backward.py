"""Backward: the reproducing transformation (Pan et al. 2022, Theorem 1).

For one relation ``j = s*j' + d*k - p`` the gradient of the data is again a convolution:
``dx = (dy T) * (R w)``: dy spread by the stride (T inserts s-1 zeros), the kernel read reversed
(R), padding ``d(K-1) - p`` and stride 1. Applied to every relation of a network it gives the
backward network G_bt, a :class:`~tnspec.ir.Network` like any other: its data is dy (the
forward result's indices), its cores are the forward cores with every kernel index flipped, its
result is dx. The same planner and lowering execute it, and the same analysis gives Graph-out.

A kernel-less relation (pure subsampling ``j = s*j' - p``) becomes ``t = j + p`` over the
spread dy: negative padding, which the IR allows for backward networks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ..ir import Conv, Index, Network, Options, Role, Tensor, assign_roles


def backward(net: Network, data_shape: Sequence[int] | None = None) -> Network:
    """G_bt of ``net``. ``data_shape``, the forward data's shape, pins dx's spatial sizes to
    x's (including the remainder a strided conv drops); without it they follow the formula."""
    sizes = net.sizes
    k_size = {c.kernel: sizes[c.kernel] for c in net.convs if c.kernel is not None}
    convs = []
    for c in net.convs:
        if c.kernel is None:
            convs.append(Conv(c.target, c.source, None, 1, 1, -c.padding, c.stride))
        else:
            padding = c.dilation * (k_size[c.kernel] - 1) - c.padding
            convs.append(Conv(c.target, c.source, c.kernel, 1, c.dilation, padding, c.stride))
    kernels = frozenset(k_size)
    cores = tuple(replace(t, flipped=kernels & set(t.indices)) for t in net.cores)
    dy = Tensor("d" + net.output.name, net.output.axes)
    dx = Tensor("d" + net.input.name, net.input.axes)
    roles = assign_roles(dy, cores, dx, convs)
    pinned = _spatial_sizes(net, data_shape) if data_shape is not None else {}
    indices = tuple(Index(i, pinned.get(i, sizes.get(i) if roles[i] not in _DATA else None),
                          roles[i]) for i in roles)
    return Network(dy, cores, dx, indices, tuple(convs), net.name and net.name + "_backward",
                   Options(init=net.options.init, activation="linear", bias=False))


#: roles whose sizes the data brings at run time
_DATA = (Role.BATCH, Role.SPATIAL_IN, Role.SPATIAL_OUT)


def _spatial_sizes(net: Network, shape: Sequence[int]) -> dict[str, int]:
    """The forward data's spatial sizes, by index name, read from its shape."""
    if len(shape) != len(net.input.axes):
        raise ValueError(f"{net.input.name}: expected {len(net.input.axes)} axes, got "
                         f"{list(shape)}")
    sources = {c.source for c in net.convs}
    return {axis[0]: int(n) for axis, n in zip(net.input.axes, shape) if axis[0] in sources}
