"""Model families, one folder each: the single-device model, its HF adapter, its sharding spec, its shapes.

A run picks one by ``model.family``; ``registry`` (``mmtrain.models.registry.model_family``) maps the name to
the family's stage builder, FLOPs and MoE flag, which is all the trainer knows of a family
(docs/model-families.md). ``llama`` is the Llama-family GPT (also ``mmtrain.model.GPTModel``), ``deepseek_v3``
the MLA + sigmoid-MoE family.
"""
