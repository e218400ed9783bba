"""tnspec: compile einsum-like tensor-network strings into initialized PyTorch layers.

    >>> import tnspec
    >>> net = tnspec.compile("x[b, c, h+kh-1], W[o, c, kh] -> y[b, o, h]", c=4, o=8, kh=3)
    >>> net.summary()
    '1 core, 96 parameters (dense 96, 1.0x fewer), 1-D conv'

Stages, one module each: parse (text -> AST), check (AST -> ir.Network), ir (the data model),
init (how cores are drawn), plan (contraction order), lower (statements, and their
interpreter), codegen (Python source), api (entry points) and cli (the ``tnspec`` command);
around them: formats (named formats as spec text), convert (``tensorize`` an existing model)
and draw (the hypergraph as Graphviz DOT).
"""

__version__ = "0.1.0"  # first: codegen stamps it into generated modules

from . import formats
from .api import Layer, compile, compile_all, layer
from .errors import SpecError
from .ir import Conv, Index, Network, Options, Role, Tensor
from .convert import tensorize


__all__ = [
    "Conv", "Index", "Layer", "Network", "Options", "Role", "SpecError", "Tensor",
    "__version__", "compile", "compile_all", "formats", "layer",
    "tensorize",
]
