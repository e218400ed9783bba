"""tnspec: compile einsum-like tensor-network strings into initialized PyTorch layers.

    >>> import tnspec
    >>> net = tnspec.compile("x[b, c, h+kh-1], W[o, c, kh] -> y[b, o, h]", c=4, o=8, kh=3)
    >>> net.summary()
    '1 core, 96 parameters (dense 96, 1.0x fewer), 1-D conv'

Stages, one module each, importing only the stages above them: parse (text -> AST), check (AST
-> ir.Network, with settings), ir (the data model), shapes (sizes and shape binding), backward
(the reproducing transformation), analysis (backbone graphs), init (how cores are drawn),
calibration (the cost model's constants and op choices, measured on the device that runs the
layer), plan (contraction order, each step's op and axis split; lookup plans and lowers an index
input), lower (typed program), codegen
(Python source; ``lines`` breaks its lines), runtime (executes generated source: the one
executor), report (``explain``), api (entry points) and cli (the ``tnspec`` command); around
them: formats (named formats as spec text), decompose (a layer's dense weight, and fitting any
network's cores to one), embedding (tensorized ``nn.Embedding``/``EmbeddingBag``), convert
(``tensorize`` an existing model), dense (``merge`` back), audit
(variance ratios of any model, layer by layer), draw (the hypergraph as Graphviz DOT), and
above ``Layer`` the adapters (``adapt``, ``merge_adapters``, ``adapter_state_dict``, ...;
``register_peft`` for Hugging Face PEFT).
"""

from . import formats
from .adapter_state import (adapter_state_dict, disable_adapters, load_adapters,
                            merge_adapters, set_adapter)
from .adapters import Adapted, AdaptReport, adapt
from ._version import __version__
from .analysis import Backbone, backbone
from .api import compile, compile_all, contract, generate, layer
from .audit import Audit, audit
from .backward import backward
from .calibration import Calibration, calibrate
from .compress import CompressReport, compress
from .convert import tensorize
from .dense import merge
from .embedding import EmbeddingBag, embedding, embedding_bag
from .errors import SpecError
from .ir import Conv, Index, Network, Options, Role, Tensor
from .module import Layer
from .peft_bridge import register_peft
from .plan import Plan
from .report import explain


__all__ = [
    "AdaptReport", "Adapted", "Audit", "Backbone", "Calibration", "CompressReport", "Conv",
    "EmbeddingBag", "Index", "Layer", "Network", "Options", "Plan", "Role", "SpecError", "Tensor",
    "__version__", "adapt", "adapter_state_dict", "audit", "backbone", "backward", "calibrate",
    "compile", "compile_all", "compress", "contract", "disable_adapters", "embedding",
    "embedding_bag", "explain", "formats", "generate", "layer", "load_adapters", "merge",
    "merge_adapters", "register_peft", "set_adapter", "tensorize",
]
