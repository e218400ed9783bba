"""Tests of the analysis stage: Graph-in/out initialization and the reproducing transformation."""
