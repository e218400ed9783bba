"""Stage 4, planning: in which order, and with which op, a bound network is contracted.

``problem`` (the contraction problem opt_einsum solves), ``paths`` (the planner registry),
``plan`` (a :class:`Plan`: each step's operands, op and axis split), ``lookup`` (an index input:
an embedding's rows), ``cost`` and ``measure`` (the cost model and the timings behind it),
``calibration``, ``cache`` and ``choices`` (the model's constants measured on the device, kept
between processes) and ``report`` (``tnspec.explain``).
"""
