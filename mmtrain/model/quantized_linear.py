"""A linear layer with quantized weights, swapped into a decoded model in place of a family's ``nn.Linear`` (the
loader of a quantized folder does it: ``mmtrain.inference.quantized_loading``); the family's code calls it as it
calls the linear. Two schemes, as ``compressed-tensors`` defines them (``mmtrain.convert.compressed_tensors_format``):

- ``fp8``: weights FP8 E4M3 (out, in) with one scale per output row; each call quantizes its input to FP8 with one
  scale per token (``amax / 448``, computed on the fly). On a CUDA device with bf16 inputs: up to
  ``fp8_gemv.MAX_ROWS`` tokens (decode) one Triton kernel quantizes and multiplies (``mmtrain.model.fp8_gemv``: the
  same quantized values, fp32 sums, bias added before the one rounding to bf16); more tokens (prefill) go through
  ``torch._scaled_mm`` with row-wise scales (token scales x channel scales, bf16 out). Elsewhere the same numbers
  are dequantized and multiplied (``x_fp8 * s_x @ (w_fp8 * s_w)^T``), which is also what transformers' dense load
  of the folder computes.
- ``w4a16``: weights 4-bit integers in [-8, 7], one scale per group of ``group_size`` inputs of a row (no zero
  point), activations as they are. On a CUDA device with bf16 inputs: torch's built-in int4 kernel (tinygemm,
  ``aten._weight_int4pack_mm``: groups of 32-256, ``in`` a multiple of 128 for 8 inner k-tiles, ``out`` of 8; its
  dequantization is ``(q_u - 8) * scale + zero`` on unsigned nibbles, so ``q_u = q + 8`` and ``zero = 0`` give the
  symmetric values exactly). Elsewhere the weights are dequantized per call (``q * scale``) and multiplied.

``weight`` is a buffer of (out, ...) rows in every layout (FP8 values; int4 nibbles packed eight to an int32 as
compressed-tensors packs them, or tinygemm's tiles viewed as rows), so code that reads a linear's local output
width off ``weight.shape[0]`` reads it here too. The buffers are not parameters: casting a model's parameters to
the compute dtype leaves them as they are."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
_TINYGEMM_K_TILES = 8  # inner k-tiles of tinygemm's layout: ``in`` must be a multiple of 8 * 16


def pack_int4_rows(values: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], (out, in) -> int32 (out, in / 8): value ``j`` of a word in bits 4j..4j+3, offset by
    8 (compressed-tensors' ``pack-quantized`` layout)."""
    nibbles = (values.to(torch.int64) + 8).view(values.shape[0], -1, 8)
    words = (nibbles << torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # the bits as a signed int32


def unpack_int4_rows(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The inverse of ``pack_int4_rows``: int32 (out, in / 8) -> int8 (out, in) in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.reshape(packed.shape[0], -1)[:, :in_features] - 8).to(torch.int8)


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held quantized (module docstring). Build it with ``from_values``."""

    def __init__(self, scheme: str, in_features: int, out_features: int, group_size: int,
                 weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if scheme not in ("fp8", "w4a16"):
            raise ValueError(f"quantized linear scheme {scheme!r}: not fp8 or w4a16")
        self.scheme, self.in_features, self.out_features = scheme, in_features, out_features
        self.group_size = group_size
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.tinygemm = False  # w4a16: ``weight`` holds tinygemm's tiles (``use_cuda_kernel``)
        self.register_buffer("scales_and_zeros", None)

    @classmethod
    def from_values(cls, scheme: str, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                    group_size: int = 0) -> QuantizedLinear:
        """From quantized ``values`` (out, in): float8 E4M3 with ``scale`` (out, 1), or int8 in [-8, 7] with
        ``scale`` (out, in / group_size)."""
        out_features, in_features = values.shape
        if scheme == "w4a16":
            if in_features % group_size or in_features % 8 or scale.shape != (out_features, in_features // group_size):
                raise ValueError(f"int4 weight {tuple(values.shape)} with scales {tuple(scale.shape)}: not groups "
                                 f"of {group_size} (in a multiple of 8)")
            weight = pack_int4_rows(values)
        else:
            if values.dtype != FP8 or scale.shape != (out_features, 1):
                raise ValueError(f"FP8 weight {values.dtype} {tuple(values.shape)} with scales {tuple(scale.shape)}: "
                                 "not float8_e4m3fn (out, in) with (out, 1) scales")
            weight = values
        return cls(scheme, in_features, out_features, group_size, weight, scale, bias)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.scheme == "w4a16" else ""
        return (f"{self.scheme}, in_features={self.in_features}, out_features={self.out_features}{group}, "
                f"bias={self.bias is not None}")

    # ------------------------------------------------------------------------------------------ weights
    def values(self) -> torch.Tensor:
        """The quantized values (out, in): float8, or int8 in [-8, 7]."""
        if self.scheme == "fp8":
            return self.weight
        if self.tinygemm:
            raise RuntimeError("the int4 weights are in tinygemm's layout; dequantize on the CUDA kernel's inputs")
        return unpack_int4_rows(self.weight, self.in_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``W`` = values x scales, computed in the scales' dtype (as compressed-tensors dequantizes), in ``dtype``."""
        values, scale = self.values(), self.weight_scale
        if self.scheme == "fp8":
            return (values.to(scale.dtype) * scale).to(dtype)
        grouped = values.to(scale.dtype).unflatten(-1, (scale.shape[-1], -1)) * scale.unsqueeze(-1)
        return grouped.flatten(-2).to(dtype)

    def use_cuda_kernel(self) -> bool:
        """Once on a CUDA device: int4 weights repacked into tinygemm's layout where it takes this shape (True
        when done; False: the dequantizing path stays). FP8 needs no repacking (``_scaled_mm`` reads ``W^T`` as
        the column-major view of the row-major weight)."""
        if (self.scheme != "w4a16" or self.tinygemm or not self.weight.is_cuda
                or self.in_features % (_TINYGEMM_K_TILES * 16) or self.out_features % 8
                or self.group_size not in (32, 64, 128, 256)):
            return False
        unsigned = (self.values().to(torch.int32) + 8).to(torch.uint8)
        pairs = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).contiguous()  # two nibbles a byte, the even one high
        tiles = torch.ops.aten._convert_weight_to_int4pack(pairs, _TINYGEMM_K_TILES)
        scale = self.weight_scale.to(torch.bfloat16)
        self.scales_and_zeros = torch.stack([scale, torch.zeros_like(scale)], dim=-1).transpose(0, 1).contiguous()
        self.weight = tiles.view(self.out_features, -1)  # the same words, as rows (see the module docstring)
        self.tinygemm = True
        return True

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        y = self._fp8(x2) if self.scheme == "fp8" else self._int4(x2)
        return y.view(*shape[:-1], self.out_features)

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:
        kernels = x.is_cuda and x.dtype == torch.bfloat16 and self.in_features % 16 == 0 and self.out_features % 16 == 0
        if kernels:
            from mmtrain.model import fp8_gemv  # imports Triton: only on a GPU

            if fp8_gemv.supported(x.shape[0], self.out_features, self.in_features):  # decode's few tokens
                return fp8_gemv.fp8_linear(x, self.weight, self.weight_scale, self.bias)
        x_q, x_scale = quantize_tokens_fp8(x)
        if kernels:
            y = torch._scaled_mm(x_q, self.weight.t(), scale_a=x_scale.float(),
                                 scale_b=self.weight_scale.float().t(), out_dtype=x.dtype)
            return y + self.bias if self.bias is not None else y  # row-wise scaling: bias added apart
        return F.linear(x_q.to(x.dtype) * x_scale, self.dequantized(x.dtype), self.bias)

    def _int4(self, x: torch.Tensor) -> torch.Tensor:
        if self.tinygemm and x.dtype == torch.bfloat16:
            y = torch.ops.aten._weight_int4pack_mm(
                x.contiguous(), self.weight.view(self.out_features // 8, -1, 32, _TINYGEMM_K_TILES // 2),
                self.group_size, self.scales_and_zeros)
            return y + self.bias if self.bias is not None else y
        if self.tinygemm:
            y = self._int4(x.to(torch.bfloat16))
            return y.to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype), self.bias)


def quantize_tokens_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (tokens, features) as FP8 E4M3 values and one scale per token (``amax / 448`` in ``x``'s dtype, a zero
    row's scale the dtype's eps), rounded as compressed-tensors' dynamic per-token activation scheme rounds."""
    scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears a post-training quantization replaces, by module name: every ``nn.Linear`` in the blocks of a
    family's stage (``model.layers``, the family contract). The embedding and the output layer stay dense
    (compressed-tensors' ``ignore: [lm_head]``), as do norms."""
    return {f"layers.{index}.{name}": m for index, block in model.layers.items()
            for name, m in block.named_modules() if isinstance(m, nn.Linear)}
