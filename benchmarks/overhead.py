"""Overheads of the one-executor design, as same-process ratios (no absolute claim):

- a tiny layer's call, inline (``tnspec.layer``) against its generated module (``tnspec
  compile``): the same code, so the ratio is what the inline dispatch costs;
- ``import tnspec`` against ``import torch`` alone, each in fresh interpreters.

Interleaved repetitions, medians; machine, CPU and versions printed beside the figures.
Run: ``python benchmarks/overhead.py``.
"""

from __future__ import annotations

import importlib.util
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import tnspec

SPEC = "x[b, c], W[c, o] -> y[b, o]"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def call_ratio(rounds: int = 41, calls: int = 2000) -> tuple[float, float, float]:
    torch.manual_seed(0)
    inline = tnspec.layer(SPEC, c=4, o=4)
    x = torch.randn(2, 4)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny.py"
        path.write_text(tnspec.generate(SPEC, shape={"b": 2}, c=4, o=4))
        spec = importlib.util.spec_from_file_location("tiny", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    generated = module.TensorNetworkLayer()
    generated.load_state_dict(inline.state_dict())
    times: dict[str, list[float]] = {"inline": [], "generated": []}
    with torch.no_grad():
        for m in (inline, generated):
            m(x)
        for _ in range(rounds):
            for name, m in (("inline", inline), ("generated", generated)):
                start = time.perf_counter()
                for _ in range(calls):
                    m(x)
                times[name].append((time.perf_counter() - start) / calls)
    a, b = statistics.median(times["inline"]), statistics.median(times["generated"])
    return a / b, a * 1e6, b * 1e6


def import_ratio(rounds: int = 15) -> tuple[float, float, float]:
    def once(code: str) -> float:
        out = subprocess.run([sys.executable, "-c", "import time; t = time.perf_counter(); "
                              f"{code}; print(time.perf_counter() - t)"],
                             capture_output=True, text=True, check=True)
        return float(out.stdout)
    torch_t, tnspec_t = [], []
    for _ in range(rounds):
        torch_t.append(once("import torch"))
        tnspec_t.append(once("import torch, tnspec"))
    a, b = statistics.median(tnspec_t), statistics.median(torch_t)
    return a / b, a, b


def main() -> None:
    print(f"machine: {platform.machine()}, {cpu_model()}, {torch.get_num_threads()} threads; "
          f"Python {platform.python_version()}, torch {torch.__version__}, "
          f"tnspec {tnspec.__version__}")
    ratio, a, b = call_ratio()
    print(f"tiny layer call ({SPEC}, batch 2, no_grad): inline {a:.1f} us, generated "
          f"{b:.1f} us: {ratio:.3f}x")
    ratio, a, b = import_ratio()
    print(f"import tnspec (with torch) {a:.2f} s vs import torch {b:.2f} s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
