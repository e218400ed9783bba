"""The measured choices the calibration cache keeps (an op per channel-mixing step, an order
or a lookup's cut per layer), as plain text: their keys made canonical, matched against a
pattern, and described in words for ``tnspec calibrate --show``. Reading and writing them is
``calibration``'s.

A layer's key is its network with the tensor and index names renamed ``t0, t1, ...`` in order
of first appearance (:func:`canonical`), so that the same network written with other names
recalls one measurement; ``--show`` prints it back in the names of the spec that timed it.
"""

from __future__ import annotations

import fnmatch
import re
import time
from typing import Any, Callable


def matches(key: str, pattern: str) -> bool:
    """Whether a choice's ``key`` matches ``pattern``: a glob with ``*``, ``?`` or ``[``
    (against the whole key or the part after the device), else a part of the key."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(
            key.split(" | ", 3)[-1], pattern)  # with or without the device part
    return pattern in key


def canonical(spec: str, inverse: bool = False) -> Callable[[str], str]:
    """A renaming of ``spec``'s tensor and index names to ``t0, t1, ...`` in order of first
    appearance, applied to a text (``inverse``: back to ``spec``'s names). Two networks that
    differ only in names read the same, so that they share measured choices."""
    names: dict[str, str] = {}
    for word in _WORD.findall(spec):
        if word not in _KEYWORDS:
            names.setdefault(word, f"t{len(names)}")
    if inverse:
        names = {v: k for k, v in names.items()}
    return lambda text: _WORD.sub(lambda m: names.get(m.group(), m.group()), text)


_WORD = re.compile(r"\b[A-Za-z_]\w*\b")
_KEYWORDS = frozenset({"in"})  # words of the language that a spec's text can hold


def describe(key: str, value: dict[str, Any]) -> str:
    """A cached choice in words, as ``tnspec calibrate --show`` prints it: what was chosen
    and by what margin over the default, the spread of the rounds, and when."""
    # names are printed escaped: a key holds what a spec wrote, newlines included
    what = "".join(c if c.isprintable() else repr(c)[1:-1] for c in key.split(" | ", 3)[-1])
    if isinstance(value.get("spec"), str) and isinstance(value.get("order"), str):
        named = canonical(value["spec"], inverse=True)  # the key is canonical: the spec's names
        what = named(what)
        value = {**value, "order": named(value["order"]), "candidates": {
            named(k): c for k, c in (value.get("candidates") or {}).items()}}
    if "op" in value:  # a mixing step
        secs = value.get("seconds") or {}
        other = "conv1x1" if value["op"] == "einsum" else "einsum"
        margin = (f", {other} {secs[other] / secs[value['op']]:.2f}x its time"
                  if isinstance(secs, dict) and secs.get(value["op"]) and other in secs
                  else "")
        return f"{what}\n  runs as {value['op']}{margin}"
    cands = value.get("candidates") or {}
    median = {k: (c["median"] if isinstance(c, dict) else c) for k, c in cands.items()}
    spread = {k: c.get("spread") for k, c in cands.items() if isinstance(c, dict)}
    order, default = value.get("order"), next(iter(cands), None)
    lines = [what]
    if order == default or default is None:
        others = [median[k] for k in median if k != order]
        lead = f", the next {min(others) / median[order]:.2f}x its time" if others and \
            median.get(order) else ""
        lines.append(f"  the cost model's choice{lead}")
    else:
        lines.append(f"  {order}: {median[order] / median[default]:.2f}x the time of the cost "
                     "model's choice" if median.get(default) else f"  {order}")
    if spread.get(order) is not None and median.get(order):
        mine = [order] + ([default] if default not in (None, order) else [])
        lines.append("  spread of the rounds (upper less lower quartile): " + ", ".join(
            f"{spread[k] / median[k]:.0%}" for k in mine if spread.get(k) is not None and
            median.get(k)) + (" of its time" if len(mine) == 1 else
                              " of the two times (chosen, the cost model's)"))
    if value.get("dropped"):
        lines.append(f"  dropped: {value['dropped']}")
    c = value.get("conditions") or {}
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(value["when"])) \
        if isinstance(value.get("when"), (int, float)) else "at an unknown time"
    lines.append(f"  measured {when}" + (f" at load {c['load']}" if c.get("load") is not None
                                         else "") +
                 (f", {c['others']} other threads running" if c.get("others") is not None
                  else ""))
    return "\n".join(lines)
