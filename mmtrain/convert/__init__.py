"""Checkpoint conversion: Hugging Face Llama / Qwen2 / Mixtral folders <-> mmtrain checkpoints at any TP/PP.

``python -m mmtrain.convert hf-to-mmtrain --hf DIR --out CKPT_DIR [--tp N] [--pp N]`` and
``python -m mmtrain.convert mmtrain-to-hf --ckpt CKPT_DIR --out DIR`` (see docs/convert-hf.md).
"""

from mmtrain.convert.checkpoint_io import ConvertError
from mmtrain.convert.convert import hf_to_mmtrain, mmtrain_to_hf

__all__ = ["ConvertError", "hf_to_mmtrain", "mmtrain_to_hf"]
