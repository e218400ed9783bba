"""The paper's experiments at laptop scale (scikit-learn digits and Gaussian data).

Run one with ``python -m experiments.NAME`` from the repository root; ``--smoke`` runs a tiny
version (the test suite does). See experiments/README.md for the tables and their reading.
"""
