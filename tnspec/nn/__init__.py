"""Stage 6, the modules users hold: :class:`Layer` and what builds it.

``module`` (:class:`Layer`, a network as an ``nn.Module`` running generated code),
``fitting`` (a layer's dense weight and ``fit_``), ``autotune`` and ``layout`` (timing candidate
orders and the model's memory format), ``api`` (``compile``, ``layer``, ``contract``, ...),
``formats``, ``topologies`` and ``axes`` (named formats as spec text), ``embedding``
(tensorized ``nn.Embedding``) and ``audit`` (variance ratios of any model).
"""
