"""Conversion: a model's dense layers replaced by tnspec layers (``tensorize``, ``compress``)
and back (``merge``), with what the model feeds them (``observe``, ``activations``)."""
