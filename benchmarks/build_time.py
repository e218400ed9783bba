"""How long building a layer inline takes, after import (issue: < 50 ms for the Odd-like net).

    python benchmarks/build_time.py

Building parses, checks and initializes; the contraction order is planned on the first call for
each input shape, so that is timed separately. Median of repetitions, machine printed beside.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import tnspec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
REPEAT = 21


def median_ms(fn) -> float:
    times = []
    for _ in range(REPEAT):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    print(f"python {platform.python_version()}, torch {torch.__version__}, tnspec "
          f"{tnspec.__version__}, {platform.machine()} {platform.processor() or ''}".strip())
    print(f"{'example':<22}{'build ms':>10}{'first plan ms':>15}")
    for name in ("odd", "tr_conv", "htk2", "tensorized_linear"):
        text = (EXAMPLES / f"{name}.tn").read_text()
        layer_name = tnspec.compile_all(text)[0].name
        build = median_ms(lambda: tnspec.layer(text, name=layer_name))
        layer = tnspec.layer(text, name=layer_name)
        shape = [32] + [layer.network.sizes.get(a[0], 32) if len(a) == 1 else
                        int(torch.tensor([layer.network.sizes[i] for i in a]).prod())
                        for a in layer.network.input.axes[1:]]
        plan = median_ms(lambda: layer.plan(shape))
        print(f"{name:<22}{build:>10.1f}{plan:>15.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
