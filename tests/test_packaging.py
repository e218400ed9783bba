"""Packaging: license, typing marker, metadata, changelog, explicit format signatures, and the
wheel and sdist built from the tree."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile

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


def test_pyproject_lists_every_subpackage():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {"tnspec." + p.parent.relative_to(ROOT / "tnspec").as_posix().replace("/", ".")
             for p in (ROOT / "tnspec").rglob("__init__.py")} - {"tnspec.."}
    assert found | {"tnspec", "tnspec.grammar"} == set(config["packages"])


def test_wheel_and_sdist_hold_every_module_and_the_wheel_runs_the_cli(tmp_path):
    """Built from the tree as pip would (setuptools' PEP 517 hooks), unpacked into a folder of
    its own, and run from there: ``tnspec compile examples/htk2.tn -o layer.py``."""
    src, out = tmp_path / "src", tmp_path / "dist"
    for name in ("tnspec", "grammar"):  # a copy: no build/ left over from an earlier build
        shutil.copytree(ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    # the hooks rewrite sys.argv and log to stdout: keep the folder, mark the built names
    build = ("import sys; from setuptools import build_meta as b; out = sys.argv[1]; "
             "w = b.build_wheel(out); s = b.build_sdist(out); print('BUILT', w, s)")
    built = subprocess.run([sys.executable, "-c", build, str(out)], cwd=src, text=True,
                           capture_output=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel_name, sdist_name = built.stdout.split("BUILT ")[-1].split()
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tnspec").rglob("*.py")}
    with zipfile.ZipFile(out / wheel_name) as wheel:
        names = set(wheel.namelist())
        assert modules | {"tnspec/grammar/tnspec.lark", "tnspec/py.typed"} <= names
        wheel.extractall(tmp_path / "site")
    with tarfile.open(out / sdist_name) as sdist:
        top = sdist_name.removesuffix(".tar.gz")
        names = {n.removeprefix(top + "/") for n in sdist.getnames()}
        assert modules | {"grammar/tnspec.lark", "pyproject.toml"} <= names
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    ran = subprocess.run([sys.executable, "-c", "import tnspec, sys; print(tnspec.__file__); "
                          "from tnspec.cli import main; sys.exit(main())", "compile",
                          str(ROOT / "examples" / "htk2.tn"), "-o", "layer.py"],
                         cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith(str(tmp_path / "site" / "tnspec"))  # the wheel's, not the tree's
    assert "class" in (tmp_path / "layer.py").read_text()


def test_the_quick_pass_leaves_out_files_that_exist():
    """``-m "not heavy"`` (the README's quick pass) names test files: a renamed one must not
    slip back into the quick pass, nor a deleted one linger in the list."""
    from .conftest import HEAVY
    assert all((ROOT / "tests" / name).is_file() for name in HEAVY)
