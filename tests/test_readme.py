"""The README's Python examples run as written."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from .conftest import ROOT

BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(code, tmp_path, monkeypatch):
    """Each block runs as a fresh program would: dynamo forgets the frames earlier tests
    compiled (after test_integration's compile tests, the fullgraph=True block here found "no
    compiled frames" unless dynamo was reset). A warning other than a deprecation (torch's) fails it: a
    new user copies these."""
    monkeypatch.chdir(ROOT)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, e.g. in export
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
