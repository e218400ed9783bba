"""tnspec's workflows on trained models: a digits CNN decomposed (``decompose``), compressed
(``compress``) and adapted (``adapters``, ``adapter_dynamics``, ``adapter_rates``), and the real
checkpoints all-MiniLM-L6-v2 (``minilm_compress``, ``minilm_embedding``, ``minilm_adapters``) and
ImageNet's MobileNetV2 (``mobilenet``, ``mobilenet_fashion``) on real data."""
