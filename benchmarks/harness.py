"""The measuring harness the benchmarks share: a layer's forward and backward step as a
network's inner layer runs it, interleaved timing (synchronized on CUDA), activation memory,
full-float32 comparisons, the allocator setting and the machine line printed beside a table."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import platform
import random
import time
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tnspec


class Count(TorchDispatchMode):
    """Every aten op dispatched while it is entered, by name: on a GPU each is host time."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def fwd_bwd(module: nn.Module, x: torch.Tensor, autocast: torch.dtype | None = None
            ) -> Callable[[], None]:
    """One forward and backward step as an inner layer of a network sees it. The output's
    gradient is a dense tensor in the output's layout, as the next layer gives
    (``y.sum().backward()`` would hand every layer a stride-0 gradient). The input's gradient is
    handed back, as it would be to the layer before, not stored in ``x.grad``: only a leaf input
    keeps its gradient from one step to the next, and doing so changed which layers' backward
    wrote into freshly mapped memory (page faults inside the backward convolution) by more than
    the candidates being compared differ. The parameters' gradients are fresh tensors each step,
    as after ``optimizer.zero_grad()``. ``autocast``: the forward runs under
    ``torch.autocast`` with that dtype, as in mixed-precision training."""
    grad: list[torch.Tensor] = []
    inputs = [x, *(p for p in module.parameters() if p.requires_grad)]

    def run() -> None:
        with precision(x.device, autocast):
            y = module(x)
        if not grad:
            grad.append(torch.ones_like(y))
        torch.autograd.grad(y, inputs, grad[0])
    return run


def precision(device: torch.device, autocast: torch.dtype | None
              ) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``autocast`` on ``device``, or nothing when it is None."""
    return torch.autocast(device.type, autocast) if autocast else contextlib.nullcontext()


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What waits for the device's queued work (nothing on the CPU)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else lambda: None


def interleaved(runs: list[Callable[[], None]], rounds: int,
                sync: Callable[[], None] = lambda: None,
                ran: list[int] | None = None) -> list[list[float]]:
    """Seconds of each run in each round. Every round runs each once, in a fresh shuffled order
    (fixed seed): a run's time depends on what ran just before it (caches, the allocator's free
    lists), and in a fixed order two identical layers side by side read further apart than the
    implementations compared differ, so no run keeps the same predecessor. ``ran``, if given,
    receives the index of each run in the order they ran."""
    order = list(range(len(runs)))
    shuffle = random.Random(0).shuffle
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        shuffle(order)
        for n in order:
            sync()
            start = time.perf_counter()
            runs[n]()
            sync()
            times[n].append(time.perf_counter() - start)
            if ran is not None:
                ran.append(n)
    return times


def kept_for_backward(module: nn.Module, x: torch.Tensor, autocast: torch.dtype | None = None
                      ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """One forward of ``module`` on ``x``: the tensors it saves for backward, one per storage
    (keyed by the storage's address; the input's and the parameters' left out, as a layer's
    activation memory leaves them out), and the output."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    skip.add(x.untyped_storage().data_ptr())
    kept: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            kept.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            precision(x.device, autocast):
        y = module(x)
    return kept, y


def activation_bytes(module: nn.Module, x: torch.Tensor, autocast: torch.dtype | None = None
                     ) -> int:
    """Bytes saved for backward (each storage once) plus the output's."""
    kept, y = kept_for_backward(module, x, autocast)
    kept[y.untyped_storage().data_ptr()] = y
    return sum(t.untyped_storage().nbytes() for t in kept.values())


def channels_last_parameters(module: nn.Module) -> None:
    """Every 4-D parameter of ``module`` channels-last, as ``module.to(memory_format=...)``
    would convert them; that call raises on the 5-D cores some formats have."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 4:
                p.data = p.data.contiguous(memory_format=torch.channels_last)


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """No TF32 in CUDA convolutions and matmuls (their defaults differ) for exact comparisons."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul


def machine(device: torch.device = torch.device("cpu")) -> str:
    import opt_einsum
    from tnspec.planning.calibration import _cpu_name
    gpu = ""
    if device.type == "cuda":
        gpu = (f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}, cuDNN "
               f"{torch.backends.cudnn.version()}; TF32: cuDNN "
               f"{torch.backends.cudnn.allow_tf32}, matmul "
               f"{torch.backends.cuda.matmul.allow_tf32}); ")
    return (f"{platform.platform()}; {gpu}{_cpu_name()}; "
            f"{torch.get_num_threads()} threads; python {platform.python_version()}, torch "
            f"{torch.__version__}, opt_einsum {opt_einsum.__version__}, tnspec "
            f"{tnspec.__version__}")


def steady_malloc(keep: bool = True, trim: int = -1) -> str:
    """Have glibc's malloc keep freed memory for reuse (no block of its own mapped per large
    tensor, no memory handed back to the system), as jemalloc or tcmalloc do, and describe the
    allocator for the table's header. With glibc's defaults a large tensor is sometimes mapped
    afresh and its pages faulted in while an op writes it, depending on what ran before: the
    same module then times differently by its place in the interleaved loop, by more than the
    implementations compared differ (``--system-malloc`` shows it). ``trim``: glibc's
    M_TRIM_THRESHOLD, -1 for never (``benchmarks/allocator.py`` compares the settings)."""
    if not keep:
        return "Allocator: glibc malloc defaults (--system-malloc)"
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4  # from glibc's malloc.h
        # -1: never trim (mallopt(3)). A threshold of 2^31-1 let the heap be cut back after
        # a module with 2+ GB of activations (left-to-right TR at batch 128), and the next
        # modules faulted their pages in again: 1.2-1.6x on identical code in one run
        if libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, trim):
            return ("Allocator: glibc malloc keeping freed memory (mallopt M_MMAP_MAX=0, "
                    f"M_TRIM_THRESHOLD={trim}; --system-malloc for the defaults)")
    except OSError:
        pass
    return "Allocator: the system's (not glibc: left as it is)"
