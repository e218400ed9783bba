"""The planner's cost model: predicted seconds of one contraction step, forward and backward.

Plain data with two pricing functions; ``benchmarks/calibrate.py`` fits its constants.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of one step, forward and backward (about three times the forward
    work): multiply-adds at a rate that depends on the kind of step, plus memory traffic,
    plus a fixed overhead. A convolution runs below peak when it has few channels per group,
    ``(cin / (cin + c0)) * (cout / (cout + c0))``, and grouped ones more slowly still.

    The defaults were fitted (``benchmarks/calibrate.py``) to 95 timed steps, float32 on 2 CPU
    threads: median error x1.4. ``scale`` adjusts for the element size (float64: 2).
    """

    conv_rate: float = 1.57e11  # multiply-adds per second at full efficiency
    einsum_rate: float = 9.17e10
    channels: float = 9.14  # c0
    bandwidth: float = 2.63e9  # elements per second
    overhead: float = 1.27e-4  # seconds per step
    grouped: float = 1.22  # slowdown of grouped (not depthwise) convolutions
    scale: float = 1.0

    def conv(self, batch: int, groups: int, cin: int, cout: int, positions: int, kernel: int,
             traffic: int) -> float:
        macs = batch * groups * cin * cout * positions * kernel
        eff = (cin / (cin + self.channels)) * (cout / (cout + self.channels))
        if groups > 1 and max(cin, cout) > 1:
            eff /= self.grouped
        return self.scale * (3 * macs / (self.conv_rate * eff) + 3 * traffic / self.bandwidth) \
            + self.overhead

    def einsum(self, macs: int, traffic: int) -> float:
        return self.scale * (3 * macs / self.einsum_rate + 3 * traffic / self.bandwidth) + \
            self.overhead
