"""Stage 7, workflows: what users do to models they already have.

``tensorize`` (replace a model's layers by tensor networks), ``merge`` (and back to dense
layers), ``compress`` (a parameter budget spread by measured sensitivity), ``observe`` and
``activations`` (what a model feeds its layers), ``adapters`` and ``adapter_state`` (frozen base
plus a tensor-network delta: build, switch, save, load, merge), ``hotswap`` (another adapter's
values into a compiled model), ``lora_export`` (any adapter as a plain LoRA) and
``peft_bridge`` (the same adapters through Hugging Face PEFT).
"""
