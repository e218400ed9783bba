"""Lower, the products: a step that multiplies two tensors without a convolution,
as ``torch.einsum``, as a batched matmul over views of the data (channel mixing of contiguous
data), or as the weight of a later conv or linear step written in the layout that step reads.

:class:`Products` is the part of the lowering (``lower._Lowering``) that emits these; it reads
the layouts ``program.Builder`` tracks and two attributes its subclass sets, ``channels_last``
and ``wanted`` (the weight layout each conv or linear step reads, by the name of the step's
weight operand); a conv step whose relations are all the identity (a 1x1 conv's core) that
the planner chose to run as a product goes through :meth:`Products.identities` first.
:func:`fold_unit_axes`, a pass over the finished nodes, makes the unit axes of
a kernel built as an outer product in its factors' views.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

from ..ir import is_unit
from ..program import Builder, Call, Node, Param, Var, reads
from ..shapes import Size, axis_text
from ..planning.plan import Step

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


class Products(Builder):
    """The emitters of product steps; ``lower._Lowering`` adds the program around them."""

    channels_last: bool  # the program is laid out for a channels-last input
    wanted: dict[str, tuple[str, ...]]  # the layout a conv or linear step reads its weight in
    unwanted: dict[str, tuple[str, ...]]  # a layout it must not get (see lower._weight_layout)

    def identities(self, step: Step, left: Var | Param,
                   right: Var | Param) -> tuple[Step, Var | Param, Var | Param]:
        """A step whose relations are all the identity (kernel 1, stride 1) as the channel
        mixing it is: the data's axes read as the output's (no op: they are as long) and the
        core reshaped without its unit kernel axes."""
        target = {c.source: c.target for c in step.convs}
        kernels = {str(c.kernel) for c in step.convs}
        self.layout[left] = tuple(target.get(i, i) for i in self.layout[left])
        self.dims[left] = tuple(self.size(i) if i in target.values() else d
                                for i, d in zip(self.layout[left], self.dims[left]))
        kept = [i for i in self.layout[right] if i not in kernels]
        right = self.reshape_to(right, kept, [self.dim(right, i) for i in kept],
                                right.name + "_m")
        step = replace(step, left=replace(step.left, indices=tuple(
            target.get(i, i) for i in step.left.indices)), right=replace(
            step.right, indices=tuple(i for i in step.right.indices if i not in kernels)),
            convs=())
        return step, left, right

    def einsum(self, step: Step, left: Var | Param, right: Var | Param, base: str,
               what: str) -> Var | Param:
        """A step without a convolution: a batched matmul where :meth:`matmul` applies, the
        next step's weight where a conv or linear step reads the result, else one
        ``torch.einsum`` (indices merged where there are more than its 52 letters)."""
        if step.data_side:
            mixed = (self.matmul_last if self.channels_last else self.matmul)(
                step, left, right, base, what)
            if mixed is not None:
                return mixed
        a, b, out = step.left.indices, step.right.indices, step.result.indices
        dims = [self.dim(left, i) if i in a else self.dim(right, i) for i in out]
        comment = f"einsum, {step.flops:,} FLOPs: {what}"
        names = list(dict.fromkeys(a + b))
        if base in self.wanted and set(self.wanted[base]) == set(out) and \
                set(a) | set(b) <= set(out) | (set(a) & set(b)):  # nothing summed on one side
            order = _nearest(a, b, out, self.wanted[base])
            if set(a) - set(out) and set(a) - set(b) and set(b) - set(a):  # a matrix product
                return self.weight(step, left, right, order, base, comment,
                                   self.wanted[base])
            if not step.data_side and set(a) | set(b) <= set(out):  # cores, nothing summed:
                # a Khatri-Rao step (CP's kernel)
                outer = self.outer(left, right, self.wanted[base], base, comment)
                if outer is not None:
                    return outer
            out = order  # an outer product: torch.einsum writes it contiguous in this order
            dims = [self.dim(left, i) if i in a else self.dim(right, i) for i in out]
        elif not step.data_side and set(a) - set(out) and set(a) - set(b) and \
                set(b) - set(a) and set(a) | set(b) <= set(out) | (set(a) & set(b)):
            # a matrix product of cores (a chain's inner step): one matmul dispatches a
            # third of the ops torch.einsum does (its permutes, views and bmm), fwd and bwd
            # (in the step's order: a later einsum reads its operands in theirs)
            # in the order the product comes out: the next product reads it as it is laid
            # out, and an einsum permutes it (a view) into its own order below
            return self.weight(step, left, right, _nearest(a, b, out, out), base, comment, out)
        # torch.einsum reads its operands in the step's orders
        left = self.arrange(left, a, [self.dim(left, i) for i in a])
        right = self.arrange(right, b, [self.dim(right, i) for i in b])
        if len(names) <= len(_LETTERS):
            letter = dict(zip(names, _LETTERS))
            eq = "".join(letter[i] for i in a) + "," + "".join(letter[i] for i in b) + \
                "->" + "".join(letter[i] for i in out)
            return self.call(base, "torch.einsum", eq, left, right, layout=out, dims=dims,
                             comment=comment)
        # torch.einsum knows 52 subscripts: merge the indices that play the same part (batch,
        # left/right free, contracted, summed on one side) into one axis each
        in_a, in_b, kept = set(a), set(b), set(out)
        by_index = dict(zip(out, dims))
        batch = [i for i in out if i in in_a and i in in_b]
        free_a, free_b = [i for i in out if i not in in_b], [i for i in out if i not in in_a]
        contracted = [i for i in a if i in in_b and i not in kept]
        summed_a = [i for i in a if i not in in_b | kept]
        summed_b = [i for i in b if i not in in_a | kept]
        left = self.merged(left, [batch, free_a, contracted, summed_a])
        right = self.merged(right, [batch, contracted, free_b, summed_b])
        letter = dict(zip(self.layout[left] + self.layout[right], _LETTERS))
        order = [axis_text(c) for c in (batch, free_a, free_b) if c]
        eq = "".join(letter[i] for i in self.layout[left]) + "," + \
            "".join(letter[i] for i in self.layout[right]) + "->" + \
            "".join(letter[i] for i in order)
        merged = self.call(base, "torch.einsum", eq, left, right, layout=tuple(order),
                           dims=[math.prod((by_index[i] for i in c), start=Size.of(1))
                                 for c in (batch, free_a, free_b) if c], comment=comment)
        flat = batch + free_a + free_b
        holder = self.reshape_to(merged, flat, [by_index[i] for i in flat], base + "_r")
        return self.arrange(holder, out, dims)

    def transposed(self, step: Step, left: Var | Param, right: Var | Param, base: str,
                   what: str) -> Var | None:
        """A product of cores of which one is a 1x1 conv's weight stored with unit axes
        (``U[r0, c, 1, 1]``), as one transposed conv of the two as stored: ``x[p, q, s...]``
        by ``w[q, r, t...]``, the one's spatial axes or the other's all units, gives
        ``[p, r, s... or t...]``; one op forward and one back for both gradients, where a
        matrix product reshapes the 1x1 weight into a matrix each way. None where the
        operands are not so (Tucker-2's kernel built first is: V into G, then U)."""
        for x, w in ((left, right), (right, left)):
            lx, lw = self.layout[x], self.layout[w]
            units = [all(map(is_unit, lx[2:])), all(map(is_unit, lw[2:]))]
            if not 3 <= len(lx) == len(lw) <= 5 or units[0] == units[1] or \
                    lw[0] != lx[1] or lx[1] in step.result.indices or \
                    set(step.result.indices) != {lx[0], lw[1], *(lw if units[0] else lx)[2:]}:
                continue
            spatial = (lw if units[0] else lx)[2:]
            dims = [self.dim(x, lx[0]), self.dim(w, lw[1])] + \
                [self.dim(w if units[0] else x, i) for i in spatial]
            return self.call(base, f"F.conv_transpose{len(spatial)}d", x, w,
                             layout=(lx[0], lw[1], *spatial), dims=dims,
                             comment=f"the next step's weight by a transposed conv, "
                                     f"{step.flops:,} FLOPs: {what}")
        return None

    def matmul(self, step: Step, left: Var | Param, right: Var | Param, base: str,
               what: str) -> Var | None:
        """Channel mixing of contiguous data, ``W[o, c] x[p, c, s] -> y[p, o, s]``, as one
        ``torch.bmm`` of the weight expanded over ``p`` (a view) and a view of the data:
        ``torch.einsum`` would copy the data channels-last and keep that copy for backward,
        and ``torch.matmul`` folds the batch the same way. None where the data's layout is
        not (kept, contracted, kept) or an index is a group or summed on one side."""
        a, b, out = step.left.indices, step.right.indices, step.result.indices
        layout = self.layout[left]
        contracted = [i for i in layout if i in b]
        if not contracted or set(a) - set(b) - set(out) or set(b) & set(out) & set(a) or \
                set(b) - set(a) - set(out) or set(contracted) & set(out):
            return None
        first = layout.index(contracted[0])
        if tuple(layout[first:first + len(contracted)]) != tuple(contracted):
            return None
        before, after = layout[:first], layout[first + len(contracted):]
        if not after:
            return None
        outputs = [i for i in out if i in b]

        def length(indices: Sequence[str], holder: Var | Param) -> Size:
            return math.prod((self.dim(holder, i) for i in indices), start=Size.of(1))
        p, c, s, o = length(before, left), length(contracted, left), length(after, left), \
            length(outputs, right)
        w = self.arrange(right, outputs + contracted, [o, c])
        w = self.call(right.name + "_e", ".expand", w, p, -1, -1, layout=("", "", ""),
                      dims=[p, o, c])
        x = self.reshape_to(left, (axis_text(before), axis_text(contracted), axis_text(after)),
                            [p, c, s], left.name + "_r")
        y = self.call(base + "_mm", "torch.bmm", w, x, layout=("", "", ""), dims=[p, o, s],
                      comment=f"channel mixing as a batched matmul, {step.flops:,} FLOPs: {what}")
        natural = tuple(before) + tuple(outputs) + tuple(after)
        dims = [self.dim(left, i) if i in layout else self.dim(right, i) for i in natural]
        y = self.reshape_to(y, natural, dims, base)
        if natural != out:
            y = self.arrange(y, out, [dims[natural.index(i)] for i in out])
        return y

    def matmul_last(self, step: Step, left: Var | Param, right: Var | Param, base: str,
                    what: str) -> Var | None:
        """Channel mixing of channels-last data, ``x[n, c, h, w] W[o, c] -> y[n, o, h, w]``,
        as one ``torch.mm`` of the data viewed as the ``(n h w, c)`` matrix it is stored as
        and the weight's transpose (views), the result viewed back channels-last: six ops
        forward where ``torch.einsum`` dispatches fourteen, and fewer back. None where the
        data is not 4-D with its one channel axis contracted and every other axis kept."""
        a, b, out = step.left.indices, step.right.indices, step.result.indices
        layout = self.layout[left]
        outputs = [i for i in out if i in b]
        if len(layout) != 4 or set(a) != set(layout) or [i for i in layout if i in b] != \
                [layout[1]] or layout[1] in out or set(b) != {layout[1], *outputs} or \
                set(out) != set(layout) - {layout[1]} | set(outputs):
            return None
        n, c, h, w = layout
        o = math.prod((self.dim(right, i) for i in outputs), start=Size.of(1))
        x = self.arrange(left, (n, h, w, c), [self.dim(left, i) for i in (n, h, w, c)])
        x = self.reshape_to(x, (axis_text((n, h, w)), c), [
            math.prod((self.dim(left, i) for i in (n, h, w)), start=Size.of(1)),
            self.dim(left, c)], left.name + "_r")
        wt = self.arrange(right, (c, *outputs), [self.dim(right, c), o])
        y = self.call(base + "_mm", "torch.mm", x, wt, layout=("", ""),
                      dims=[self.dims[x][0], o], comment="channel mixing of channels-last "
                      f"data as a matmul, {step.flops:,} FLOPs: {what}")
        natural = (n, h, w, *outputs)
        dims = [self.dim(left, i) if i in layout else self.dim(right, i) for i in natural]
        y = self.reshape_to(y, natural, dims, base + "_r")
        return self.arrange(y, out, [dims[natural.index(i)] for i in out])

    def outer(self, left: Var | Param, right: Var | Param, order: Sequence[str], base: str,
              comment: str) -> Var | None:
        """An outer product of two cores (indices they share kept, as CP's rank), written
        contiguous in ``order`` by one broadcast multiply of the cores viewed with unit axes:
        three ops forward where ``torch.einsum`` dispatches nine (its unsqueezes, permutes
        and views), and none of the permutes back. Where a core's indices come in another
        order than ``order``'s, the product is written in the order nearest to it that reads
        both as stored (:func:`_merged`), for the step that reads it to permute (a view);
        None where there is none."""
        merged = _merged(self.layout[left], self.layout[right], order)
        if merged is None:
            return None
        order, views = merged, []
        for holder in (left, right):
            layout = self.layout[holder]
            views.append(self.reshape_to(holder, order, [self.dim(holder, i) if i in layout
                                                         else Size.of(1) for i in order],
                                         holder.name + "_v"))
        dims = [self.dim(left, i) if i in self.layout[left] else self.dim(right, i)
                for i in order]
        return self.call(base, "torch.mul", *views, layout=tuple(order), dims=dims,
                         comment=comment.replace("einsum", "outer product", 1))

    def weight(self, step: Step, left: Var | Param, right: Var | Param,
               order: tuple[str, ...], base: str, comment: str,
               wanted: Sequence[str]) -> Var | Param:
        """A step that builds the weight of a later conv or linear (reconstruct-first), as
        one ``torch.matmul`` of the two operands flattened, its result in ``order``
        (:func:`_nearest`: one permute from ``wanted``, the layout that step reads);
        ``torch.einsum`` would permute it back to the step's order, and the consumer copy it
        again. Where that permutes operands that taken as stored would not need it, the
        product is made in their order instead and permuted once into ``wanted``: a permuted
        operand costs a copy forward, its gradient's permute back and, for a core, autograd's
        copy of a gradient whose strides are not the core's."""
        a, b, out = step.left.indices, step.right.indices, step.result.indices
        batch = [i for i in order if i in a and i in b]
        contracted = [i for i in a if i in b and i not in out]
        own = order[len(batch):]
        if own[0] not in a:  # the right operand's own indices come first: it goes left
            left, right, a = right, left, b
        first, second = [i for i in own if i in a], [i for i in own if i not in a]

        def cost(left: Var | Param, right: Var | Param, batch: list[str], first: list[str],
                 contracted: list[str], second: list[str]) -> int:
            # an operand copied into the product's layout costs about four times what the
            # product's one permute into the consumer's does (its gradient is permuted back,
            # and copied into a core's); a weight that would read as channels-last in a
            # contiguous program is out: the conv would hand back a channels-last result
            order = batch + first + second
            return _moves(self.layout[left], [batch, first, contracted]) + \
                _moves(self.layout[right], [batch, contracted, second]) + \
                (order != list(wanted)) + 100 * (tuple(order) == self.unwanted.get(base))
        # the order asked for, or either operand on the left with both read as stored; the
        # first of the cheapest
        options = [(left, right, batch, first, contracted, second)]
        for one, other in ((left, right), (right, left)):
            mine, theirs = set(self.layout[one]), set(self.layout[other])
            options.append((one, other,
                            [i for i in self.layout[one] if i in theirs and i in out],
                            [i for i in self.layout[one] if i not in theirs],
                            [i for i in self.layout[other] if i in mine and i not in out],
                            [i for i in self.layout[other] if i not in mine]))
        left, right, batch, first, contracted, second = min(options, key=lambda o: cost(*o))
        order = tuple(batch + first + second)
        dims = {i: self.dim(h, i) for h in (left, right) for i in self.layout[h]}
        lm = self.merged(left, [batch, first, contracted])
        rm = self.merged(right, [batch, contracted, second])
        flat = [c for c in (batch, first, second) if c]
        product = self.call(base, "torch.matmul", lm, rm, layout=tuple(map(axis_text, flat)),
                            dims=[math.prod((dims[i] for i in c), start=Size.of(1))
                                  for c in flat],
                            comment=comment.replace("einsum", "the next step's weight", 1))
        return self.reshape_to(product, order, [dims[i] for i in order], base + "_r")


def _merged(a: Sequence[str], b: Sequence[str], wanted: Sequence[str]) -> list[str] | None:
    """The order of the indices of ``a`` and ``b`` that keeps each in its own order, an index
    they share where it stands in both, taking first the index that comes first in
    ``wanted`` (``wanted`` itself where both are in its order); None where a shared index
    would have to come at two places."""
    rank = {i: k for k, i in enumerate(wanted)}
    a, b, order = list(a), list(b), []
    while a or b:
        heads = [h for h in (a[:1] + b[:1]) if not (h in a and h in b) or a[0] == b[0] == h]
        if not heads:
            return None
        head = min(heads, key=lambda i: rank.get(i, len(rank)))
        order.append(head)
        a, b = [i for i in a if i != head], [i for i in b if i != head]
    return order


def _moves(layout: Sequence[str], classes: list[list[str]]) -> int:
    """What reading a tensor laid out ``layout`` as a matrix of the non-empty ``classes``
    (merged, in that order) costs: 0 as it is stored, 1 where it is the transpose of a
    matrix it can be viewed as (a view, taken as such by the matmul), 4 where it is copied."""
    groups = [c for c in classes if c]
    if list(layout) == [i for c in groups for i in c]:
        return 0
    if len(groups) == 2 and list(layout) == groups[1] + groups[0]:
        return 1
    return 4


def _nearest(a: Sequence[str], b: Sequence[str], out: Sequence[str],
             wanted: Sequence[str]) -> tuple[str, ...]:
    """An order of ``out`` that ``torch.einsum`` writes contiguously (shared indices, then one
    operand's own, then the other's, each group in ``wanted``'s order) whose permute into
    ``wanted`` copies the longest contiguous runs: the most trailing indices in place."""
    rank = {i: k for k, i in enumerate(wanted)}
    batch = sorted((i for i in out if i in a and i in b), key=rank.__getitem__)
    own_a = sorted((i for i in out if i not in b), key=rank.__getitem__)
    own_b = sorted((i for i in out if i not in a), key=rank.__getitem__)

    def in_place(order: list[str]) -> int:
        n = 0
        while n < len(order) and order[-1 - n] == wanted[-1 - n]:
            n += 1
        return n
    return tuple(max([batch + own_a + own_b, batch + own_b + own_a], key=in_place))


def fold_unit_axes(nodes: list[Node]) -> list[Node]:
    """``t = torch.mul(a, b)`` of two reshaped tensors, then reshaped only to insert unit
    axes (a CP kernel's outer product made 4-D for its conv): the unit axes go into the two
    reshapes and the last reshape goes, two ops fewer forward and back."""
    count: dict[str, int] = {}
    for node in nodes:
        for name in reads(node):
            count[name] = count.get(name, 0) + 1
    made = {n.out: n for n in nodes if isinstance(n, Call)}

    def once_reshaped(arg: Any) -> Call | None:
        node = made.get(arg.name) if isinstance(arg, Var) else None
        return node if node is not None and node.fn == ".reshape" and \
            count.get(node.out) == 1 and len(node.args) > 1 else None
    out = list(nodes)
    for node in nodes:
        if not (isinstance(node, Call) and node.fn == ".reshape" and not node.kwargs and
                isinstance(node.args[0], Var)):
            continue
        mul = made.get(node.args[0].name)
        if mul is None or mul.fn != "torch.mul" or count.get(mul.out) != 1 or mul.kwargs:
            continue
        factors = [once_reshaped(a) for a in mul.args]
        if len(factors) != 2 or None in factors or \
                len(factors[0].args) != len(factors[1].args):
            continue
        one = Size.of(1)
        dims = [(Size.of(p), Size.of(q)) for p, q in zip(factors[0].args[1:], factors[1].args[1:])]
        wide = [q if p == one else p for p, q in dims]
        at, units = 0, []  # where each of the wanted axes comes from: a product axis, or a unit
        for d in node.args[1:]:
            if at < len(wide) and Size.of(d) == wide[at]:
                units.append(at)
                at += 1
            elif Size.of(d) == one:
                units.append(None)
            else:
                break
        else:
            if at == len(wide):
                for f in factors:
                    shape = tuple(1 if k is None else f.args[1 + k] for k in units)
                    out[out.index(f)] = replace(f, args=(f.args[0], *shape))
                out[out.index(mul)] = replace(mul, out=node.out)
                out.remove(node)
    return out


def stored_cores(nodes: list[Node], dims: dict) -> list[Node]:
    """A core reshaped to the shape it is stored in (its unit axes reshaped away, then put
    back, as :func:`fold_unit_axes` does for CP's ``A[r, c, 1, 1]``) read as it is: one view
    fewer forward and back. ``dims``: the shape of each core (``Builder.dims``)."""
    same = {n.out: n.args[0] for n in nodes if isinstance(n, Call) and n.fn == ".reshape" and
            isinstance(n.args[0], Param) and not n.kwargs and
            tuple(Size.of(s) for s in n.args[1:]) == tuple(dims[n.args[0]])}

    def swap(arg: Any) -> Any:
        if isinstance(arg, Var):
            return same.get(arg.name, arg)
        return type(arg)(swap(a) for a in arg) if isinstance(arg, (tuple, list)) else arg
    return [replace(n, args=swap(n.args), kwargs=swap(n.kwargs)) if isinstance(n, Call) else n
            for n in nodes if not (isinstance(n, Call) and n.out in same)]
