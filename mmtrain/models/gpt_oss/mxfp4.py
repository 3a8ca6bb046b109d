"""MXFP4 expert weights (OCP microscaling FP4) as GPT-OSS checkpoints store them, dequantized at import.

A checkpoint holds each expert projection ``P`` (``gate_up_proj``, ``down_proj``) as two uint8 tensors:

- ``P_blocks`` (E, R, G, 16): R output rows, each cut into G blocks of 32 values along the input dimension; a
  byte holds two FP4 (e2m1) values, the low nibble first (value 2j), the high nibble second (value 2j + 1).
  A nibble is a sign bit and a 3-bit magnitude code: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
- ``P_scales`` (E, R, G): one e8m0 scale per block, the power of two ``2^(s - 127)``; 255 is NaN in the format.

The dequantized weight is ``value * 2^(s - 127)`` laid out (E, R, G * 32) and transposed to transformers'
parameter layout (E, G * 32, R) = (E, in, out): ``gate_up_proj`` (E, D, 2F), ``down_proj`` (E, F, D). The
product is formed in fp32 and rounded to the target dtype once (bf16 holds every finite product exactly unless
it falls below bf16's subnormals), as transformers' own conversion does, so the bits agree with
``transformers.integrations.mxfp4.convert_moe_packed_tensors``. The import keeps the result (bf16, the dtype the
rest of the checkpoint is stored in); nothing here quantizes again, so an export writes the bf16 experts.

Bad input is refused before anything is allocated from it (shapes and dtypes), and a scale byte of 255 (NaN) or
a block whose values overflow to infinity is refused naming the tensor.
"""

from __future__ import annotations

import torch

# magnitude codes 0..7 of e2m1; codes 8..15 are the same magnitudes negated
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
VALUES_PER_BLOCK = 32
BYTES_PER_BLOCK = VALUES_PER_BLOCK // 2
NAN_SCALE = 255


class Mxfp4Error(ValueError):
    """MXFP4 blocks or scales that cannot be dequantized; the message names the tensor and what is wrong."""


def fp4_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 e2m1 values by nibble (fp32): sign bit 3, magnitude code bits 0-2."""
    magnitudes = torch.tensor(_E2M1, dtype=torch.float32, device=device)
    return torch.cat((magnitudes, -magnitudes))


def check_blocks(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise ``Mxfp4Error`` (naming ``name``, the projection) unless ``blocks`` is uint8 (..., G, 16) and
    ``scales`` uint8 of its leading shape (..., G). Reads only shapes and dtypes."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise Mxfp4Error(f"{name}_blocks / {name}_scales: dtypes {blocks.dtype} / {scales.dtype}; MXFP4 stores "
                         "both as uint8")
    if blocks.ndim < 2 or blocks.shape[-1] != BYTES_PER_BLOCK:
        raise Mxfp4Error(f"{name}_blocks has shape {tuple(blocks.shape)}; expected (..., blocks, "
                         f"{BYTES_PER_BLOCK}): {BYTES_PER_BLOCK} bytes hold one block of {VALUES_PER_BLOCK} values")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise Mxfp4Error(f"{name}_scales has shape {tuple(scales.shape)}; {name}_blocks "
                         f"{tuple(blocks.shape)} needs one scale per block: {tuple(blocks.shape[:-1])}")


def dequantize(name: str, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               rows_per_chunk: int = 1 << 14) -> torch.Tensor:
    """The dense expert tensor (E, in, out) in ``dtype`` of ``name``'s ``blocks`` (E, out, G, 16) and ``scales``
    (E, out, G) (see the module docstring). Works through ``rows_per_chunk`` output rows at a time, so the
    temporaries stay small next to the (E, in, out) result."""
    check_blocks(name, blocks, scales)
    if blocks.ndim != 4:
        raise Mxfp4Error(f"{name}_blocks has shape {tuple(blocks.shape)}; expected (experts, rows, blocks, "
                         f"{BYTES_PER_BLOCK})")
    experts, rows, groups, _ = blocks.shape
    if bool((scales == NAN_SCALE).any()):
        raise Mxfp4Error(f"{name}_scales holds the NaN scale byte {NAN_SCALE}; the checkpoint is damaged")
    table = fp4_table(blocks.device)
    flat_blocks = blocks.reshape(experts * rows, groups * BYTES_PER_BLOCK)
    flat_scales = scales.reshape(experts * rows, groups)
    out = torch.empty(experts * rows, groups * VALUES_PER_BLOCK, dtype=dtype, device=blocks.device)
    for start in range(0, experts * rows, rows_per_chunk):
        packed = flat_blocks[start:start + rows_per_chunk]
        values = torch.stack((table[(packed & 0x0F).long()], table[(packed >> 4).long()]), dim=-1)  # low first
        exponent = flat_scales[start:start + rows_per_chunk].to(torch.int32) - 127
        powers = torch.pow(2.0, exponent.float()).repeat_interleave(VALUES_PER_BLOCK, dim=-1)
        chunk = values.flatten(-2) * powers  # fp32 product, rounded once below
        if not bool(torch.isfinite(chunk).all()):
            raise Mxfp4Error(f"{name}: a block's scale makes its values overflow to infinity; the checkpoint is "
                             "damaged")
        out[start:start + rows_per_chunk] = chunk.to(dtype)
    return out.view(experts, rows, groups * VALUES_PER_BLOCK).transpose(1, 2).contiguous()
