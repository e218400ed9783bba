"""Stage 5, emission: plan -> typed program -> Python source -> the live class.

``lower`` and ``products`` (a plan as a :class:`tnspec.program.Program`), ``codegen``,
``statements`` and ``lines`` (the program as the source of a standalone module that imports only
torch), ``safe`` (names and values checked before they are printed), ``runtime`` (the one
executor: it runs the very source ``tnspec compile`` writes) and ``draw`` (the hypergraph as
Graphviz DOT).
"""
