"""An independent dense reference: materialize every dummy tensor and run one einsum.

P[j, j', k] = 1 iff j = stride*j' + dilation*k - padding (j over the data axis, spread by
input_dilation first), exactly as docs/language.md defines it. Nothing here uses tnspec's planner or
lowering; only the network's structure is read from the IR.
"""

from __future__ import annotations

import opt_einsum
import torch

from tnspec import Network

LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def dummy(n_in: int, n_out: int, k: int, stride: int, dilation: int, padding: int,
          input_dilation: int = 1, dtype=torch.float64) -> torch.Tensor:
    """P[j, j', k] over the *undilated* data axis j (input dilation folded in)."""
    P = torch.zeros(n_in, n_out, k, dtype=dtype)
    for jo in range(n_out):
        for kk in range(k):
            pos = stride * jo + dilation * kk - padding  # position in the spread axis
            if pos % input_dilation == 0 and 0 <= pos // input_dilation < n_in:
                P[pos // input_dilation, jo, kk] = 1
    return P


def dense_forward(net: Network, x: torch.Tensor, cores: dict[str, torch.Tensor],
                  out_sizes: dict[str, int] | None = None) -> torch.Tensor:
    """y for data ``x`` (with groups as written) and ``cores`` by name."""
    sizes = dict(net.sizes)
    # split the data's groups
    shape = []
    for axis, n in zip(net.input.axes, x.shape):
        unknown = [i for i in axis if i not in sizes]
        if unknown:
            known = 1
            for i in axis:
                known *= sizes.get(i, 1)
            sizes[unknown[0]] = n // known
        shape += [sizes[i] for i in axis]
    xs = x.reshape(shape)
    for c in net.convs:
        n_in = sizes[c.source]
        k = sizes[c.kernel] if c.kernel else 1
        if out_sizes and c.target in out_sizes:
            sizes[c.target] = out_sizes[c.target]
        else:
            n = (n_in - 1) * c.input_dilation + 1  # PyTorch's formula, written out again here
            sizes[c.target] = (n + 2 * c.padding - c.dilation * (k - 1) - 1) // c.stride + 1
    names = list(dict.fromkeys([*net.input.indices, *(i for c in net.cores for i in c.indices),
                                *net.output.indices, *(c.source for c in net.convs)]))
    kernel_less = {}
    letter = {n: LETTERS[i] for i, n in enumerate(names)}
    operands, terms = [xs], ["".join(letter[i] for i in net.input.indices)]
    for c in net.convs:
        k = sizes[c.kernel] if c.kernel else 1
        P = dummy(sizes[c.source], sizes[c.target], k, c.stride, c.dilation, c.padding,
                  c.input_dilation, x.dtype).to(x.device)
        if c.kernel is None:
            P = P[:, :, 0]
            kernel_less[c.source] = True
            terms.append(letter[c.source] + letter[c.target])
        else:
            terms.append(letter[c.source] + letter[c.target] + letter[c.kernel])
        operands.append(P)
    for core in net.cores:
        t = cores[core.name]
        for k in core.flipped:
            t = t.flip(core.indices.index(k))
        operands.append(t)
        terms.append("".join(letter[i] for i in core.indices))
    eq = ",".join(terms) + "->" + "".join(letter[i] for i in net.output.indices)
    y = opt_einsum.contract(eq, *operands, backend="torch")
    return y.reshape([_prod(sizes, a) for a in net.output.axes])


def _prod(sizes: dict[str, int], axis: tuple[str, ...]) -> int:
    n = 1
    for i in axis:
        n *= sizes[i]
    return n
