"""Layer settings, read as part of checking: sizes (parameters, overrides, derived) and options.

Both report problems through ``report(message, span, hint)`` and carry on, so that the checker
can show every error at once.
"""

from __future__ import annotations

import difflib
import math
import operator
import re
from typing import Any, Callable

from ..errors import Span, SpecError
from ..ir import ACTIVATIONS, DISTRIBUTIONS, INITS, STRIDE_COUNTS, Options
from .nodes import LayerNode, SizeExpr

Report = Callable[[str, "Span | None", "str | None"], None]

_OPTION_KEYS = ("init", "activation", "bias", "distribution", "stride_count", "padding_idx",
                "num_embeddings")
#: the activation scale p_a and the leaky_relu slope a (p_a = (1 + a^2) / 2) stay in ranges whose
#: stds are finite, nonzero floats for any layer size
SCALE_RANGE = (1e-6, 1e6)
MAX_SLOPE = 1e3
_FLOAT = re.compile(r"[-+]?(inf|([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?)")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": operator.floordiv}


def positive_int(value: Any) -> int | None:
    """``value`` as an int if it is a positive integer (numpy integers too, bools not);
    else None."""
    if isinstance(value, bool):
        return None
    try:
        v = operator.index(value)
    except TypeError:
        return None
    return v if v > 0 else None


def positive_limit(name: str, value: Any) -> int:
    """A limit given from Python (``max_bytes=``, ``max_elements=``), checked: a positive int."""
    if positive_int(value) is None:
        raise SpecError(f"{name}={value!r} must be a positive int",
                        hint="give a number of elements or bytes, e.g. 2**30")
    return int(value)


class SizeBinder:
    """Binds a layer's sizes: parameter defaults, then keyword overrides, then derived sizes in
    written order. ``bad`` collects names whose value was refused, so that they are not reported
    again as missing."""

    def __init__(self, layer: LayerNode, report: Report) -> None:
        self.layer, self.error = layer, report
        self.bad: set[str] = set()

    def bind(self, overrides: dict[str, Any], written: set[str]) -> dict[str, int]:
        """Sizes by name; ``written`` are the index names of the network (for inline specs)."""
        lay = self.layer
        env: dict[str, int] = {}
        declared: dict[str, Span] = {}
        for p in lay.params:
            if p.name in declared:
                self.error(f"parameter {p.name!r} is declared twice", p.span,
                           "remove one of the two declarations")
            declared[p.name] = p.span
            if p.default <= 0:
                self.bad.add(p.name)
                self.error(f"size {p.name}={p.default} must be a positive integer", p.span,
                           f"write {p.name}=1 or more")
            env[p.name] = p.default
        derived_names = {d.name for d in lay.derived}
        for key, value in overrides.items():
            if key in derived_names:
                self.error(f"size {key!r} is derived in the file and cannot be set", None,
                           "set the parameters it is derived from instead")
                continue
            if lay.params and key not in declared or not lay.params and key not in written:
                pool = list(declared) if lay.params else sorted(written)
                close = difflib.get_close_matches(key, pool, n=1)
                self.error(f"size {key}={value!r} names no "
                           + ("parameter of the layer" if lay.params else "index of the spec"),
                           None, f"did you mean {close[0]!r}?" if close else
                           f"known: {', '.join(pool) if pool else 'none'}")
                continue
            v = positive_int(value)
            if v is None:
                self.bad.add(key)
                self.error(f"size {key}={value!r} must be a positive integer", None,
                           f"pass {key}=<int >= 1>")
                continue
            env[key] = v
        for d in lay.derived:
            if d.name in env or d.name in self.bad:
                self.error(f"size {d.name!r} is defined twice", d.span,
                           "a size is either a parameter or derived, once")
                continue
            value = self.evaluate(d.expr, env)
            if value is None or value <= 0:
                self.bad.add(d.name)
                if value is not None:
                    self.error(f"size {d.name} evaluates to {value}; sizes must be positive",
                               d.span, "check the expression and the sizes it uses")
                continue
            env[d.name] = value
        return env

    def evaluate(self, e: SizeExpr, env: dict[str, int]) -> int | None:
        if e.op == "int":
            return int(e.value)  # type: ignore[arg-type]
        if e.op == "name":
            if e.value not in env:
                self.error(f"size {e.value!r} is not defined here", e.span,
                           "define it as a parameter or above this line")
                return None
            return env[str(e.value)]
        values = [self.evaluate(x, env) for x in e.args]  # recursion only into parentheses
        if None in values:
            return None
        result = values[0]
        for op, arg, b in zip(e.value, e.args[1:], values[1:]):
            if op == "//" and b == 0:
                first = e.args[0].span
                self.error("division by zero", Span(first.line, first.column, arg.span.end_line,
                                                    arg.span.end_column),
                           "the divisor evaluates to 0")
                return None
            result = _OPS[op](result, b)
            if abs(result) > 2**62:
                self.error("size expression is too large", e.span, "sizes are small integers")
                return None
        return result

    # ---- options ----------------------------------------------------------------------------


def read_options(layer: LayerNode, report: Report) -> Options:
    """The layer's options, validated against the vocabularies in ``ir``."""
    reader = _OptionReader(report)
    return reader.options(layer)


class _OptionReader:
    def __init__(self, report: Report) -> None:
        self.error = report

    def options(self, layer: LayerNode) -> Options:
        values: dict[str, Any] = {}
        for opt in layer.options:
            if opt.key not in _OPTION_KEYS:
                close = difflib.get_close_matches(opt.key, _OPTION_KEYS, n=1)
                self.error(f"unknown option {opt.key!r}", opt.span,
                           f"did you mean {close[0]!r}?" if close else
                           f"options are {', '.join(_OPTION_KEYS)}")
                continue
            if opt.key in values:
                self.error(f"option {opt.key!r} is given twice", opt.span,
                           "keep one of them")
                continue
            try:
                values[opt.key] = option_value(opt.key, opt.value, opt.arg)
            except SpecError as exc:
                self.error(exc.message, opt.span, exc.hint)
        act = values.pop("activation", ("relu", None))
        return Options(activation=act[0], activation_param=act[1], **values)

    # ---- the network ------------------------------------------------------------------------


def option_value(key: str, value: Any, arg: float | None = None) -> Any:
    """One option as a ``.tn`` file, Python or the command line gives it, validated against
    the vocabularies in ``ir`` (the one validator of options). ``activation`` is a name,
    ``"leaky_relu(0.1)"``, a name with ``arg`` (the file's ``leaky_relu(0.1)``) or a number
    (the scale p_a), and comes back as ``(activation, activation_param)``; ``bias`` is a bool
    or ``true``/``false``. Raises SpecError with a hint."""
    if key == "activation":
        if arg is not None and isinstance(value, str):
            value = f"{value}({arg!r})"  # inf (from 1e400) gets the slope's range error
        return activation_from_python(value)
    if key == "bias":
        if isinstance(value, bool):
            return value
        if value in ("true", "false"):
            return value == "true"
        raise SpecError(f"invalid bias: {value!r}", hint="bias is true or false")
    if key in ("padding_idx", "num_embeddings"):
        least = 0 if key == "padding_idx" else 1
        if isinstance(value, bool) or not isinstance(value, (int, float)) or arg is not None \
                or not math.isfinite(value) or value != int(value) or value < least:
            raise SpecError(f"invalid {key}: {value!r}", hint=f"{key} is an integer >= {least}")
        return int(value)
    choices = {"init": INITS, "distribution": DISTRIBUTIONS, "stride_count": STRIDE_COUNTS}[key]
    if not isinstance(value, str) or value not in choices or arg is not None:
        close = difflib.get_close_matches(str(value), choices, n=1)
        raise SpecError(f"invalid {key}: {value!r}" + (f"({arg})" if arg is not None else ""),
                        hint=f"did you mean {close[0]!r}?" if close else
                        f"choose one of {', '.join(choices)}")
    return value


def activation_from_python(value: str | float) -> tuple[str | float, float | None]:
    """An activation given from Python: ``"relu"``, ``"leaky_relu(0.1)"`` or a number (the
    scale p_a), as ``(activation, activation_param)``; a SpecError otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if SCALE_RANGE[0] <= value <= SCALE_RANGE[1]:
            return float(value), None
        raise SpecError(f"activation scale {float(value)} is outside [{SCALE_RANGE[0]:g}, "
                        f"{SCALE_RANGE[1]:g}]",
                        hint="the scale p_a is 1 for linear/tanh, 0.5 for relu")
    match = re.fullmatch(r"\s*([a-z_]+)\s*(?:\(\s*([-+0-9.eE]+|[-+]?inf)\s*\))?\s*",
                         str(value))
    name, text = match.groups() if match else (None, None)
    if name in ACTIVATIONS and text is None:
        return name, None
    if name == "leaky_relu" and _FLOAT.fullmatch(text):
        slope = float(text)
        if abs(slope) <= MAX_SLOPE:
            return name, slope
        raise SpecError(f"leaky_relu slope {text} is outside [-{MAX_SLOPE:g}, {MAX_SLOPE:g}]",
                        hint="slopes are usually 0.01 to 0.3")
    close = difflib.get_close_matches(str(value), ACTIVATIONS, n=1)
    raise SpecError(f"invalid activation: {value!r}",
                    hint=f"did you mean {close[0]!r}?" if close else
                    f"choose one of {', '.join(ACTIVATIONS)}, 'leaky_relu(slope)' or a number")
