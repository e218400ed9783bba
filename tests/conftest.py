"""Shared fixtures. Long experiments are marked ``slow`` and run only with ``--runslow``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from tnspec import calibration

# Plans must not depend on the machine the suite runs on: calibration is off (the built-in
# constants) unless a test turns it on, and no test writes to the user's cache directory.
os.environ["TNSPEC_CALIBRATE"] = "0"
os.environ["TNSPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="tnspec-test-cache-")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.tn"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def float64():
    """float64 as the default dtype for one test, restored afterwards."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    """Calibration on, with an empty cache of its own; the process's memory forgotten. Other
    processes running beside the suite do not make the calibration fall back (a test of that
    sets ``calibration.others_running`` itself)."""
    monkeypatch.setattr(calibration, "others_running", lambda: 0)
    monkeypatch.setenv(calibration.ENV_SWITCH, "1")
    monkeypatch.setenv(calibration.ENV_DIR, str(tmp_path))
    calibration.forget()
    yield tmp_path / calibration.FILE_NAME
    calibration.forget()
