"""A zoo of specs: every format x stride x padding x dilation x 1-D/2-D/3-D, with small sizes."""

from __future__ import annotations

import itertools

FORMATS = ("standard", "low_rank", "cp", "tucker2", "tt", "tr", "htk2", "depthwise", "grouped")
AXES = {1: ["t"], 2: ["h", "w"], 3: ["d", "h", "w"]}
SPATIAL = {1: 9, 2: 7, 3: 5}


def affine(t: str, k: str, stride: int, dilation: int, padding: int) -> str:
    text = (f"{stride}*{t}" if stride != 1 else t) + "+" + (f"{dilation}*{k}" if dilation != 1 else k)
    return text + (f"-{padding}" if padding else "")


def spec(fmt: str, dims: int, stride: int, pad: str, dilation: int, k: int = 3):
    """(expression, sizes, input shape without batch) for one zoo member."""
    ts = AXES[dims]
    ks = ["k" + t for t in ts]
    p = {"zero": 0, "same": dilation * (k - 1) // 2, "large": dilation * (k - 1) // 2 + 2}[pad]
    sp = ", ".join(affine(t, kk, stride, dilation, p) for t, kk in zip(ts, ks))
    out = ", ".join(ts)
    K = ", ".join(ks)
    sizes = {kk: k for kk in ks}
    n = SPATIAL[dims]
    if fmt == "standard":
        text = f"x[b, c, {sp}], W[o, c, {K}] -> y[b, o, {out}]"
        sizes.update(c=3, o=4)
        channels = 3
    elif fmt == "low_rank":
        text = f"x[b, c, {sp}], U[c, {K}, r], V[r, o] -> y[b, o, {out}]"
        sizes.update(c=3, o=4, r=2)
        channels = 3
    elif fmt == "cp":
        kc = ", ".join(f"F{kk}[{kk}, r]" for kk in ks)
        text = f"x[b, c, {sp}], A[c, r], {kc}, B[r, o] -> y[b, o, {out}]"
        sizes.update(c=3, o=4, r=3)
        channels = 3
    elif fmt == "tucker2":
        text = f"x[b, c, {sp}], U[c, r0], G[r0, r1, {K}], V[r1, o] -> y[b, o, {out}]"
        sizes.update(c=3, o=4, r0=2, r1=3)
        channels = 3
    elif fmt == "tt":
        text = (f"x[b, (c0 c1), {sp}], K[{K}, r0], G0[r0, c0, o0, r1], G1[r1, c1, o1]"
                f" -> y[b, (o0 o1), {out}]")
        sizes.update(c0=2, c1=3, o0=2, o1=2, r0=2, r1=2)
        channels = 6
    elif fmt == "tr":
        text = (f"x[b, (c0 c1), {sp}], A0[r0, c0, r1], A1[r1, c1, r2], K[r2, {K}, r3], "
                f"B0[r3, o0, r4], B1[r4, o1, r0] -> y[b, (o0 o1), {out}]")
        sizes.update(c0=2, c1=2, o0=2, o1=3, r0=2, r1=2, r2=2, r3=2, r4=2)
        channels = 4
    elif fmt == "htk2":
        text = (f"x[b, c, {sp}], U[c, r0, phi], G[r0, r1, {K}, phi], V[r1, o, phi]"
                f" -> y[b, o, {out}]")
        sizes.update(c=3, o=4, r0=2, r1=2, phi=3)
        channels = 3
    elif fmt == "depthwise":
        text = f"x[b, c, {sp}], D[c, {K}] -> y[b, c, {out}]"
        sizes.update(c=3)
        channels = 3
    elif fmt == "grouped":
        text = f"x[b, (g c), {sp}], W[g, c, o, {K}] -> y[b, (g o), {out}]"
        sizes.update(g=2, c=2, o=3)
        channels = 4
    else:
        raise ValueError(fmt)
    return text, sizes, (channels,) + (n,) * dims


CASES = [c for c in itertools.product(FORMATS, (1, 2, 3), (1, 2, 3), ("zero", "same", "large"),
                                      (1, 2))]
