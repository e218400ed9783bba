"""Stage 5, lower: Plan -> Program (plain statements), and the interpreter that runs a Program.

A :class:`Program` is what ``forward`` does, one :class:`Stmt` per line of generated code:
inline modules run it with :func:`run`; ``codegen`` prints it. Sizes are symbolic (variables
named after their indices), so one Program serves every input shape and every constructor size;
the plan's *order* was chosen for one shape.

A conv step becomes one grouped ``F.conv1d/2d/3d``: indices of the data side only -> batch,
shared and kept -> groups, shared and summed -> input channels, kernel side only -> output
channels. Every other step is a pairwise ``torch.einsum``. No dummy tensor is materialized.
"""

from __future__ import annotations

import builtins
import keyword
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from .ir import Network, Role
from .plan import Plan, Step

Dim = int | str  # a literal size, or the variable holding it


@dataclass(frozen=True)
class Stmt:
    out: str
    op: str
    args: tuple[Any, ...]
    comment: str = ""


@dataclass(frozen=True)
class Program:
    network: Network
    data: str                            # variable of the data input
    params: tuple[tuple[str, str], ...]  # (variable, core name) for every core
    sizes: tuple[tuple[str, str], ...]   # (variable, index name) for every static size used
    stmts: tuple[Stmt, ...]
    result: str


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# names generated code uses, builtins, and the names pycodestyle calls ambiguous (E741)
_TAKEN = {"self", "torch", "F", "nn", "math", "sizes", "l", "O", "I"} | set(dir(builtins))


class Namer:
    """Safe, unique Python identifiers for spec names (keywords and builtins get a suffix)."""

    def __init__(self) -> None:
        self.used: set[str] = set(_TAKEN)
        self.names: dict[str, str] = {}

    def __call__(self, key: str, base: str | None = None) -> str:
        if key in self.names:
            return self.names[key]
        name = re.sub(r"\W", "_", base if base is not None else key) or "v"
        if name[0].isdigit():
            name = "v" + name
        if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in self.used:
            stem, n = name + "_", 2
            name = stem
            while name in self.used or keyword.iskeyword(name):
                name, n = f"{stem}{n}", n + 1
        self.used.add(name)
        self.names[key] = name
        return name


def lower(plan: Plan) -> Program:
    """The statements that execute ``plan``'s order for any shape."""
    return _Lowering(plan).program()


class _Lowering:
    def __init__(self, plan: Plan) -> None:
        self.plan, self.net = plan, plan.network
        self.name = Namer()
        self.stmts: list[Stmt] = []
        self.static: dict[str, str] = {}  # variable -> index name of core sizes used
        self.layout: dict[str, tuple[str, ...]] = {}  # variable -> index names of its axes
        self.var: dict[str, str] = {}  # operand name in the plan -> current variable
        self.spread: dict[str, str] = {}  # source index -> its size once spread (T)
        self.spatial = {c.source for c in self.net.convs} | {c.target for c in self.net.convs}

    def emit(self, out: str, op: str, *args: Any, comment: str = "") -> str:
        self.stmts.append(Stmt(out, op, args, comment))
        return out

    def runtime(self, index: str) -> bool:
        """Whether the size of ``index`` comes from the data (else from the module's sizes)."""
        return self.net.index(index).runtime

    def dim(self, index: str) -> Dim:
        """The variable holding the size of ``index`` (static sizes are read from the module)."""
        if index in self.spread:
            return self.spread[index]
        if self.runtime(index):
            return self.name("size:" + index, _size_base(index, self.net))
        var = self.name("size:" + index, index)
        self.static[var] = index
        return var

    # ---- the program ------------------------------------------------------------------------

    def program(self) -> Program:
        net = self.net
        data = self.name("tensor:" + net.input.name, net.input.name)
        params = tuple((self.name("tensor:" + c.name, c.name), c.name) for c in net.cores)
        self.prologue(data)
        for var, core in params:
            tensor = next(c for c in net.cores if c.name == core)
            flips = tuple(tensor.indices.index(k) for k in sorted(tensor.flipped))
            self.emit(var, "param", core, flips, comment=_operand_text(core, tensor.indices))
            self.var[core] = var
            self.layout[var] = tensor.indices
        for step in self.plan.steps:
            self.step(step)
        result = self.epilogue()
        sizes = tuple(sorted(self.static.items(), key=lambda kv: list(net.sizes).index(kv[1])
                             if kv[1] in net.sizes else 0))
        return Program(net, data, params, sizes, tuple(self.stmts), result)

    def prologue(self, data: str) -> None:
        """Check the data's shape, read its run-time sizes, split its groups, apply
        kernel-less relations and input dilation."""
        net = self.net
        t = net.input
        expected: list[tuple[str, Dim | None]] = []
        names: list[str | None] = []
        for axis in t.axes:
            sized = not any(self.runtime(i) for i in axis)
            runtime = len(axis) == 1 and not sized
            expected.append((_axis_text(axis), self.product(list(axis)) if sized else None))
            names.append(str(self.dim(axis[0])) if runtime else
                         None if sized else self.name("axis:" + "_".join(axis), "_".join(axis)))
        self.emit("", "expect", data, tuple(expected), t.name)
        if any(names):
            self.emit("", "unpack", data, tuple(names))
        for axis, var in zip(t.axes, names):
            if len(axis) > 1 and var is not None:
                known = [a for a in axis if not self.runtime(a)]
                unknown = next(a for a in axis if self.runtime(a))
                self.emit(str(self.dim(unknown)), "infer", var, self.product(known),
                          f"{t.name} axis {_axis_text(axis)}")
        for c in net.convs:
            k = self.dim(c.kernel) if c.kernel else 1
            self.emit(str(self.dim(c.target)), "conv_size", self.dim(c.source), k, c.stride,
                      c.dilation, c.padding, c.input_dilation, comment=f"{c.target} from {c.text}")
        layout = t.indices
        var = data
        if any(len(a) > 1 for a in t.axes):
            var = self.emit(self.name("tensor:split", data + "_split"), "reshape", var,
                            tuple(self.dim(i) for i in layout),
                            comment="split " + ", ".join(
                                _axis_text(a) for a in t.axes if len(a) > 1))
        for c in net.convs:
            if c.input_dilation > 1:
                axis = layout.index(c.source)
                var = self.emit(self.name("tensor:dilated", "dilated"), "dilate", var, axis,
                                c.input_dilation,
                                comment=f"spread {c.source} by {c.input_dilation}")
                n = self.dim(c.source)
                self.spread[c.source] = self.emit(self.name("size:spread:" + c.source,
                                                            f"{n}_spread"),
                                                  "spread_size", n, c.input_dilation)
            if c.kernel is None:
                axis = layout.index(c.source)
                var = self.emit(self.name("tensor:sub:" + c.target, "sub"), "subsample", var,
                                axis, len(layout), c.stride, c.padding, self.dim(c.target),
                                comment=f"{c.target} = {c.text}")
                layout = tuple(c.target if i == c.source else i for i in layout)
        self.var[t.name] = var
        self.layout[var] = layout

    def step(self, step: Step) -> None:
        left, right = self.var[step.left.name], self.var[step.right.name]
        out = self.name("tensor:" + step.result.name, step.result.name)
        what = (f"{_operand_text(step.left.name, step.left.indices)} * "
                f"{_operand_text(step.right.name, step.right.indices)} -> "
                f"{_operand_text(step.result.name, step.result.indices)}")
        spatial = [i for i in step.left.indices if i in self.spatial] if step.data_side else []
        shared_kept = [i for i in step.left.indices if i in step.right.indices
                       and i in step.result.indices]
        if step.data_side and len(spatial) > 3 and step.convs:
            # torch convolves at most 3 axes: the others ride along with the batch
            self.conv(step, left, right, out, what, [c.source for c in step.convs])
        elif step.data_side and 1 <= len(spatial) <= 3 and (step.convs or step.impl == "conv"):
            self.conv(step, left, right, out, what, spatial)
        elif step.data_side and not spatial and not shared_kept:
            self.linear(step, left, right, out, what)
        else:
            eq = _equation(step.left.indices, step.right.indices, step.result.indices)
            self.emit(out, "einsum", eq, left, right,
                      comment=f"einsum, {step.flops:,} FLOPs: {what}")
        self.var[step.result.name] = out
        self.layout[out] = step.result.indices

    def conv(self, step: Step, left: str, right: str, out: str, what: str,
             spatial: list[str]) -> None:
        """A grouped convolution over every spatial axis of the data side: the relations this
        step resolves with their kernels, the others with a kernel of 1 (a 1x1 convolution
        is how the data side mixes channels without moving the data)."""
        L, R = step.left.indices, step.right.indices
        res = step.result.indices
        by_source = {c.source: c for c in step.convs}
        kernels = [str(c.kernel) for c in step.convs]
        batch = [i for i in L if i not in R and i not in spatial]
        groups = [i for i in L if i in R and i in res]
        chans = [i for i in L if i in R and i not in res]
        outs = [i for i in R if i not in L and i not in kernels]
        convs = [by_source.get(i) for i in spatial]
        x = self.arrange(left, L, batch + groups + chans + spatial,
                         [-1, self.product(groups + chans)] + [self.dim(i) for i in spatial])
        w = self.arrange(right, R, groups + outs + chans + [str(c.kernel) for c in convs if c],
                         [self.product(groups + outs), self.product(chans)] +
                         [self.dim(str(c.kernel)) if c else 1 for c in convs])
        over = ", ".join(c.text for c in step.convs)
        kind = f"conv over {over}" if over else "1x1 conv (channel mixing)"
        y = self.emit(self.name("tensor:conv:" + out, out + "_conv"), "conv", len(spatial), x, w,
                      tuple(c.stride if c else 1 for c in convs),
                      tuple(c.padding if c else 0 for c in convs),
                      tuple(c.dilation if c else 1 for c in convs), self.product(groups),
                      tuple(self.dim(c.target if c else i) for c, i in zip(convs, spatial)),
                      comment=f"{kind}, {step.flops:,} FLOPs: {what}")
        targets = [c.target if c else i for c, i in zip(convs, spatial)]
        natural = batch + groups + outs + targets
        if natural == list(res):
            self.emit(out, "reshape", y, tuple(self.dim(i) for i in res))
        else:  # only when some spatial axes rode along with the batch
            y = self.emit(self.name("tensor:conv_r:" + out, out + "_r"), "reshape", y,
                          tuple(self.dim(i) for i in natural))
            self.emit(out, "permute", y, tuple(natural.index(i) for i in res))

    def linear(self, step: Step, left: str, right: str, out: str, what: str) -> None:
        """A data-side step without spatial axes or groups: one ``F.linear``."""
        L, R = step.left.indices, step.right.indices
        batch = [i for i in L if i not in R]
        chans = [i for i in L if i in R]
        outs = [i for i in R if i not in L]
        x = self.arrange(left, L, batch + chans, [-1, self.product(chans)])
        w = self.arrange(right, R, outs + chans, [self.product(outs), self.product(chans)])
        y = self.emit(self.name("tensor:lin:" + out, out + "_lin"), "linear", x, w,
                      comment=f"linear, {step.flops:,} FLOPs: {what}")
        self.emit(out, "reshape", y, tuple(self.dim(i) for i in step.result.indices))

    def product(self, indices: list[str]) -> Dim:
        if not indices:
            return 1
        if len(indices) == 1:
            return self.dim(indices[0])
        return "*".join(str(self.dim(i)) for i in indices)

    def arrange(self, var: str, layout: tuple[str, ...], order: list[str],
                shape: list[Dim]) -> str:
        """Permute ``var`` from ``layout`` into ``order``, then reshape to ``shape``."""
        if list(layout) != order:
            perm = tuple(layout.index(i) for i in order)
            var = self.emit(self.name(f"tensor:perm:{var}", var + "_p"), "permute", var, perm)
        return self.emit(self.name(f"tensor:flat:{var}", var + "_r"), "reshape", var,
                         tuple(shape))

    def epilogue(self) -> str:
        """Permute the last result into the output's order, merge its groups, add the bias."""
        net = self.net
        var = self.var[self.plan.steps[-1].result.name]
        layout, target = self.layout[var], net.output.indices
        out = self.name("tensor:" + net.output.name, net.output.name)
        grouped = any(len(a) > 1 for a in net.output.axes)
        text = _operand_text(net.output.name, [_axis_text(a) for a in net.output.axes])
        if layout != target:
            var = self.emit(self.name("tensor:out_p", out + "_p") if grouped else out,
                            "permute", var, tuple(layout.index(i) for i in target),
                            comment="" if grouped else text)
        if grouped:
            var = self.emit(out, "reshape", var,
                            tuple(self.product(list(a)) for a in net.output.axes), comment=text)
        if var != out:  # name the result, so that the bias can be added to it in place
            var = self.emit(out, "alias", var, comment=text)
        if bias_shape(net):  # skipped at run time when the module has no bias
            shape = tuple(self.product(list(a)) if from_cores(net, a) else 1
                          for a in net.output.axes)
            var = self.emit(out, "bias", var, shape, comment="bias over " + ", ".join(
                _axis_text(a) for a in net.output.axes if from_cores(net, a)))
        return var


def bias_shape(net: Network) -> tuple[int, ...]:
    """Shape of the bias: one dimension per output axis that comes from cores."""
    sizes = net.sizes
    dims = []
    for axis in net.output.axes:
        if from_cores(net, axis):
            n = 1
            for i in axis:
                n *= sizes[i]
            dims.append(n)
    return tuple(dims)


def from_cores(net: Network, axis: tuple[str, ...]) -> bool:
    """Whether an output axis carries an index that comes from the cores (the bias spans it)."""
    return any(net.index(i).role in (Role.OUTPUT_MODE, Role.PARALLEL) for i in axis)


def _size_base(index: str, net: Network) -> str:
    c = net.conv_of(index)
    if c is not None and index == c.source:
        return c.target + "_in"
    return index


def _axis_text(axis: tuple[str, ...]) -> str:
    return axis[0] if len(axis) == 1 else "(" + " ".join(axis) + ")"


def _operand_text(name: str, indices) -> str:
    return f"{name}[{', '.join(indices)}]"


def _equation(a: tuple[str, ...], b: tuple[str, ...], out: tuple[str, ...]) -> str:
    letters = {i: _LETTERS[n] for n, i in enumerate(dict.fromkeys(a + b))}
    return "".join(letters[i] for i in a) + "," + "".join(letters[i] for i in b) + "->" + \
        "".join(letters[i] for i in out)


def bind_shape(net: Network, shape: Sequence[int]) -> Network:
    """``net`` with its run-time sizes bound from the data's ``shape``: batch and spatial
    sizes, the one unsized member of a group, and every conv target. Raises ValueError naming
    the expected size."""
    t = net.input
    sizes = net.sizes
    expected = [(_axis_text(a), math.prod(sizes[i] for i in a)
                 if all(i in sizes for i in a) else None) for a in t.axes]
    check_shape(t.name, expected, shape)
    bound: dict[str, int] = {}
    for axis, n in zip(t.axes, shape):
        unknown = [i for i in axis if i not in sizes]
        if len(axis) == 1 and unknown:
            bound[axis[0]] = int(n)
        elif unknown:
            known = math.prod(sizes[i] for i in axis if i in sizes)
            if n % known:
                raise ValueError(f"{t.name}: axis {_axis_text(axis)} has size {n}, not a "
                                 f"multiple of {known}")
            bound[unknown[0]] = int(n) // known
    for c in net.convs:
        if c.target not in sizes:
            k = sizes[c.kernel] if c.kernel else 1
            bound[c.target] = c.out_size(bound[c.source], k)
            if bound[c.target] < 1:
                raise ValueError(f"{t.name}: axis {c.text} of size {bound[c.source]} is too "
                                 f"small for kernel {k} (dilation {c.dilation}, padding "
                                 f"{c.padding}): the output size would be {bound[c.target]}")
    return net.bind(bound)


def check_shape(name: str, expected: Sequence[tuple[str, int | None]],
                shape: Sequence[int]) -> None:
    """Raise ValueError unless ``shape`` has the expected rank and static axis sizes."""
    if len(shape) != len(expected) or any(
            d is not None and shape[n] != d for n, (_, d) in enumerate(expected)):
        want = ", ".join(f"{t}={d}" if d is not None else t for t, d in expected)
        raise ValueError(f"{name}: expected shape [{want}], got {list(shape)}")
