"""Optional packages some settings need, found without importing them (their imports are slow or need a GPU)."""

from __future__ import annotations

import importlib.util

FLASH_PACKAGE = "flash-attn-4"  # FlexAttention's FLASH backend imports its flash_attn.cute (the flash extra)


def flash_available() -> bool:
    """Whether flash-attn-4's CuTe kernels are installed (FlexAttention's FLASH backend imports them)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # no flash_attn at all: find_spec imports the parent package to look inside it
        return False
