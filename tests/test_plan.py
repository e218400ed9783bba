"""Stage 4, plan: each step's op and axis split are decided here, and the report shows them."""

from __future__ import annotations

import tnspec
from tnspec.plan import Split, plan
from tnspec.shapes import bind_shape

HTK2 = ("x[b, c, h+kh-1, w+kw-1], U[c, r0, phi], G[r0, r1, kh, kw, phi], V[r1, o, phi]"
        " -> y[b, o, h, w]")


def planned(text: str, shape, planner: str = "auto", **sizes):
    return plan(bind_shape(tnspec.compile(text, **sizes), shape), planner)


def test_left_to_right_htk2_is_mix_conv_mix_with_their_axis_splits():
    p = planned(HTK2, (8, 64, 32, 32), "left-to-right", c=64, o=64, r0=10, r1=10, kh=3,
                kw=3, phi=4)
    assert [s.op for s in p.steps] == ["conv1x1", "conv", "conv1x1"]
    first, conv, last = p.steps
    assert first.split == Split(batch=("b",), inputs=("c",), outputs=("r0", "phi"),
                                spatial=("h+kh-1", "w+kw-1"))
    assert conv.split == Split(batch=("b",), groups=("phi",), inputs=("r0",), outputs=("r1",),
                               spatial=("h+kh-1", "w+kw-1"))
    assert [c.text for c in conv.convs] == ["h+kh-1", "w+kw-1"]
    assert last.split.groups == () and last.split.inputs == ("phi", "r1")
    assert last.result.indices == ("b", "o", "h", "w")  # the data never moves


def test_linear_step_and_einsum_among_cores():
    p = planned("x[b, i], A[i, r], B[r, o] -> y[b, o]", (4, 8), "left-to-right", i=8, r=2,
                o=3)
    assert [s.op for s in p.steps] == ["linear", "linear"]
    assert p.steps[0].split == Split(batch=("b",), inputs=("i",), outputs=("r",))
    p = planned("x[b, i], A[i, r], B[r, o] -> y[b, o]", (4, 8), "dense-first", i=8, r=2, o=3)
    assert [s.op for s in p.steps] == ["einsum", "linear"] and p.steps[0].split == Split()


def test_report_names_each_steps_op():
    p = planned(HTK2, (8, 64, 32, 32), "left-to-right", c=64, o=64, r0=10, r1=10, kh=3, kw=3,
                phi=4)
    rows = p.report().splitlines()
    assert rows[2].split()[:2] == ["step", "op"]
    assert [r.split()[1] for r in rows[3:]] == ["conv1x1", "conv", "conv1x1"]
