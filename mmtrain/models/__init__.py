"""Model families, one folder each: the single-device model, its HF adapter, its sharding spec, its shapes.

A run picks one by ``model.family``, a name of the family table (``families.py``: name -> package); each family's
``config.py`` is its config section (``model.<family>``), its ``family.py`` its registry record, which ``registry``
(``mmtrain.models.registry.model_family``) loads and checks: all the trainer knows of a family
(docs/model-families.md). ``vlm.py``: the VLM (encoders, projector, a family's language model). ``llama`` is
the Llama-family GPT (also ``mmtrain.model.GPTModel``), ``deepseek_v3`` the MLA + sigmoid-MoE family.
"""
