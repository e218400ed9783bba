"""Stage 2, the analysis of the paper (Pan et al., ICML 2022): what a network's graph says about
its scale.

``backward`` (the reproducing transformation: the backward graph of a network is a network),
``backbone`` (the backbone graphs of the forward and backward pass) and ``init`` (Graph-in /
Graph-out: the standard deviation of each core so that the layer's output, or its input
gradient, keeps the variance of a dense layer).
"""
