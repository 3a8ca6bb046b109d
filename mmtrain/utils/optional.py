"""Optional packages some settings need, found without importing them (their imports are slow or need a GPU)."""

from __future__ import annotations

import importlib.util

FLASH_PACKAGE = "flash-attn-4"  # FlexAttention's FLASH backend imports its flash_attn.cute (the flash extra)


def flash_available() -> bool:
    """Whether flash-attn-4's CuTe kernels are installed (FlexAttention's FLASH backend imports them)."""
    try:  # find_spec imports the parent package to look inside it: absent, or an older flash-attn whose
        # __init__ fails to load its CUDA extension (an OSError, a RuntimeError), means not available
        return importlib.util.find_spec("flash_attn.cute") is not None
    except Exception:  # noqa: BLE001 - whatever the parent's import raises, the answer is no
        return False
