"""Stage 5b, runtime: the interpreter that executes a lowered Program with torch.

Inline modules (``tnspec.layer``) call :func:`run` on every forward; generated modules print
the same statements as Python instead (``codegen``), so both compute the same thing.
"""

from __future__ import annotations

from typing import Any, Mapping

from .lower import Dim, Program, check_shape


def run(program: Program, data: Any, params: Mapping[str, Any], sizes: Mapping[str, int],
        bias: Any = None) -> Any:
    """Execute ``program`` with torch: ``params`` maps core names to tensors, ``sizes`` gives
    every static index size by index name."""
    import torch
    import torch.nn.functional as F

    env: dict[str, Any] = {program.data: data}
    for var, index in program.sizes:
        env[var] = sizes[index]

    def dim(d: Dim) -> int:
        if isinstance(d, int):
            return d
        n = 1
        for part in d.split("*"):
            n *= env[part]
        return n

    for s in program.stmts:
        a = s.args
        if s.op == "expect":
            check_shape(a[2], [(t, None if d is None else dim(d)) for t, d in a[1]],
                        tuple(env[a[0]].shape))
        elif s.op == "unpack":
            for name, n in zip(a[1], env[a[0]].shape):
                if name is not None:
                    env[name] = int(n)
        elif s.op == "infer":
            known = dim(a[1])
            if env[a[0]] % known:
                raise ValueError(f"{a[2]} has size {env[a[0]]}, not a multiple of {known}")
            env[s.out] = env[a[0]] // known
        elif s.op == "conv_size":
            n, k, stride, dil, pad, idil = dim(a[0]), dim(a[1]), a[2], a[3], a[4], a[5]
            if s.out not in env:  # a bound target size (backward networks) is kept
                env[s.out] = ((n - 1) * idil + 1 + 2 * pad - dil * (k - 1) - 1) // stride + 1
            if env[s.out] < 1:
                raise ValueError(f"input too small: {s.comment} gives size {env[s.out]}")
        elif s.op == "param":
            t = params[a[0]]
            env[s.out] = t.flip(a[1]) if a[1] else t
        elif s.op == "reshape":
            env[s.out] = env[a[0]].reshape(tuple(dim(d) for d in a[1]))
        elif s.op == "alias":
            env[s.out] = env[a[0]]
        elif s.op == "permute":
            env[s.out] = env[a[0]].permute(a[1])
        elif s.op == "einsum":
            env[s.out] = torch.einsum(a[0], env[a[1]], env[a[2]])
        elif s.op == "conv":
            env[s.out] = _conv(F, env, dim, *a)
        elif s.op == "linear":
            env[s.out] = F.linear(env[a[0]], env[a[1]])
        elif s.op == "subsample":
            t, axis, stride, pad, length = env[a[0]], a[1], a[3], a[4], dim(a[5])
            # positions -pad, -pad + stride, ...: pad (or crop, if negative) to exactly that span
            right = (length - 1) * stride + 1 - t.shape[axis] - pad
            if pad or right:
                t = F.pad(t, [0, 0] * (t.dim() - axis - 1) + [pad, right])
            env[s.out] = t[(slice(None),) * axis + (slice(None, None, stride),)]
        elif s.op == "spread_size":
            env[s.out] = (dim(a[0]) - 1) * a[1] + 1
        elif s.op == "dilate":
            t, axis, factor = env[a[0]], a[1], a[2]
            shape = list(t.shape)
            shape[axis] = (shape[axis] - 1) * factor + 1
            spread = t.new_zeros(shape)
            spread[(slice(None),) * axis + (slice(None, None, factor),)] = t
            env[s.out] = spread
        elif s.op == "bias":
            env[s.out] = env[a[0]] if bias is None else \
                env[a[0]] + bias.reshape(tuple(dim(d) for d in a[1]))
        else:  # pragma: no cover - lowering emits only the ops above
            raise AssertionError(f"unknown op {s.op}")
    return env[program.result]


def _conv(F: Any, env: dict[str, Any], dim: Any, nd: int, x: str, w: str, stride: tuple,
          padding: tuple, dilation: tuple, groups: Dim, targets: tuple) -> Any:
    """Grouped conv; explicit (possibly negative) padding when a bound target size needs it."""
    xt, wt = env[x], env[w]
    spatial_in = xt.shape[2:]
    pads: list[int] = []
    symmetric = True
    for n, t, k, s, d, p in zip(spatial_in, targets, wt.shape[2:], stride, dilation, padding):
        right = s * (dim(t) - 1) + d * (k - 1) - p - (n - 1)
        symmetric &= right == p and p >= 0
        pads = [p, right] + pads
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    if symmetric:
        return conv(xt, wt, None, stride, padding, dilation, dim(groups))
    return conv(F.pad(xt, pads), wt, None, stride, 0, dilation, dim(groups))
