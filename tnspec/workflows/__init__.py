"""Stage 7, workflows: what users do to models they already have.

``tensorize`` (replace a model's layers by tensor networks), ``merge`` (and back to dense
layers), ``compress`` (a parameter budget spread by measured sensitivity), ``observe`` and
``activations`` (what a model feeds its layers), ``adapters`` and ``adapter_state`` (frozen base
plus a tensor-network delta: build, switch, save, load, merge) and ``peft_bridge`` (the same
adapters through Hugging Face PEFT).
"""
