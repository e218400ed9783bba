"""Tests of planning: contraction orders, the cost model and its calibration."""
