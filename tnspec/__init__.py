"""tnspec: compile einsum-like tensor-network strings into initialized PyTorch layers.

    >>> import tnspec
    >>> net = tnspec.compile("x[b, c, h+kh-1], W[o, c, kh] -> y[b, o, h]", c=4, o=8, kh=3)
    >>> net.summary()
    '1 core, 96 parameters (dense 96, 1.0x fewer), 1-D conv'

The package is grouped by stage, each subpackage importing only the ones before it (see
docs/architecture.md): ``language`` (spec text -> checked ``ir.Network``), ``analysis`` (the
paper: backbone graphs, Graph-in/out, the reproducing transformation), ``fit`` (cores fitted to a
weight or to a layer's outputs), ``planning`` (contraction order and the measured cost model),
``emit`` (plan -> program -> Python source -> the live class), ``nn`` (``Layer``, named formats,
embeddings, audit) and ``workflows`` (tensorize, merge, compress, adapters). At the top level sit
the plain data passed between stages (``ir``, ``program``, ``shapes``), the one error class
(``errors``), ``progress`` and the command line (``cli``).
"""

from ._version import __version__
from .errors import SpecError
from .ir import Conv, Index, Network, Options, Role, Tensor
from .analysis.backbone import Backbone, backbone
from .analysis.backward import backward
from .planning.calibration import Calibration, calibrate
from .planning.plan import Plan
from .planning.report import explain
from .nn import formats
from .nn.api import compile, compile_all, contract, generate, layer
from .nn.audit import Audit, audit
from .nn.embedding import EmbeddingBag, TiedHead, embedding, embedding_bag
from .nn.module import Layer
from .workflows.adapted import Adapted, Saved, set_adapter
from .workflows.padded import Padded
from .workflows.adapters.state import (adapter_config, adapter_state_dict, disable_adapters,
                                       load_adapters, merge_adapters)
from .workflows.adapters.adapt import AdaptReport, adapt
from .workflows.convert.compress import CompressReport, compress
from .workflows.adapters.hotswap import hotswap
from .workflows.adapters.lora_export import LoraExport, export_lora
from .workflows.convert.merge import merge
from .workflows.adapters.peft_bridge import register_peft
from .workflows.convert.tensorize import tensorize


__all__ = [
    "__version__", "Adapted", "AdaptReport", "Audit", "Backbone", "Calibration",
    "CompressReport", "Conv", "EmbeddingBag", "Index", "Layer", "LoraExport", "Network",
    "Options", "Padded", "Plan", "Role", "Saved", "SpecError", "Tensor", "TiedHead", "adapt",
    "adapter_config", "adapter_state_dict", "audit", "backbone", "backward", "calibrate",
    "compile", "compile_all", "compress", "contract", "disable_adapters", "embedding",
    "embedding_bag", "explain", "export_lora", "formats", "generate", "hotswap", "layer",
    "load_adapters",
    "merge", "merge_adapters", "register_peft", "set_adapter", "tensorize",
]
