"""Tests of emission: lowering, the generated source, and the one executor."""
