"""Adapters: trainable tensor networks of any format beside a frozen model's dense layers
(``adapt``, built by ``layers``), switched, saved, loaded and merged (``state``), swapped into
a compiled model (``hotswap``), bounded (``step_rule``), exported as LoRA (``lora_export``) and
run inside Hugging Face PEFT (``peft_bridge``)."""
