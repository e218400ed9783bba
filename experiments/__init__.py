"""Experiments, one command each from the repository root: ``paper/`` reruns the paper's
experiments with tnspec layers at laptop scale (scikit-learn digits, Gaussian data,
Fashion-MNIST); ``models/`` runs tnspec's workflows on trained models (a digits CNN trained here,
all-MiniLM-L6-v2 on Rotten Tomatoes, ImageNet's MobileNetV2 on Fashion-MNIST). ``common`` and
``assets`` serve both: training loops and tables; the real checkpoints and data sets, checked.

Run one with ``python -m experiments.paper.NAME`` or ``python -m experiments.models.NAME``;
``--smoke`` runs a tiny version (the test suite does). experiments/README.md has the tables and
their reading.
"""
