"""Tests of fitting: cores fitted to a dense weight or to a layer's outputs."""
