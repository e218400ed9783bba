"""The code in the README and the guides in docs/ runs as written: every ```python block, each
as a fresh program. A ```py block is a fragment that cannot run alone (it needs a process
group, say); it must open with a comment saying why and where the suite runs its code instead.
docs/api.md is generated from the docstrings (tests/test_docs.py checks it)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from .conftest import ROOT

PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md")
                                      if p.name != "api.md")


def blocks(fence: str) -> list[tuple[str, int, str]]:
    """(page, block number on that page, code) of every block fenced with ```fence."""
    found = []
    for page in PAGES:
        code = re.findall(rf"^```{fence}\n(.*?)^```", page.read_text(), re.S | re.M)
        found += [(page.relative_to(ROOT).as_posix(), n, c) for n, c in enumerate(code)]
    return found


RUN = blocks("python")


def test_the_readme_and_the_guides_have_examples():
    pages = {page for page, _, _ in RUN}
    assert {"README.md", "docs/language.md", "docs/layers.md", "docs/compressing.md",
            "docs/adapters.md"} <= pages
    assert sum(page == "README.md" for page, _, _ in RUN) >= 3


def test_every_fragment_says_why_it_does_not_run():
    for page, n, code in blocks("py"):
        assert code.startswith("# ") and "runs" in code.split("\n\n")[0], (page, n)


@pytest.mark.parametrize("page, n, code", RUN, ids=[f"{p}:{n}" for p, n, _ in RUN])
def test_a_doc_example_runs(page, n, code, monkeypatch):
    """Each block runs as a fresh program would: dynamo forgets the frames earlier tests
    compiled (after test_integration's compile tests, the fullgraph=True block found "no
    compiled frames" unless dynamo was reset). A warning other than a deprecation (torch's)
    fails it: a new user copies these."""
    monkeypatch.chdir(ROOT)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, e.g. in export
        exec(compile(code, f"{page} block {n}", "exec"), {"__name__": "doc_example"})
