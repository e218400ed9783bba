"""Codegen prints nothing unchecked: hostile fields of a Network built by hand (the dataclasses
are public) are refused with a SpecError before any generated code runs."""

from __future__ import annotations

import builtins
import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import tnspec
from tnspec.emit import codegen

BASE = tnspec.compile("x[b, c, h+kh-1], U[c, r, phi], G[r, s, kh, phi], V[s, o, phi] -> y[b, o, h]",
                      c=3, o=2, r=2, s=2, kh=3, phi=2)


def _pwned() -> bool:
    return bool(getattr(nn, "PWNED", 0) or getattr(builtins, "PWNED", 0))


@pytest.fixture(autouse=True)
def _clean():
    for mod in (nn, builtins):
        mod.__dict__.pop("PWNED", None)
    yield
    for mod in (nn, builtins):
        mod.__dict__.pop("PWNED", None)


def _cores(net: tnspec.Network) -> dict[str, torch.Tensor]:
    return {c.name: torch.randn(*[net.sizes[i] for i in c.indices]) for c in net.cores}


def _rename_index(net: tnspec.Network, old: str, new: str) -> tnspec.Network:
    def tensor(t: tnspec.Tensor) -> tnspec.Tensor:
        return dataclasses.replace(t, axes=tuple(tuple(new if n == old else n for n in axis)
                                                 for axis in t.axes))
    return dataclasses.replace(
        net, input=tensor(net.input), cores=tuple(map(tensor, net.cores)),
        output=tensor(net.output),
        indices=tuple(dataclasses.replace(ix, name=new) if ix.name == old else ix
                      for ix in net.indices),
        params=tuple((new if n == old else n, v) for n, v in net.params),
        convs=tuple(dataclasses.replace(c, kernel=new if c.kernel == old else c.kernel)
                    for c in net.convs))


def _hostile(net: tnspec.Network, field: str, text: str) -> tnspec.Network:
    """``net`` with ``text`` put into one of its printed fields."""
    r = dataclasses.replace
    if field == "name":
        return r(net, name=text)
    if field == "input":
        return r(net, input=r(net.input, name=text))
    if field == "output":
        return r(net, output=r(net.output, name=text))
    if field == "core":
        return r(net, cores=(r(net.cores[0], name=text), *net.cores[1:]))
    if field in ("rank", "hyperedge", "batch", "kernel"):
        old = {"rank": "r", "hyperedge": "phi", "batch": "b", "kernel": "kh"}[field]
        return _rename_index(net, old, text)
    if field == "param":
        return r(net, params=((text, 3), *net.params[1:]))
    if field == "derived":
        return r(net, derived=((text, ("int", 3)),))
    if field == "init":
        return r(net, options=r(net.options, init=text))
    if field == "activation":
        return r(net, options=r(net.options, activation=text))
    if field == "conv":
        return r(net, convs=(r(net.convs[0], source=text),))
    raise AssertionError(field)


FIELDS = ("name", "input", "output", "core", "rank", "hyperedge", "batch", "kernel", "param",
          "derived", "init", "activation", "conv")

# each runs code where it lands, before the fix: a class body, a string, an f-string, a comment
PAYLOADS = [
    "A(nn.Module):\n    pass\nsetattr(nn, 'PWNED', 1)\nclass B",
    "x{setattr(nn, 'PWNED', 1)}",
    "x\"); setattr(nn, 'PWNED', 1); (\"",
    "r\nsetattr(nn, 'PWNED', 1)\n",
    "r\rsetattr(nn, 'PWNED', 1)\r",
    'r"""\nsetattr(nn, "PWNED", 1)\n"""',
    "W = 1; setattr(nn, 'PWNED', 1); x",
    "é",
    "",
]


def _try_all(net: tnspec.Network) -> None:
    """Build, run (with a wrong shape too, to reach the f-string messages), contract, print."""
    attempts = [
        lambda: tnspec.Layer(net)(torch.randn(2, 3, 8)),
        lambda: tnspec.Layer(net)(torch.randn(2, 4, 8)),
        lambda: tnspec.contract(net, torch.randn(2, 3, 8), _cores(net)),
        lambda: codegen.generate([codegen.LayerCode(net, None)]),
    ]
    for attempt in attempts:
        try:
            attempt()
        except tnspec.SpecError:
            pass
        except ValueError as exc:  # the generated shape check, with a clean message
            assert "expected shape" in str(exc)
        assert not _pwned()


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_hostile_field_is_refused_and_never_executed(field, payload):
    net = _hostile(BASE, field, payload)
    with pytest.raises(tnspec.SpecError, match="not a name tnspec can print|unknown|malformed"):
        tnspec.Layer(net)
    _try_all(net)


@pytest.mark.parametrize("field", ["input", "output"])
def test_an_operand_named_like_another_is_refused_as_the_parser_refuses_it(field):
    """Found by the fuzzer below: an input named like a core crashed the lowering."""
    net = _hostile(BASE, field, "U")
    with pytest.raises(tnspec.SpecError, match=r"operand name 'U' is used twice"):
        tnspec.Layer(net)
    with pytest.raises(tnspec.SpecError, match=r"operand name 'U' is used twice"):
        tnspec.contract(net, torch.randn(2, 3, 8), _cores(net))


def test_the_class_injection_through_the_layer_name_is_refused():
    net = dataclasses.replace(BASE, name=PAYLOADS[0])
    with pytest.raises(tnspec.SpecError, match=r"layer name .A\(nn.Module\)"):
        tnspec.contract(net, torch.randn(2, 3, 8), _cores(net))
    assert not _pwned()


def test_the_fstring_injection_through_the_input_name_is_refused():
    net = dataclasses.replace(BASE, input=dataclasses.replace(BASE.input, name=PAYLOADS[1]))
    with pytest.raises(tnspec.SpecError, match=r"input name .x\{setattr"):
        tnspec.Layer(net)
    assert not _pwned()


def test_hostile_nodes_of_a_program_are_refused_where_they_are_printed():
    layer = tnspec.Layer(BASE)
    program = tnspec.emit.lower.lower(layer.plan((2, 3, 8)))
    good = codegen.generate([codegen.LayerCode(BASE, program)])
    assert "class TensorNetworkLayer" in good
    call = next(n for n in program.nodes if isinstance(n, tnspec.program.Call))
    for bad in (dataclasses.replace(call, out="y\nsetattr(nn, 'PWNED', 1)"),
                dataclasses.replace(call, fn="setattr(nn, 'PWNED', 1) or torch.einsum"),
                dataclasses.replace(call, comment="ok\nsetattr(nn, 'PWNED', 1)")):
        nodes = tuple(bad if n is call else n for n in program.nodes)
        hostile = dataclasses.replace(program, nodes=nodes)
        with pytest.raises(tnspec.SpecError, match="variable|torch function|one line"):
            codegen.generate([codegen.LayerCode(BASE, hostile)])
    with pytest.raises(tnspec.SpecError, match="cannot be printed"):
        codegen.generate([codegen.LayerCode(BASE, program, 'x"""; setattr(nn, "PWNED", 1)')])
    assert not _pwned()


_FRAGMENTS = st.sampled_from(["\n", "\r", "\"", "'", "\\", "{", "}", "#", "(", ")", ":", ";",
                              "setattr(nn, 'PWNED', 1)", "\u2028", "\x0c", " ", "\t", "é",
                              "0", "r", "_", "."])
HOSTILE = st.one_of(st.text(max_size=12), st.lists(_FRAGMENTS, min_size=1, max_size=8)
                    .map("".join))


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(FIELDS), text=HOSTILE)
def test_fuzz_hostile_network_fields(field, text):
    """Whatever string lands in whatever printed field: a clean SpecError, or (for a valid
    name) a working layer; never executed code, never a SyntaxError or a deep traceback."""
    _try_all(_hostile(BASE, field, text))


@pytest.mark.parametrize("field, name, message", [
    ("core", "__0", "names starting with '__' are reserved"),  # self.__0 would be mangled
    ("core", "_W", "clashes with an attribute"),
    ("core", "forward", "clashes with an attribute"),
    ("rank", "__r", "names starting with '__' are reserved"),
    ("input", "__x", "names starting with '__' are reserved"),
])
def test_a_hand_built_network_obeys_the_check_stages_name_rules(field, name, message):
    """The fuzz test found a core named '__0' reaching codegen, where Python mangled
    ``self.__0`` in the class body: a hand-built Network gets the parser's rules."""
    with pytest.raises(tnspec.SpecError, match=message):
        tnspec.Layer(_hostile(BASE, field, name))
