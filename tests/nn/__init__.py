"""Tests of the modules: layers against the dense reference, formats, embeddings, audit, and
layers where users put them (compile, export, DDP)."""
