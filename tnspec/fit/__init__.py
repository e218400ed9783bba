"""Stage 3, fitting: cores set from a dense weight or from a layer's outputs.

``decompose`` (a network's dense weight, and fitting its cores to one), ``als`` (the alternating
least squares sweeps and basin hops behind it) and ``moments`` (the second moments of a layer's
inputs, which turn a weight fit into an output fit).
"""
