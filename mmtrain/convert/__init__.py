"""Checkpoint conversion: Hugging Face Llama / Qwen2 / Mixtral / DeepSeek-V3 and LLaVA / CLIP / SigLIP / Whisper
folders <-> mmtrain checkpoints at any TP/PP, and a check of a conversion.

``python -m mmtrain.convert hf-to-mmtrain --hf DIR --out CKPT_DIR [--tp N] [--pp N]``,
``python -m mmtrain.convert mmtrain-to-hf --ckpt CKPT_DIR --out DIR`` and
``python -m mmtrain.convert compare --hf DIR --ckpt CKPT_DIR`` (see docs/convert-hf.md).

Public names load lazily: ``python -m mmtrain.convert --help`` answers without importing torch.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {"ConvertError": "mmtrain.convert.checkpoint_io", "hf_to_mmtrain": "mmtrain.convert.convert",
           "mmtrain_to_hf": "mmtrain.convert.convert"}
__all__ = ["ConvertError", "hf_to_mmtrain", "mmtrain_to_hf"]
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
