"""The named formats as graphs: which mode, kernel and rank indices each core carries.

Each entry maps the layer's parts (input and output mode names, kernel names: ``axes.Parts``) and
the names of its rank edges to the index lists of its cores; ``formats`` sizes them and writes the
spec text. A new named format is one entry here and one function in ``formats``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from .axes import Parts


def _standard(p: Parts, r: list[str]) -> list[list[str]]:
    return [p.outs + p.ins + p.ks]


def _low_rank(p: Parts, r: list[str]) -> list[list[str]]:
    """LoRA's layout, each factor output index first as a conv's or linear's weight is, the
    second one of a conv with a unit axis per kernel axis (PEFT's ``lora_B`` of a conv): the
    layer's two convs (or linears) take them as stored."""
    return [r + p.ins + p.ks, p.outs + r + ["1"] * len(p.ks)]


def _cp(p: Parts, r: list[str]) -> list[list[str]]:
    """CP of a conv laid out as the convs of Lebedev et al. read it: a 1x1 conv's weight
    ``A[r, c, 1, 1]``, one depthwise conv's weight per kernel axis (``B[r, 1, kh, 1]``,
    ``C[r, 1, 1, kw]``), a 1x1 conv's ``D[o, r, 1, 1]``: those four convs take the factors as
    stored, and each kernel built first is one broadcast multiply of two of them (of a
    linear: ``A[r, c]``, ``D[o, r]``)."""
    n = len(p.ks)
    kernels = [r + ["1"] + ["1"] * j + [k] + ["1"] * (n - 1 - j) for j, k in enumerate(p.ks)]
    return [r + p.ins + ["1"] * n] + kernels + [p.outs + r + ["1"] * n]


def _tucker(p: Parts, r: list[str]) -> list[list[str]]:
    kr = r[2:]
    return [p.ins + r[:1]] + [[k, q] for k, q in zip(p.ks, kr)] + [r[:2] + kr, r[1:2] + p.outs]


def _tucker2(p: Parts, r: list[str]) -> list[list[str]]:
    return [p.ins + r[:1], r[:2] + p.ks, r[1:2] + p.outs]


def _tucker2_out_first(p: Parts, r: list[str]) -> list[list[str]]:
    """Tucker-2 with each core laid out as a conv's weight is: output index first, and the
    1x1 factors of a conv with a unit axis (``1``) per kernel axis, so that the layer's three
    convs take the cores as they are stored: no view, permute or copy of a core or of its
    gradient (what ``nn.Conv2d`` weights cost, no more)."""
    units = ["1"] * len(p.ks)
    return [r[:1] + p.ins + units, r[1:2] + r[:1] + p.ks, p.outs + r[1:2] + units]


def _tt(p: Parts, r: list[str]) -> list[list[str]]:
    """Garipov et al.: a kernel core, then one core per (input, output) mode pair."""
    cores = [p.ks + r[:1]] if p.ks else []
    rs = ([] if p.ks else [None]) + r + [None]
    for i, (c, o) in enumerate(zip(p.ins, p.outs)):
        cores.append([q for q in (rs[i], c, o, rs[i + 1]) if q])
    return cores


def _tr(p: Parts, r: list[str]) -> list[list[str]]:
    """Wang et al.: input mode cores, a kernel core, output mode cores, on one ring."""
    legs = [[m] for m in p.ins] + ([p.ks] if p.ks else []) + [[m] for m in p.outs]
    return [[r[i], *leg, r[(i + 1) % len(r)]] for i, leg in enumerate(legs)]


def _tt_lora(p: Parts, r: list[str]) -> list[list[str]]:
    """An open chain: input mode cores, a kernel core, output mode cores, each on a leg of
    its own (the tensor train of the weight reshaped into small modes, as TT-LoRA and
    LoRETTA adapt): the ring of tr, cut between the last output and the first input core."""
    legs = [[m] for m in p.ins] + ([p.ks] if p.ks else []) + [[m] for m in p.outs]
    bonds = [None] + r + [None]
    return [[q for q in (bonds[i], *leg, bonds[i + 1]) if q] for i, leg in enumerate(legs)]


def _block_term(p: Parts, r: list[str]) -> list[list[str]]:
    """A sum over the last rank index n of full Tucker terms (n is a hyperedge)."""
    n = r[-1:]
    return [c + n for c in _tucker(p, r[:-1])]


def _odd(p: Parts, r: list[str]) -> list[list[str]]:
    """The Odd-like stand-in of examples/odd.tn: 9 cores, 14 rank edges."""
    (i0, i1), (o0, o1) = p.ins, p.outs
    return [[i0, r[0], r[1], r[13]], [r[0], r[2], r[3]], [i1, r[1], r[4], r[12]],
            [r[2], r[5], r[6]], [r[3], r[4], r[7], r[8], *p.ks], [r[5], r[9], r[13]],
            [r[6], r[7], r[10], o0], [r[8], r[11], r[12]], [r[9], r[10], r[11], o1]]


def _hypernet(p: Parts, r: list[str]) -> list[list[str]]:
    return [p.ins + r] + ([p.ks + r] if p.ks else []) + [r + p.outs]


def _separable(p: Parts, r: list[str]) -> list[list[str]]:
    return [p.ins + p.ks, p.ins + p.outs]


Builder = Callable[[Parts, list[str]], list[list[str]]]


class Topology(NamedTuple):
    """A named format's graph: its cores' indices, how many rank edges it has, and the letters
    that name its cores (empty: A, B, C, ...)."""

    cores: Builder
    ranks: Callable[[Parts], int]
    letters: str


TOPOLOGIES: dict[str, Topology] = {
    "standard": Topology(_standard, lambda p: 0, "W"),
    "low_rank": Topology(_low_rank, lambda p: 1, "UV"),
    "cp": Topology(_cp, lambda p: 1, ""),
    "tucker": Topology(_tucker, lambda p: 2 + len(p.ks), ""),
    "tucker2": Topology(_tucker2_out_first, lambda p: 2, "UGV"),
    # Hyper Tucker-2 (paper Fig. 5): Tucker-2's graph; formats gives it phi=4 by default
    "htk2": Topology(_tucker2, lambda p: 2, "UGV"),
    "tt": Topology(_tt, lambda p: len(p.ins) - (0 if p.ks else 1), ""),
    "tr": Topology(_tr, lambda p: len(p.ins) + len(p.outs) + (1 if p.ks else 0), ""),
    "tt_lora": Topology(_tt_lora, lambda p: len(p.ins) + len(p.outs) + (1 if p.ks else 0) - 1,
                        ""),
    "block_term": Topology(_block_term, lambda p: 3 + len(p.ks), ""),
    "odd": Topology(_odd, lambda p: 14, "ABCDEFGHI"),
    "hypernet": Topology(_hypernet, lambda p: 1, ""),
    "depthwise_separable": Topology(_separable, lambda p: 0, "DP"),
}
