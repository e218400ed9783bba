"""Lower: Plan -> Program (``tnspec.program``), the typed nodes that ``codegen`` prints.

A Program is what ``forward`` does, one node per statement. Sizes are symbolic (named after
their indices), so one Program serves every input shape and every constructor size; the plan's
*order* was chosen for one shape.

The planner has decided each step's op and axis split; lowering only names variables, arranges
operands into the layout the op wants (a permute where the order differs, a reshape where the
shape does; ``program.Builder`` tracks every variable's layout) and emits. Reshapes of
reshapes collapse and unused nodes are dropped, so the code moves the data only where it must.
Convolutions and linear steps are lowered here; products without a convolution (einsum,
batched matmul, a later step's weight) in ``products.py``.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any, Sequence

from ..ir import Network, Role
from ..program import (Arg, Bias, Call, CheckShape, CompileCopy, Let, Param, Program,
                       Relayout, Require, Unpack, Var, prune, rename)
from ..shapes import Size, axis_text, conv_out, geometry
from ..planning.lookup import LookupPlan, lower_lookup
from ..planning.plan import Plan, Step
from .products import Products, fold_unit_axes, stored_cores


def lower(plan: Plan, channels_last: bool = False, convert: bool = False,
          compiled: bool = False) -> Program:
    """The nodes that execute ``plan``'s order for any shape, laid out for a contiguous input
    or, with ``channels_last``, a channels-last one (any layout computes the same).
    ``convert``: the program converts its input to channels-last, runs laid out for that and
    hands its result back contiguous (1x1 convolutions over a channels-last tensor can take
    half the time; whether that pays for the two copies is for the autotuner to measure).
    ``compiled``: the form ``torch.compile`` traces, where a 1x1 convolution over a contiguous
    input runs 1-D over the flattened spatial axes (Inductor wraps the 2-D form in copies of
    its input); eagerly it stays 2-D, the same kernel without the four reshapes a step."""
    if isinstance(plan, LookupPlan):
        return lower_lookup(plan)
    return _Lowering(plan, channels_last or convert, convert, compiled).program()


class _Lowering(Products):
    def __init__(self, plan: Plan, channels_last: bool = False, convert: bool = False,
                 compiled: bool = False) -> None:
        super().__init__(plan.network)
        self.plan = plan
        self.channels_last = channels_last
        self.convert = convert
        self.compiled = compiled
        self.var: dict[str, Var | Param] = {}  # plan operand -> what holds it now
        # the layout each conv or linear step (or unit-kernel conv run as a product) reads its
        # weight in: where an einsum builds that weight, it writes it in an order that layout
        # is one cheap permute away from
        self.wanted = {s.right.name: _weight_layout(s, self.channels_last) for s in plan.steps
                       if s.op in ("conv", "conv1x1", "linear") or s.convs}
        # a contiguous program's conv weight written channels-last would make the conv's
        # result channels-last too
        self.unwanted = {} if self.channels_last else {
            s.right.name: _weight_layout(s, True) for s in plan.steps if s.op == "conv"}

    # ---- the program ------------------------------------------------------------------------

    def program(self) -> Program:
        net = self.net
        data = Var(self.name("tensor:" + net.input.name, net.input.name))
        out_name = self.name("tensor:" + net.output.name, net.output.name)
        # a conv-like or linear-like layer takes an unbatched input, as nn.Conv2d does
        flag = self.name("flag:unbatched", "unbatched") if geometry(net) else None
        self.prologue(data, flag)
        for core in net.cores:
            holder: Var | Param = Param(core.name)
            self.layout[holder] = core.indices
            self.dims[holder] = tuple(self.size(i) for i in core.indices)
            if core.flipped:
                dims = [core.indices.index(k) for k in sorted(core.flipped)]
                holder = self.call(core.name + "_flipped", ".flip", holder, dims,
                                   layout=core.indices, dims=self.dims[holder],
                                   comment=f"{core.name} with {', '.join(sorted(core.flipped))}"
                                   " reversed (the reproducing transformation's R)")
            self.var[core.name] = holder
        for step in self.plan.steps:
            self.step(step)
        result = self.epilogue(out_name)
        if self.convert:
            self.nodes.append(Relayout(result, False, "back to the caller's layout"))
        return replace(self.finish(data.name, result), unbatched=flag)

    def prologue(self, data: Var, unbatched: str | None = None) -> None:
        """Check the data's shape, read its run-time sizes, split its groups, and apply
        input dilation (backward networks) and kernel-less relations (subsampling)."""
        net, t = self.net, self.net.input
        runtime = {i for i in t.indices if net.index(i).runtime}
        expected, names = [], []
        for axis in t.axes:
            sized = not runtime & set(axis)
            expected.append((axis_text(axis), self.product(axis) if sized else None))
            names.append(None if sized else str(self.size(axis[0])) if len(axis) == 1 else
                         self.name("axis:" + "_".join(axis), "_".join(axis)))
        self.nodes.append(CheckShape(data.name, t.name, tuple(expected), unbatched))
        if any(names):
            self.nodes.append(Unpack(data.name, tuple(names)))
        for axis, name in zip(t.axes, names):
            if len(axis) > 1 and name is not None:
                known = self.product([i for i in axis if i not in runtime])
                unknown = next(i for i in axis if i in runtime)
                self.nodes.append(Require(Size.of(name), known, (
                    f"{t.name}: axis {axis_text(axis)} has size ", Size.of(name),
                    ", not a multiple of ", known)))
                self.nodes.append(Let(str(self.size(unknown)), Size.of(name) // known))
        for c in net.convs:
            if net.index(c.target).runtime:
                k = self.size(c.kernel) if c.kernel else 1
                value = conv_out(self.size(c.source), k, c.stride, c.dilation, c.padding,
                                 c.input_dilation)
                target = self.size(c.target)
                self.nodes.append(Let(str(target), value, f"{c.target} from {c.text}"))
                if not value.is_atomic():
                    self.nodes.append(Require(target, None, (
                        f"{t.name}: axis {c.text} of size ", self.size(c.source),
                        " is too small: it gives an output size of ", target)))
        if self.convert:
            self.nodes.append(Relayout(data.name, True, "run channels-last: timed faster"))
        self.layout[data] = tuple(axis_text(a) for a in t.axes)
        self.dims[data] = tuple(self.product(a) for a in t.axes)
        holder: Var | Param = data
        if any(len(a) > 1 for a in t.axes):
            holder = self.reshape_to(data, t.indices, [self.size(i) for i in t.indices],
                                     data.name + "_split")
        for c in net.convs:
            if c.input_dilation > 1:
                holder = self.spread(holder, c.source, c.input_dilation)
        for c in net.convs:
            if c.kernel is None:
                holder = self.subsample(holder, c)
        self.var[t.name] = holder

    def spread(self, holder: Var | Param, axis: str, factor: int) -> Var:
        """Insert factor-1 zeros after each entry along ``axis`` (the transformation T). The
        result keeps factor-1 trailing zeros; the explicit padding of the next op crops them."""
        layout, dims = self.layout[holder], list(self.dims[holder])
        n = layout.index(axis)
        pads = [0, 0] * (len(layout) - n - 1) + [0, factor - 1]
        wide = self.call(holder.name + "_u", ".unsqueeze", holder, n + 1,
                         layout=layout[:n + 1] + ("",) + layout[n + 1:],
                         dims=dims[:n + 1] + [Size.of(1)] + dims[n + 1:])
        padded = self.call(holder.name + "_z", "F.pad", wide, tuple(pads),
                           layout=self.layout[wide],
                           dims=dims[:n + 1] + [Size.of(factor)] + dims[n + 1:],
                           comment=f"spread {axis} by {factor}: {factor - 1} zeros after each "
                                   "entry (the reproducing transformation's T)")
        dims[n] = dims[n] * factor
        return self.call(holder.name + "_spread", ".reshape", padded, *dims, layout=layout,
                         dims=dims)

    def subsample(self, holder: Var | Param, c: Any) -> Var | Param:
        """A relation without kernel: positions -p, s-p, 2s-p, ... of the data axis."""
        layout, dims = self.layout[holder], list(self.dims[holder])
        n = layout.index(c.source)
        target = self.size(c.target)
        right: Size = Size.of(c.padding)
        if not self.net.index(c.target).runtime or c.input_dilation > 1:
            right = (target - 1) * c.stride + 1 - dims[n] - c.padding
        if c.padding or right.constant != c.padding:
            pads = [0, 0] * (len(layout) - n - 1) + [c.padding, right]
            holder = self.call(holder.name + "_pad", "F.pad", holder, tuple(pads),
                               layout=layout, dims=dims, comment=f"{c.target} = {c.text}")
        dims[n] = target
        new_layout = tuple(c.target if i == c.source else i for i in layout)
        if c.stride == 1:
            self.layout[holder], self.dims[holder] = new_layout, tuple(dims)
            return holder
        return self.call(holder.name + "_sub", "[]", holder, n, c.stride, layout=new_layout,
                         dims=dims, comment=f"{c.target} = {c.text}")

    # ---- steps ------------------------------------------------------------------------------

    def step(self, step: Step) -> None:
        left, right = self.var[step.left.name], self.var[step.right.name]
        what = (f"{_text(left.name, self.layout[left])} * "
                f"{_text(right.name, self.layout[right])}")
        base = step.result.name
        start = len(self.nodes)
        if step.op in ("conv", "conv1x1"):
            out = self.conv(step, left, right, base, what)
        elif step.op == "linear":
            out = self.linear(step, left, right, base, what)
        else:  # a product; of a 1x1 weight stored with unit axes, maybe a transposed conv
            out = None if step.data_side else self.transposed(step, left, right, base, what)
            if out is None:  # else a core's unit axes go in a reshape
                left, right = self.without_units(left), self.without_units(right)
                if step.convs:  # relations of a unit kernel, run as channel mixing (rechoose)
                    step, left, right = self.identities(step, left, right)
                out = self.einsum(step, left, right, base, what)
        if not step.data_side:
            self.nodes[start:] = [replace(n, cores_only=True) if isinstance(n, Call) else n
                                  for n in self.nodes[start:]]
        self.var[step.result.name] = out

    def batch_dim(self, holder: Var | Param, batch: Sequence[str]) -> Size | int:
        """The flattened batch axis of a conv's input: the axis itself when there is one,
        else -1 (torch infers it)."""
        if len(batch) > 1:
            return -1
        return self.dim(holder, batch[0]) if batch else Size.of(1)

    def conv(self, step: Step, left: Var | Param, right: Var | Param, base: str,
             what: str) -> Var:
        """One grouped ``F.convNd`` over the split's spatial axes: the relations this step
        resolves with their kernels, the other axes with a kernel of 1."""
        sp, net = step.split, self.net
        by_source = {c.source: c for c in step.convs}
        convs = [by_source.get(i) for i in sp.spatial]
        batch = self.batch_dim(left, sp.batch)
        spatial = [self.dim(left, i) for i in sp.spatial]
        # compiled, a 1x1 conv over a contiguous input runs as a 1-D one over the flattened
        # axes, since Inductor wraps a 2-D 1x1 conv in copies of its input; eagerly both are
        # the same kernel, and the 2-D one dispatches four reshapes fewer (fwd and bwd)
        flat = self.compiled and not step.convs and len(sp.spatial) > 1 and \
            not self.channels_last
        x = self.arrange(left, sp.batch + sp.groups + sp.inputs + sp.spatial,
                         [batch, self.product(sp.groups + sp.inputs)] +
                         ([math.prod(spatial, start=Size.of(1))] if flat else spatial))
        if len(sp.spatial) == 2 and not flat and self.made_by.get(x) in _VIEWS:
            self.nodes.append(CompileCopy(
                x.name, "Inductor fails on a 4-D view saved for a conv's backward once shapes "
                        "are dynamic (pytorch/pytorch#185510); under torch.compile the conv "
                        "gets a copy instead"))
        kernels = [str(c.kernel) for c in convs if c]
        w = self.arrange(right, sp.groups + sp.outputs + sp.inputs + tuple(kernels),
                         [self.product(sp.groups + sp.outputs), self.product(sp.inputs)] +
                         ([Size.of(1)] if flat else
                          [self.size(str(c.kernel)) if c else Size.of(1) for c in convs]))
        targets = [c.target if c else i for c, i in zip(convs, sp.spatial)]
        # explicit padding where the output size is given (backward networks) or the data was
        # spread: PyTorch's symmetric padding would not produce exactly that size
        explicit = any(c and (not net.index(c.target).runtime or c.input_dilation > 1)
                       for c in convs)
        natural = sp.batch + sp.groups + sp.outputs + tuple(targets)
        kwargs: dict[str, Arg] = {}
        if self.takes_bias(step, sp.groups + sp.outputs, natural):
            kwargs["bias"] = Param("bias")
        if explicit:
            pads: list[Any] = []
            for c, i in zip(convs, sp.spatial):
                n = self.dim(left, i)
                right_pad = (self.size(c.target) - 1) * c.stride + \
                    c.dilation * (self.size(str(c.kernel)) - 1) - c.padding - (n - 1) \
                    if c else Size.of(0)
                pads = [c.padding if c else 0, right_pad] + pads
            x = self.call(x.name + "_pad", "F.pad", x, tuple(pads), layout=self.layout[x],
                          dims=self.dims[x])
        elif any(c and c.padding for c in convs):
            kwargs["padding"] = _uniform([c.padding if c else 0 for c in convs])
        if any(c and c.stride != 1 for c in convs):
            kwargs["stride"] = _uniform([c.stride if c else 1 for c in convs])
        if any(c and c.dilation != 1 for c in convs):
            kwargs["dilation"] = _uniform([c.dilation if c else 1 for c in convs])
        groups = self.product(sp.groups)
        if groups.constant != 1:
            kwargs["groups"] = groups
        over = ", ".join(c.text for c in step.convs)
        kind = f"conv over {over}" if over else "1x1 conv (channel mixing)"
        lengths = [self.size(c.target) if c else self.dim(left, i)  # a 1x1 axis keeps its
                   for c, i in zip(convs, sp.spatial)]                 # (maybe spread) length
        dims = [Size.of(0) if batch == -1 else batch, self.product(sp.groups + sp.outputs)] + \
            ([math.prod(lengths, start=Size.of(1))] if flat else lengths)
        y = self.call(base + "_conv", f"F.conv{len(dims) - 2}d", x, w, layout=("",) * len(dims),
                      dims=dims, comment=f"{kind}, {step.flops:,} FLOPs: {what}", **kwargs)
        y = self.reshape_to(y, natural, [self.dim(left, i) for i in sp.batch] +
                            [self.size(i) for i in sp.groups + sp.outputs] + lengths, base)
        if natural != step.result.indices:  # only when spatial axes rode along with the batch
            res = step.result.indices
            y = self.arrange(y, res, [self.dims[y][natural.index(i)] for i in res])
        return y

    def linear(self, step: Step, left: Var | Param, right: Var | Param, base: str,
               what: str) -> Var:
        """A data-side step without spatial axes or groups: one ``F.linear`` over the last
        axis, the batch axes left as they are; ``torch.matmul`` by a weight that arrives
        inputs first (``F.linear`` would read it through a permute and a transpose, views
        forward and back; the bias, if any, is then added after it)."""
        sp = step.split
        batch_dims = [self.dim(left, i) for i in sp.batch]
        x = self.arrange(left, sp.batch + sp.inputs, batch_dims + [self.product(sp.inputs)])
        sides = [sp.inputs, sp.outputs]
        if self.layout[right] == sp.inputs + sp.outputs != sp.outputs + sp.inputs:
            fn, bias = "torch.matmul", ()
        else:
            fn, sides = "F.linear", sides[::-1]
            bias = (Param("bias"),) if self.takes_bias(step, sp.outputs,
                                                       sp.batch + sp.outputs) else ()
        w = self.arrange(right, sides[0] + sides[1], [self.product(s) for s in sides])
        y = self.call(base + "_lin", fn, x, w, *bias, layout=sp.batch + ("",),
                      dims=batch_dims + [self.product(sp.outputs)],
                      comment=f"linear, {step.flops:,} FLOPs: {what}")
        return self.reshape_to(y, step.result.indices,
                               batch_dims + [self.size(i) for i in sp.outputs], base)

    def takes_bias(self, step: Step, channels: tuple[str, ...], layout: tuple[str, ...]) -> bool:
        """Whether the conv or linear of ``step`` adds the bias itself (as ``nn.Conv2d``
        does: no separate pass over the output): it is the last step, its result is the output
        in the output's order, and the bias spans exactly its ``channels``."""
        net = self.net
        axes = [a for a in net.output.axes if from_cores(net, a)]
        return step is self.plan.steps[-1] and layout == net.output.indices and \
            len(axes) == 1 and tuple(axes[0]) == channels

    def epilogue(self, out_name: str) -> str:
        """Permute the last result into the output's order, merge its groups, add the bias."""
        net = self.net
        holder = self.var[self.plan.steps[-1].result.name] if self.plan.steps else \
            self.var[net.input.name]
        target = net.output.indices
        holder = self.arrange(holder, target, [self.dim(holder, i) for i in target])
        if any(len(a) > 1 for a in net.output.axes):
            holder = self.reshape_to(holder, [axis_text(a) for a in net.output.axes],
                                     [self.product(a) for a in net.output.axes], out_name)
        name = holder.name
        if isinstance(holder, Var) and any(getattr(n, "out", None) == name for n in self.nodes):
            self.nodes = rename(self.nodes, name, out_name)
            name = out_name
        folded = any(isinstance(n, Call) and Param("bias") in (*n.args, *dict(n.kwargs).values())
                     for n in self.nodes)
        if bias_shape(net) and not folded:  # skipped at run time when the module has no bias
            cored = [from_cores(net, a) for a in net.output.axes]
            # () where the bias's axes end the output: it broadcasts as it is stored
            shape = () if cored == sorted(cored) else \
                tuple(self.product(a) if c else Size.of(1) for a, c in zip(net.output.axes, cored))
            self.nodes.append(Bias(out_name, name, shape, "bias over " + ", ".join(
                axis_text(a) for a in net.output.axes if from_cores(net, a))))
            name = out_name
        return name

    def finish(self, data: str, result: str) -> Program:
        """Drop nodes whose result is unused; list the static sizes the rest read."""
        kept, used = prune(self.nodes, result)
        kept, used = prune(stored_cores(fold_unit_axes(kept), self.dims), result)
        # comments name the variables the code has: a dropped reshape by what it reshaped
        gone = {n.out for n in self.nodes if isinstance(n, Call)} - \
            {n.out for n in kept if isinstance(n, Call)}

        def shown(name: str) -> str:
            while name in gone and Var(name) in self.reshaped:
                name = self.reshaped[Var(name)].name
            return name
        kept = [replace(n, comment=re.sub(r"\b(\w+)\[", lambda m: shown(m.group(1)) + "[",
                                          n.comment))
                if isinstance(n, Call) and n.comment else n for n in kept]
        nodes = [replace(n, names=tuple(v if v in used else None for v in n.names))
                 if isinstance(n, Unpack) else n for n in kept]
        nodes = [n for n in nodes if not (isinstance(n, Unpack) and not any(n.names))]
        order = list(self.net.sizes)
        sizes = sorted(((v, i) for v, i in self.static.items() if v in used),
                       key=lambda vi: order.index(vi[1]) if vi[1] in order else 0)
        return Program(self.net, data, tuple(sizes), tuple(nodes), result)


# what returns a view of its input (torch.einsum: a permuted view of a bmm's result)
_VIEWS = {".reshape", ".permute", ".flip", "[]", "torch.einsum"}


def _weight_layout(step: Step, channels_last: bool) -> tuple[str, ...]:
    """The order of the weight's indices that a conv or linear step reshapes it from (a
    unit-kernel conv run as a product too: it drops the unit axes by a view); in a
    channels-last program, the kernels before the inputs: the conv reads that weight
    permuted (a view) as a channels-last one, the layout it computes in, where a contiguous
    one would be copied on the way."""
    sp = step.split
    kernels = tuple(str(c.kernel) for i in sp.spatial for c in step.convs if c.source == i)
    if not step.convs:
        return sp.groups + sp.outputs + sp.inputs
    if channels_last and step.op == "conv":
        return sp.groups + sp.outputs + kernels + sp.inputs
    return sp.groups + sp.outputs + sp.inputs + kernels


def _uniform(values: list[int]) -> int | tuple[int, ...]:
    return values[0] if len(set(values)) == 1 else tuple(values)


def _text(name: str, indices: Sequence[str]) -> str:
    return f"{name}[{', '.join(axis_text((i,)) for i in indices)}]"


def bias_shape(net: Network) -> tuple[int, ...]:
    """Shape of the bias: one dimension per output axis that comes from cores."""
    sizes = net.sizes
    return tuple(math.prod(sizes[i] for i in axis) for axis in net.output.axes
                 if from_cores(net, axis))


def from_cores(net: Network, axis: tuple[str, ...]) -> bool:
    """Whether an output axis carries an index that comes from the cores (the bias spans it)."""
    return any(net.index(i).role in (Role.OUTPUT_MODE, Role.PARALLEL) for i in axis)
