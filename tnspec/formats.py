"""Tensor formats as spec text: a random generator (Pan et al. 2022, appendix "Random
Generator") and named formats.

Every function returns ``(spec, sizes)``; ``tnspec.layer(spec, **sizes)`` builds the module.
"""

from __future__ import annotations

import random as _random


def random(seed: int, *, vertices: tuple[int, int] = (4, 8), modes: tuple[int, int] = (2, 3),
           mode_size: tuple[int, int] = (2, 4), rank_size: tuple[int, int] = (2, 4),
           conv: bool = True, kernel: int = 3, hyperedge: float = 0.5,
           extra_edges: float = 0.3) -> tuple[str, dict[str, int]]:
    """A random tensorial layer as in the paper's appendix: 4-8 vertices (cores), 2-3 input
    and 2-3 output modes, rank edges joining every vertex to the network (a random spanning
    tree, plus each other pair with probability ``extra_edges``), the kernel on one random
    vertex when ``conv``, and with probability ``hyperedge`` an index phi on every vertex.
    Sizes are drawn from the given ranges."""
    rng = _random.Random(seed)
    n = rng.randint(*vertices)
    cores: list[list[str]] = [[] for _ in range(n)]
    sizes: dict[str, int] = {}
    ins = [f"i{k}" for k in range(rng.randint(*modes))]
    outs = [f"o{k}" for k in range(rng.randint(*modes))]
    for name in ins + outs:
        cores[rng.randrange(n)].append(name)
        sizes[name] = rng.randint(*mode_size)
    edges = [(rng.randrange(v), v) for v in range(1, n)]  # a random spanning tree
    edges += [(a, b) for a in range(n) for b in range(a + 1, n)
              if (a, b) not in edges and rng.random() < extra_edges]
    for k, (a, b) in enumerate(edges):
        cores[a].append(f"r{k}")
        cores[b].append(f"r{k}")
        sizes[f"r{k}"] = rng.randint(*rank_size)
    if conv:
        cores[rng.randrange(n)] += ["kh", "kw"]
        sizes.update(kh=kernel, kw=kernel)
    if rng.random() < hyperedge:
        for core in cores:
            core.append("phi")
        sizes["phi"] = rng.randint(2, 4)
    data = "(" + " ".join(ins) + ")"
    result = "(" + " ".join(outs) + ")"
    spatial_in = f", h+kh-{kernel // 2}, w+kw-{kernel // 2}" if conv else ""
    spatial_out = ", h, w" if conv else ""
    operands = [f"x[b, {data}{spatial_in}]"]
    operands += [f"V{v}[{', '.join(core)}]" for v, core in enumerate(cores)]
    return f"{', '.join(operands)} -> y[b, {result}{spatial_out}]", sizes
