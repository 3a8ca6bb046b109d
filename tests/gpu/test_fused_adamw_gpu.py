"""``FusedAdamW`` on CUDA updates bit for bit as ``torch.optim.AdamW(fused=True)`` (the CPU test's comparison)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_fused_adamw import compare_with_torch_fused_adamw

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_updates_bit_identical_to_torch_fused_adamw_on_the_gpu():
    compare_with_torch_fused_adamw(torch.device("cuda"))
