"""Tests of the workflows on existing models: tensorize, compress, adapters."""
