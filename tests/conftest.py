"""Shared fixtures. Long experiments are marked ``slow`` and run only with ``--runslow``."""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tnspec import progress
from tnspec.planning import calibration, measure
from tnspec.workflows.convert import threads as threads_
from tnspec.nn.autotune import Timing
from tnspec.planning.cost import CostModel
from tnspec.planning.measure import Sample

# Plans must not depend on the machine the suite runs on: calibration is off (the built-in
# constants) unless a test turns it on, and no test writes to the user's cache directory.
os.environ["TNSPEC_CALIBRATE"] = "0"
os.environ["TNSPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="tnspec-test-cache-")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.tn"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


#: the files of the full suite that ``python -m pytest -m "not heavy"`` leaves out, for a quick
#: pass over the compiler and the workflows: whole-model compiles, fuzzers, real checkpoints,
#: and the benchmarks' and experiments' smoke runs (about 45% of the suite's time)
HEAVY = frozenset({
    "nn/test_integration.py",  # torch.compile, export, ONNX, DDP and FSDP2 over many layers
    "test_benchmarks.py", "test_experiments.py",  # smoke runs of every command
    "language/test_fuzz_frontend.py", "emit/test_fuzz_backend.py",
    "workflows/test_fuzz_workflows.py", "workflows/test_fuzz_sequences.py",
    "workflows/test_real_models.py",  # MiniLM and MobileNetV2, where installed
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).resolve().parent
    for item in items:
        if item.path.relative_to(tests).as_posix() in HEAVY:
            item.add_marker(pytest.mark.heavy)
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def stopped_clock(monkeypatch):
    """The clock that bounds long jobs (the ``max_seconds`` of fits and of ``compress``) stands
    still, so that no test's outcome depends on how busy the machine is: a fit runs to its
    sweeps' and hops' own ends on a loaded laptop as on a quiet one. A test of a time bound
    makes the clock tick itself (:func:`ticking`)."""
    monkeypatch.setattr(progress, "clock", lambda: 0.0)


@pytest.fixture(autouse=True)
def quiet_neighbours(monkeypatch):
    """``compress(threads="auto")`` sees no other process running, so that no test's numbers
    depend on how many threads a busy CI machine would leave it (a test of the choice says
    what it sees)."""
    monkeypatch.setattr(threads_, "others_running", lambda: 0)


@pytest.fixture
def ticking(monkeypatch):
    """``ticking(step)``: from then on every read of the jobs' clock advances it by ``step``
    seconds; returns the list of the times read."""
    def start(step: float) -> list[float]:
        reads: list[float] = []

        def clock() -> float:
            reads.append(len(reads) * step)
            return reads[-1]
        monkeypatch.setattr(progress, "clock", clock)
        return reads
    return start


@pytest.fixture
def float64():
    """float64 as the default dtype for one test, restored afterwards."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


#: a plausible machine, as an idle measurement would fit it
IDLE = CostModel(conv_rate=1e11, einsum_rate=3e10, channels=4, bandwidth=2e9, overhead=5e-5,
                 grouped=1.5, einsum_bandwidth=1e9)


def quiet(medians: list[float]) -> list[Timing]:
    """What ``Layer._time`` returns for candidates timed at ``medians`` seconds on a quiet
    machine (no spread between rounds)."""
    return [Timing(m, 0.0) for m in medians]


def idle_samples(*args: object, truth: CostModel = IDLE, **kwargs: object) -> list[Sample]:
    """What ``measure.measure`` gives on an idle machine whose costs are ``truth`` exactly."""
    steps = [Sample("conv", n, g, ci, co, side * side, k * k, 0.0)
             for n, g, ci, co, side, k in measure.CONVS]
    steps += [Sample("einsum", n, 1, ci, co, pos, 1, 0.0) for n, ci, co, pos in measure.EINSUMS]
    return [replace(s, seconds=s.predicted(truth)) for s in steps]


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    """Calibration on, with an empty cache of its own; the process's memory forgotten. The
    suite must pass on a busy CI machine, where a real calibration is not plausible and is
    not kept: so the device's steps "measure" as an idle machine would (``idle_samples``),
    and other processes running beside the suite do not count (a test of either sets
    ``calibration.measure`` or ``calibration.others_running`` itself)."""
    monkeypatch.setattr(calibration, "others_running", lambda: 0)
    monkeypatch.setattr(calibration, "measure", idle_samples)
    monkeypatch.setenv(calibration.ENV_SWITCH, "1")
    monkeypatch.setenv(calibration.ENV_DIR, str(tmp_path))
    calibration.forget()
    yield tmp_path / calibration.FILE_NAME
    calibration.forget()
