"""Hypothesis fuzzing of the front end: on any text, parse+check returns a Network or raises
SpecError, and nothing else (no Lark exception, no RecursionError, no KeyError...)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tnspec
from tnspec import SpecError

from ..conftest import EXAMPLES

SEEDS = [p.read_text() for p in EXAMPLES] + [
    "x[b, c, h+kh-1, w+kw-1], U[c, r0, phi], G[r0, r1, kh, kw, phi], V[r1, o, phi] -> y[b, o, h, w]",
    "x[b, (i0 i1), 2*h+kh-1, w+2*kw-2], A[r0, i0, r1], B[r1, i1, kh, kw, r0, phi], C[phi, o] -> y[b, o, h, w]",
    "x[b, c, 2*t], D[c, o] -> y[b, c, o, t]",
]
SIZES = dict(c=3, o=2, r0=2, r1=2, kh=3, kw=3, phi=2, i0=2, i1=2, r=2)
ALPHABET = "xyWAB[](),->+-*/ 0123456789hkbcor_#{}:=\nlayer"
FUZZ = settings(max_examples=2000, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def front_end(text: str) -> None:
    try:
        tnspec.compile(text, **SIZES)
    except SpecError as err:
        assert err.message and str(err)
        return
    except Exception as exc:  # pragma: no cover - this is the failure being looked for
        raise AssertionError(f"{type(exc).__name__} escaped for {text!r}: {exc}") from exc


def size_free(text: str) -> None:
    """Files bring their own sizes: compile every layer without keyword sizes too."""
    try:
        tnspec.compile_all(text)
    except SpecError:
        return


@FUZZ
@given(st.text(max_size=200))
def test_arbitrary_text(text):
    front_end(text)
    size_free(text)


@FUZZ
@given(st.text(alphabet=ALPHABET, max_size=120))
def test_text_over_the_spec_alphabet(text):
    front_end(text)
    size_free(text)


@st.composite
def mutated(draw):
    text = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(text)))
        action = draw(st.sampled_from(["insert", "delete", "replace", "duplicate"]))
        piece = draw(st.text(alphabet=ALPHABET, min_size=1, max_size=3))
        if action == "insert":
            text = text[:pos] + piece + text[pos:]
        elif action == "delete":
            text = text[:pos] + text[pos + len(piece):]
        elif action == "replace":
            text = text[:pos] + piece + text[pos + len(piece):]
        else:
            text = text[:pos] + text[pos:pos + 12] + text[pos:]
    return text


@FUZZ
@given(mutated())
def test_mutated_valid_specs(text):
    front_end(text)
    size_free(text)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(SIZES) + ["zz", "b", "h"]),
                       st.one_of(st.integers(-3, 2**40), st.floats(), st.text(max_size=3),
                                 st.none(), st.booleans()), max_size=6))
def test_arbitrary_size_arguments(sizes):
    try:
        tnspec.compile(SEEDS[-3], **{**SIZES, **sizes})
    except SpecError:
        pass
