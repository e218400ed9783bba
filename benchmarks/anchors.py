"""The layers users would otherwise pick, and their cores copied into the same tnspec network.

Each format is a tnspec spec plus, where a library implements that exact format and ranks, a
builder for the library's layer and a function that copies its cores into the tnspec layer, so
that the two can be compared value for value (code we did not write, as a cross-check).
Missing libraries are reported, not fatal.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn


def _affine(t: str, k: str, stride: int) -> str:
    return f"{stride}*{t}+{k}-1" if stride > 1 else f"{t}+{k}-1"


@dataclass
class Format:
    name: str
    spec: str
    sizes: dict
    anchors: dict[str, Callable[..., nn.Module]] = field(default_factory=dict)
    # copies an anchor's cores into the tnspec layer (same function of the input afterwards)
    copy: dict[str, Callable[[nn.Module, nn.Module], None]] = field(default_factory=dict)


def conv_formats(c: int, o: int, r: int, k: int, stride: int, modes: tuple[int, int, int]
                 ) -> list[Format]:
    """The 2-D formats of the benchmark: c -> o channels, ranks r, kernel k."""
    h, w = _affine("h", "kh", stride), _affine("w", "kw", stride)
    head = f"x[b, c, {h}, {w}], "
    grouped = f"x[b, (c0 c1 c2), {h}, {w}], "
    out = " -> y[b, o, h, w]"
    gout = " -> y[b, (o0 o1 o2), h, w]"
    base = dict(c=c, o=o, kh=k, kw=k)
    m = dict(c0=modes[0], c1=modes[1], c2=modes[2], o0=modes[0], o1=modes[1], o2=modes[2],
             kh=k, kw=k)
    pad = 1
    tl = _tltorch()
    ted = _tednet()
    formats = [
        Format("cp", head + "A[c, r], KH[kh, r], KW[kw, r], B[r, o]" + out, {**base, "r": r}),
        Format("tucker", head + "U[c, rc], G[ro, rc, sh, sw], FH[kh, sh], FW[kw, sw], V[ro, o]"
               + out, {**base, "rc": r, "ro": r, "sh": k, "sw": k}),
        Format("tucker2", head + "U[c, r0], G[r0, r1, kh, kw], V[r1, o]" + out,
               {**base, "r0": r, "r1": r}),
        Format("tt", head + "C[c, r1], KH[r1, kh, r2], KW[r2, kw, r3], O[r3, o]" + out,
               {**base, "r1": r, "r2": r, "r3": r}),
        Format("tt-modes", grouped + "K[r0, kh, kw], N0[c0, o0, r0, r1], N1[c1, o1, r1, r2], "
               "N2[c2, o2, r2]" + gout, {**m, "r0": r, "r1": r, "r2": r}),
        Format("tr", grouped + "A0[r0, c0, r1], A1[r1, c1, r2], A2[r2, c2, r3], "
               "K[r3, kh, kw, r4], B0[r4, o0, r5], B1[r5, o1, r6], B2[r6, o2, r0]" + gout,
               {**m, **{f"r{i}": r for i in range(7)}}),
        Format("htk2", head + "U[c, r0, phi], G[r0, r1, kh, kw, phi], V[r1, o, phi]" + out,
               {**base, "r0": r, "r1": r, "phi": 4}),
    ]
    by = {f.name: f for f in formats}
    if tl is not None:
        for fac, rank in (("cp", r), ("tucker", (r, r, k, k)), ("tt", (1, r, r, r, 1))):
            for impl in ("factorized", "reconstructed"):
                by[fac].anchors[f"tltorch {impl}"] = (
                    lambda fac=fac, rank=rank, impl=impl: _initialized(tl.FactorizedConv(
                        c, o, k, order=2, factorization=fac, rank=rank, implementation=impl,
                        stride=stride, padding=pad)))
                by[fac].copy[f"tltorch {impl}"] = _from_tltorch[fac]
    if ted is not None:
        for name, build in (
                ("tr", lambda: ted.tensor_ring.TRConv2D(list(modes), list(modes), [r] * 7, k,
                                                        stride=stride, padding=pad)),
                ("tt-modes", lambda: ted.tensor_train.TTConv2D(list(modes), list(modes),
                                                               [r] * 3, k, stride=stride,
                                                               padding=pad)),
                ("tucker2", lambda: ted.tucker2.TK2Conv2D(c, o, [r, r], k, stride=stride,
                                                          padding=pad)),
                ("cp", lambda: ted.cp.CPConv2D(c, o, r, k, stride=stride, padding=pad))):
            by[name].anchors["tednet"] = lambda build=build: _quiet(build)
            by[name].copy["tednet"] = _from_tednet[name]
    return formats


def _initialized(conv: nn.Module) -> nn.Module:
    """TensorLy-Torch's ``FactorizedConv`` leaves its factors as ``torch.empty`` left them
    (its ``__init__`` does not call ``reset_parameters``). Timed so, it ran on whatever the
    memory held, NaNs among it: its CP layer at batch 32 took 253-267 ms against 28 ms
    initialized, in one same-process run. Its own ``reset_parameters`` (normal, std 0.02) is
    what a user calls."""
    conv.reset_parameters()
    return conv


def _quiet(build: Callable[[], nn.Module]) -> nn.Module:
    """tednet prints on construction."""
    with contextlib.redirect_stdout(io.StringIO()):
        return build()


def linear_format(r: int) -> Format:
    """The tensorized linear layer 784 = (28 x 28) -> 500 = (20 x 25), a two-core TT."""
    f = Format("tt-linear", "x[b, (i0 i1)], A[i0, o0, r], B[r, i1, o1] -> y[b, (o0 o1)]",
               dict(i0=28, i1=28, o0=20, o1=25, r=r))
    return f


def _tltorch():
    try:
        import tltorch
        return tltorch
    except ImportError:
        return None


def _tednet():
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import tednet.tnn.cp
            import tednet.tnn.tensor_ring
            import tednet.tnn.tensor_train
            import tednet.tnn.tucker2
        return tednet.tnn
    except ImportError:
        return None


def missing() -> list[str]:
    """Anchors that cannot be imported here, with the package to install."""
    out = []
    if _tltorch() is None:
        out.append("tltorch (pip install tensorly-torch==0.5.0)")
    if _tednet() is None:
        out.append("tednet (pip install tednet==0.1.3)")
    return out


# ---- copying cores ----------------------------------------------------------------------------

def _set(layer: nn.Module, **cores: torch.Tensor) -> None:
    with torch.no_grad():
        for name, value in cores.items():
            getattr(layer, name).copy_(value)
        if layer.bias is not None:
            layer.bias.zero_()


def _tl_cp(anchor, layer):
    w = anchor.weight
    f = [p.detach() for p in w.factors]
    _set(layer, A=f[1], KH=f[2], KW=f[3], B=(w.weights.detach()[:, None] * f[0].T))


def _tl_tucker(anchor, layer):
    w = anchor.weight
    f = [p.detach() for p in w.factors]
    _set(layer, U=f[1], G=w.core.detach(), FH=f[2], FW=f[3], V=f[0].T)


def _tl_tt(anchor, layer):
    f = [p.detach() for p in anchor.weight.factors]  # (c, kh, kw, o)
    _set(layer, C=f[0][0], KH=f[1], KW=f[2], O=f[3][:, :, 0])


def _ted_tr(anchor, layer):
    g = {n: p.detach() for n, p in anchor.named_parameters()}
    _set(layer, A0=g["in_node0"], A1=g["in_node1"], A2=g["in_node2"],
         K=g["kernel.weight"].permute(1, 2, 3, 0), B0=g["out_node0"], B1=g["out_node1"],
         B2=g["out_node2"])


def _ted_tt(anchor, layer):
    g = {n: p.detach() for n, p in anchor.named_parameters()}
    _set(layer, K=g["kernel.weight"][:, 0], N0=g["node0"], N1=g["node1"], N2=g["node2"])


def _ted_tk2(anchor, layer):
    g = {n: p.detach() for n, p in anchor.named_parameters()}
    _set(layer, U=g["node0"], G=g["kernel.weight"].permute(1, 0, 2, 3), V=g["node1"])


def _ted_cp(anchor, layer):
    g = {n: p.detach() for n, p in anchor.named_parameters()}
    rank = layer.sizes["r"]
    stack = lambda part: torch.stack([g[f"node_{part}_block{i}"] for i in range(rank)], -1)  # noqa: E731
    _set(layer, A=stack("in"), KH=stack("k0"), KW=stack("k1"), B=stack("out").T)


_from_tltorch = {"cp": _tl_cp, "tucker": _tl_tucker, "tt": _tl_tt}
_from_tednet = {"tr": _ted_tr, "tt-modes": _ted_tt, "tucker2": _ted_tk2, "cp": _ted_cp}
