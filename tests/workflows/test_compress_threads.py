"""``compress(threads=...)``: torch's intra-op threads while it runs, capped at the cores other
processes leave free with "auto", and put back after, also when it raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tnspec
from tnspec.workflows.convert import threads as threads_

from ..model_state import snapshot, unchanged


@pytest.fixture
def two_threads():
    """torch on 2 intra-op threads of 2 CPUs for one test, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _seen_threads() -> tuple[list[int], object]:
    """A ``run`` that records torch's thread count at each forward compress makes."""
    seen: list[int] = []

    def run(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return model(batch)
    return seen, run


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 12))


DATA = [torch.randn(64, 16, generator=torch.Generator().manual_seed(1))]


def test_auto_runs_on_the_cores_other_processes_leave_free(monkeypatch, two_threads):
    monkeypatch.setattr(threads_, "others_running", lambda: 1)
    monkeypatch.setattr(threads_.os, "cpu_count", lambda: 2)
    seen, run = _seen_threads()
    model, report = tnspec.compress(_net(), 0.5, ("low_rank",), data=DATA, run=run,
                                    fit={"max_iter": 5})
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2  # put back
    assert "ran on 1 torch thread(s) of 2: 1 thread(s) of other processes were running" \
        in str(report)


def test_auto_leaves_torch_alone_on_a_quiet_machine_and_none_leaves_it_always(monkeypatch,
                                                                              two_threads):
    seen, run = _seen_threads()
    monkeypatch.setattr(threads_, "others_running", lambda: 0)
    _, report = tnspec.compress(_net(), 0.5, ("low_rank",), data=DATA, run=run,
                                fit={"max_iter": 5})
    monkeypatch.setattr(threads_, "others_running", lambda: 5)
    _, again = tnspec.compress(_net(), 0.5, ("low_rank",), data=DATA, run=run,
                               fit={"max_iter": 5}, threads=None)
    assert set(seen) == {2} and "torch thread" not in str(report) + str(again)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_number_sets_the_threads_and_all_is_put_back_when_it_raises(two_threads, error):
    """An error or Ctrl-C (here in the second forward compress makes, after the inputs were
    recorded on the first) leaves torch's thread count and the model as they were, by hash."""
    seen: list[int] = []

    def failing(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        if len(seen) == 2:
            raise error("the batch is broken")
        return model(batch)
    net = _net()
    net[0].requires_grad_(False)
    before = snapshot(net)
    with pytest.raises(error, match="the batch is broken"):
        tnspec.compress(net, 0.5, ("low_rank",), data=DATA, run=failing, threads=1)
    assert seen == [1, 1] and torch.get_num_threads() == 2 and unchanged(before, net)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "all"])
def test_threads_that_are_not_a_count_or_auto_are_refused(bad):
    with pytest.raises(tnspec.SpecError,
                       match=r"(?s)threads=.* is not a number of threads.*hint: 'auto'"):
        tnspec.compress(_net(), 0.5, ("low_rank",), threads=bad)


def test_tensorize_fits_on_the_free_cores_and_only_when_it_fits(monkeypatch, two_threads):
    """``tensorize(weights="fit")`` takes ``threads`` as ``compress`` does: its fits run on
    the cores other processes leave free, torch's count put back after; a fresh init fits
    nothing and leaves the threads alone."""
    monkeypatch.setattr(threads_, "others_running", lambda: 1)
    monkeypatch.setattr(threads_.os, "cpu_count", lambda: 2)
    seen: list[int] = []
    fit = tnspec.Layer.fit_

    def watched(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return fit(self, *args, **kwargs)
    monkeypatch.setattr(tnspec.Layer, "fit_", watched)
    _, report = tnspec.tensorize(_net(), "low_rank", rank=0.5, weights="fit",
                                 fit={"max_iter": 5})
    assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    assert "fitted on 1 torch thread(s) of 2" in str(report)
    _, fresh = tnspec.tensorize(_net(), "low_rank", rank=0.5)
    assert "torch thread" not in str(fresh)
    with pytest.raises(tnspec.SpecError, match=r"threads=0 is not a number of threads"):
        tnspec.tensorize(_net(), "low_rank", weights="fit", threads=0)
