"""Report: everything about one layer as text (``tnspec explain``), above the planner.

Indices by role, both backbone graphs, the variance formula with numbers, the std of each core,
parameters against the dense layer, and the contraction plan.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..ir import Network, Role
from ..shapes import axis_text, bind_shape
from ..analysis.backbone import backbone
from ..analysis.init import activation_scale, core_inits
from .calibration import chooser, cost_model
from .plan import plan


def explain(net: Network, init: str | None = None, shape: Sequence[int] | None = None) -> str:
    """Everything about one layer: indices by role, both backbones, the variance formula with
    numbers, the std of each core, parameters against the dense layer, and the plan."""
    init = init or net.options.init
    sizes = net.sizes
    out = [f"layer {net.name or '(inline)'}: {net.spec}", "", "indices by role:"]
    for role in Role:
        names = net.with_role(role)
        if role is Role.UNIT and names:  # no index: say which cores hold them
            holders = [c.name for c in net.cores for i in c.indices if i in names]
            out.append(f"  {'unit axes':<12} " + ", ".join(
                f"{c} ({holders.count(c)})" for c in dict.fromkeys(holders)))
        elif names:
            out.append(f"  {role.value:<12} " + ", ".join(
                f"{i}={sizes[i]}" if i in sizes else i for i in names))
    p = activation_scale(net.options)
    act = net.options.activation
    for mode in ("in", "out"):
        bb = backbone(net, mode, net.options.stride_count == "exact")
        title = "forward network" if mode == "in" else \
            "backward network, by the reproducing transform"
        out += ["", f"backbone graph, graph-{mode} ({title}):"]
        out += ["  " + line for line in bb.table().splitlines()]
    n = len(net.cores)
    inits = core_inits(net, init)
    out += ["", f"variance: Var(y) = Var(x) * prod_c Var(W_c) * S_in, and Var(dx) = Var(dy) * "
                f"prod_c Var(W_c) * S_out; activation {act!r}: p_a = {p:g}"]
    if init.startswith("graph-"):
        target = {"graph-in": "1 / (p_a S_in)", "graph-out": "1 / (p_a S_out)",
                  "graph-avg": "2 / (p_a (S_in + S_out))"}[init]
        out.append(f"{init}: prod_c Var(W_c) = {target}, split over the {n} cores "
                   f"(exemplar: each Var(W) = (...)^(1/{n}))")
    else:
        out.append(f"{init}: {inits[0].why}")
    out += ["", f"std per core ({init}):"]
    for ci, core in zip(inits, net.cores):
        axes = ", ".join(axis_text(a) for a in core.axes)
        out.append(f"  {core.name:<8} [{axes}]  std = {ci.std(sizes):.6g}")
    params, dense = net.num_parameters, net.dense_parameters
    out += ["", f"parameters: {params:,} in {n} cores vs {dense:,} for the dense layer "
                f"(compression {dense / max(params, 1):.1f}x)"]
    if shape is None:
        shape = [math.prod(sizes.get(i, 32) for i in axis) for axis in net.input.axes]
    cpu = ("cpu", torch.float32)  # as `tnspec compile` plans
    out += ["", plan(bind_shape(net, tuple(shape)), model=cost_model(*cpu),
                     choose=chooser(*cpu)).report()]
    return "\n".join(out)
