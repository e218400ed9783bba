"""Every bundled example is documented and compiles; the paper's structures are as described."""

from __future__ import annotations

import pytest

import tnspec
from tnspec import Role

from .conftest import EXAMPLES

EXPECTED = {"standard_conv", "low_rank", "cp", "tucker2", "htk2", "tt_conv", "tr_conv",
            "block_term", "odd", "hypernet", "depthwise_separable", "tensorized_linear",
            "conv1d", "conv3d"}


def test_the_promised_examples_exist():
    assert {p.stem for p in EXAMPLES} == EXPECTED


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_is_commented_and_compiles(path):
    text = path.read_text()
    assert text.startswith("# "), "each example opens with a comment saying what it is"
    for net in tnspec.compile_all(text):
        assert net.cores and net.num_parameters > 0


def test_odd_like_edge_multiset():
    net = tnspec.compile((EXAMPLES[0].parent / "odd.tn").read_text())
    assert len(net.cores) == 9
    assert len(net.with_role(Role.RANK)) == 14
    assert net.with_role(Role.INPUT_MODE) == ("i0", "i1")
    assert set(net.with_role(Role.OUTPUT_MODE)) == {"o0", "o1"}
    assert net.with_role(Role.HYPEREDGE) == ("phi",)
    assert all("phi" in c.indices for c in net.cores)


def test_tr_channels_are_tensorized_6x4x4():
    net = tnspec.compile((EXAMPLES[0].parent / "tr_conv.tn").read_text())
    assert net.input.axes[1] == ("c0", "c1", "c2")
    assert [net.sizes[n] for n in ("c0", "c1", "c2", "o0", "o1", "o2")] == [6, 4, 4, 6, 4, 4]
    assert len(net.with_role(Role.RANK)) == 7  # the ring closes: r0 joins B2 and A0
