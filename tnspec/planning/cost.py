"""The planner's cost model: predicted seconds of one contraction step, forward and backward.

Plain data with two pricing functions, and the description of a step whose implementation is
chosen by measurement rather than by the model. :mod:`tnspec.planning.calibration` fits the
constants to steps timed on the device that runs the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of one step, forward and backward (about three times the forward
    work): multiply-adds at a rate that depends on the kind of step, plus memory traffic,
    plus a fixed overhead. A convolution runs below peak when it has few channels per group,
    ``(cin / (cin + c0)) * (cout / (cout + c0))``, and grouped ones more slowly still. An
    einsum moves its data at its own rate (it permutes operands into copies for a batched
    matrix product; a convolution reads them in place).

    The defaults are the fallback when calibration is off (``TNSPEC_CALIBRATE=0``): constants
    measured once, float32 on 2 CPU threads. ``scale`` adjusts them for the element size
    (float64: 2); a calibrated model is measured in its own dtype and keeps ``scale`` 1.
    """

    conv_rate: float = 1.57e11  # multiply-adds per second at full efficiency
    einsum_rate: float = 9.17e10
    channels: float = 9.14  # c0
    bandwidth: float = 2.63e9  # elements per second
    overhead: float = 1.27e-4  # seconds per step
    grouped: float = 1.22  # slowdown of grouped (not depthwise) convolutions
    scale: float = 1.0
    einsum_bandwidth: float = 2.63e9  # elements per second through an einsum

    def conv(self, batch: int, groups: int, cin: int, cout: int, positions: int, kernel: int,
             traffic: int) -> float:
        # also called with numpy arrays of sizes, pricing many candidate steps at once
        macs = batch * groups * cin * cout * positions * kernel
        eff = (cin / (cin + self.channels)) * (cout / (cout + self.channels))
        eff = eff / np.where((groups > 1) & (np.maximum(cin, cout) > 1), self.grouped, 1.0)
        return self.scale * (3 * macs / (self.conv_rate * eff) + 3 * traffic / self.bandwidth) \
            + self.overhead

    def einsum(self, macs: int, traffic: int) -> float:
        return self.scale * (3 * macs / self.einsum_rate + 3 * traffic / self.einsum_bandwidth) \
            + self.overhead


@dataclass(frozen=True)
class Mixing:
    """A data-side channel-mixing step (no relation resolved) that either a grouped 1x1
    convolution or an einsum can run: its sizes, as a chooser sees them."""

    batch: int
    groups: int
    inputs: int
    outputs: int
    spatial: tuple[int, ...]


#: picks "conv1x1" or "einsum" for a channel-mixing step, e.g. by timing both on the device
Chooser = Callable[[Mixing], str]
