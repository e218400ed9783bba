"""Stage 7, workflows: what users do to models they already have, in two families.

``convert/`` changes what a model's layers are: ``tensorize`` (dense layers replaced by tensor
networks, fresh or fitted), ``merge`` (back to dense layers), ``compress`` (a parameter budget
spread by measured sensitivity), with ``observe`` and ``activations`` (what a model feeds its
layers). ``adapters/`` adds trainable tensor-network deltas beside a frozen model: ``adapt``,
their ``layers`` and inits, ``state`` (switch, save, load, merge), the ``step_rule``,
``hotswap``, ``lora_export`` and ``peft_bridge``.

What both families must know sits here, below them, and imports neither: which modules are
dense layers (``dense_layers``), the ``Adapted`` module that conversion leaves alone and
adapters build (``adapted``), the tnspec layers that stand in for dense ones (``stand_ins``),
the model's module tree (``model_tree``: selectors, replacing a submodule, who holds a
parameter) and the layers every workflow leaves as they are (``left_alone``).
"""
