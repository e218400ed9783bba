"""Packaging: license, typing marker, metadata, changelog, explicit format signatures."""

from __future__ import annotations

import inspect
import tomllib

import tnspec
from tnspec import formats

from .conftest import ROOT


def test_metadata_license_urls_and_honest_torch_bound():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert {"Homepage", "Documentation", "Changelog", "Issues"} <= set(project["urls"])
    assert "torch>=2.4,<3" in project["dependencies"]  # torch.get_autocast_dtype: 2.4
    assert "tested with 2.13.0" in (ROOT / "README.md").read_text()
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")


def test_the_package_is_marked_typed():
    assert (ROOT / "tnspec" / "py.typed").exists()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["tnspec"]


def test_every_named_format_has_an_explicit_documented_signature():
    geometry = ["in_channels", "out_channels", "kernel_size", "rank", "stride", "padding",
                "dilation", "groups", "in_modes", "out_modes", "phi"]
    for name in formats.NAMES:
        fn = getattr(formats, name)
        params = inspect.signature(fn).parameters
        assert list(params)[:len(geometry)] == geometry, name
        assert all(p.kind is not p.VAR_KEYWORD and p.annotation is not p.empty
                   for p in params.values()), name
        assert fn.__doc__ and "build" in fn.__doc__
    doc = inspect.getdoc(formats.build)
    for arg in ("in_channels", "kernel_size", "rank", "stride", "groups", "in_modes", "phi"):
        assert arg in doc
    assert formats.htk2(8, 8, 3, rank=2).sizes["phi"] == 4
    assert formats.block_term(8, 8, 3, rank=2, blocks=3).sizes["n"] == 3
    assert tnspec.__version__
