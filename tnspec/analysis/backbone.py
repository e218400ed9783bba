"""The backbone: the paper's backbone graph (``S_in`` and ``S_out``).

The backbone graph (Pan et al. 2022, section 3.2.1) keeps only what a pass sums over. Its
vertices are the data-flow vertex and the cores; ``E[i][j]`` is the product of the sizes of the
indices summed between vertices i and j (1 where none, 1 on the diagonal). A kernel index joins
the data vertex (through its dummy tensor) and the core that holds it. An index summed between
three or more vertices (the paper's hyperedge phi, CP's rank, an input mode on two cores) is no
pairwise edge: it is listed in ``hyperedges``. ``S``, the product of everything the pass sums
(each index once), is the product of the upper triangle of E times the hyperedges: the
denominator of Theorem 2.

Graph-in reads the backbone of the forward network, Graph-out that of the backward network
G_bt from the reproducing transformation (``backward.py``). With ``exact_stride`` a strided
axis counts K/s kernel taps in the backward pass (only every s-th entry of the spread dy is
non-zero) instead of the paper's K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir import Network, without_units
from .backward import backward


@dataclass(frozen=True)
class Backbone:
    mode: str  # "in" (forward network) or "out" (backward network)
    vertices: tuple[str, ...]  # the data-flow vertex, then the cores
    edges: tuple[tuple[int, ...], ...]  # the symmetric matrix E
    edge_indices: tuple[tuple[tuple[str, ...], ...], ...]  # which indices make each e_ij
    hyperedges: tuple[tuple[str, tuple[str, ...]], ...]  # (index, the vertices it joins)
    summed: tuple[str, ...]  # every index the pass sums over
    sizes: tuple[tuple[str, float], ...]  # their sizes (a strided kernel: K/s if exact)

    @property
    def S(self) -> float:
        """Product of everything the pass sums over (an integer unless exact_stride applies)."""
        return math.prod(n for _, n in self.sizes)

    def table(self) -> str:
        """E as a small table, then the hyperedges and S."""
        names = list(self.vertices)
        cells = [f"{e:,}" for row in self.edges for e in row]
        width = max(6, *(len(n) + 1 for n in names), *(len(c) + 1 for c in cells))
        lines = [" " * width + "".join(f"{n:>{width}}" for n in names)]
        for name, row in zip(names, self.edges):
            lines.append(f"{name:>{width}}" + "".join(f"{e:>{width},}" for e in row))
        for index, verts in self.hyperedges:
            lines.append(f"hyperedge {index} ({dict(self.sizes)[index]:g}) joins "
                         f"{', '.join(verts)}")
        product = " * ".join(f"{n:g}" for _, n in self.sizes) or "1"
        lines.append(f"S_{self.mode} = {' * '.join(i for i, _ in self.sizes) or '1'} = "
                     f"{product} = {self.S:,.6g}")
        return "\n".join(lines)


def backbone(net: Network, mode: str = "in", exact_stride: bool = False) -> Backbone:
    """The backbone graph of ``net`` (mode "in") or of its backward network (mode "out")."""
    if mode not in ("in", "out"):
        raise ValueError(f"mode must be 'in' or 'out', not {mode!r}")
    net = without_units(net)  # a unit axis sums one term
    g = net if mode == "in" else backward(net)
    sizes = net.sizes
    vertices = [g.input.name] + [c.name for c in g.cores]
    carriers: dict[str, list[int]] = {}
    kernels = {c.kernel: c for c in g.convs if c.kernel is not None}
    for v, core in enumerate(g.cores, 1):
        for i in core.indices:
            if i not in g.output.indices:
                carriers.setdefault(i, [])
                carriers[i].append(v)
    for i in carriers:
        if i in g.input.indices or i in kernels:  # a kernel reaches the data via its dummy
            carriers[i].insert(0, 0)
    n = len(vertices)
    E = [[1] * n for _ in range(n)]
    labels: list[list[list[str]]] = [[[] for _ in range(n)] for _ in range(n)]
    hyper = []
    counted = []
    for i, vs in carriers.items():
        size: float = sizes[i]
        if exact_stride and i in kernels and kernels[i].input_dilation > 1:
            size = size / kernels[i].input_dilation
        counted.append((i, size))
        if len(vs) == 2:
            a, b = vs
            E[a][b] *= sizes[i]
            E[b][a] *= sizes[i]
            labels[a][b].append(i)
            labels[b][a].append(i)
        else:
            hyper.append((i, tuple(vertices[v] for v in vs)))
    return Backbone(mode, tuple(vertices), tuple(map(tuple, E)),
                    tuple(tuple(tuple(x) for x in row) for row in labels), tuple(hyper),
                    tuple(i for i, _ in counted), tuple(counted))
