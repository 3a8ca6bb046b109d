"""Checkpoint conversion: Hugging Face Llama / Qwen2 / Mixtral / DeepSeek-V3 and LLaVA / CLIP / SigLIP / Whisper
folders <-> mmtrain checkpoints at any TP/PP, and a check of a conversion.

``python -m mmtrain.convert hf-to-mmtrain --hf DIR --out CKPT_DIR [--tp N] [--pp N]``,
``python -m mmtrain.convert mmtrain-to-hf --ckpt CKPT_DIR --out DIR`` and
``python -m mmtrain.convert compare --hf DIR --ckpt CKPT_DIR`` (see docs/convert-hf.md).
"""

from mmtrain.convert.checkpoint_io import ConvertError
from mmtrain.convert.convert import hf_to_mmtrain, mmtrain_to_hf

__all__ = ["ConvertError", "hf_to_mmtrain", "mmtrain_to_hf"]
