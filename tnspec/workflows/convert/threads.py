"""How many CPU threads ``compress`` runs torch on: on a machine shared with other jobs,
torch's intra-op threads wait on each other for cores that are taken (a compress beside one
busy neighbour on 2 cores took 5.2x its quiet time at torch's 2 threads, 2.4x at 1: see
``benchmarks/compress_load.py``), so ``threads="auto"`` runs on the cores the others leave
free, and puts torch's setting back afterwards."""

from __future__ import annotations

import os

import torch
from torch import nn

from ...errors import SpecError
from ...planning.calibration import others_running


def check(threads: int | str | None) -> None:
    """Raise the SpecError for a ``threads=`` that is not "auto", None or a positive int."""
    if threads in ("auto", None) or (isinstance(threads, int) and
                                     not isinstance(threads, bool) and threads > 0):
        return
    raise SpecError(f"threads={threads!r} is not a number of threads",
                    hint="'auto' (the cores other jobs leave free), a number of threads, or "
                    "None (torch's setting as it is)")


def use(threads: int | str | None, model: nn.Module) -> str:
    """Set torch's intra-op threads as ``threads`` asks for a job on ``model`` (the caller
    puts the count back); why in words, "" where torch's count stays."""
    count, why = chosen(threads, all(p.device.type == "cpu" for p in model.parameters()))
    if count != torch.get_num_threads():
        torch.set_num_threads(count)
    return why


def chosen(threads: int | str | None, cpu: bool) -> tuple[int, str]:
    """The intra-op thread count to run on, and why in words ("" where it is torch's own):
    ``threads`` where it is a number; with "auto" on a CPU, torch's count capped by the cores
    not taken by other processes' running threads (:func:`others_running`; at
    least 1)."""
    now = torch.get_num_threads()
    if isinstance(threads, int):
        return threads, "" if threads == now else f"{threads} torch thread(s), as asked"
    if threads is None or not cpu:
        return now, ""
    others = others_running()
    if others is None or others <= 0:
        return now, ""
    free = max((os.cpu_count() or 1) - others, 1)
    if free >= now:
        return now, ""
    return free, (f"{free} torch thread(s) of {now}: {others} thread(s) of other processes "
                  "were running on the CPUs (threads='auto'; threads=None keeps torch's count)")
