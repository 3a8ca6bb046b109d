"""Post-training quantization (docs/quantization.md): an mmtrain checkpoint -> a Hugging Face folder in the
``compressed-tensors`` format (FP8 weights per channel with dynamic per-token FP8 activations, or INT4 weights in
groups of 128: round-to-nearest or GPTQ-calibrated), which transformers and vLLM load and ``mmtrain.generate`` /
``mmtrain.serve`` run with their own quantized linears.

``python -m mmtrain.quantize --ckpt CKPT --scheme fp8|w4a16 [--method rtn|gptq --calib PREFIX] --out DIR``.
Public (loaded lazily): ``quantize_checkpoint``, ``QuantizeSettings``.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {"quantize_checkpoint": "mmtrain.quantize.run", "QuantizeSettings": "mmtrain.quantize.run"}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
