"""The documentation: the API reference is generated from the docstrings and current."""

from __future__ import annotations

import importlib.util

from .conftest import ROOT


def test_the_api_reference_is_current_and_documents_every_export():
    spec = importlib.util.spec_from_file_location("make_api", ROOT / "docs" / "make_api.py")
    make_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_api)
    text = make_api.render()
    assert (ROOT / "docs" / "api.md").read_text() == text, \
        "docs/api.md is stale: run python docs/make_api.py"
    assert "(no docstring)" not in text
    import tnspec
    for name in tnspec.__all__:
        if name not in ("formats", "__version__"):
            assert f"## `tnspec.{name}`" in text, name
    for name in tnspec.formats.NAMES:
        assert f"### `tnspec.formats.{name}`" in text


def test_the_format_guide_has_its_measured_table_and_plot():
    page = (ROOT / "docs" / "choosing.md").read_text()
    table = page.split("<!-- table -->")[1].split("<!-- /table -->")[0]
    assert "fwd+bwd time / dense" in table and "threads; python" in table  # machine beside it
    for fmt in ("low_rank", "cp", "tucker2", "htk2", "tt", "tr", "odd", "depthwise_separable"):
        assert f"| {fmt} |" in table, fmt
    assert (ROOT / "docs" / "choosing.png").stat().st_size > 10_000


def test_the_examples_in_docstrings_run():
    """Every ``>>>`` example in tnspec's docstrings gives what it shows."""
    import doctest
    import pkgutil
    import warnings

    import tnspec
    attempted = 0
    for info in pkgutil.walk_packages(tnspec.__path__, "tnspec."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = doctest.testmod(module, optionflags=doctest.ELLIPSIS |
                                     doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, info.name
        attempted += result.attempted
    assert attempted >= 20
