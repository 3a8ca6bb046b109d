"""``to_device`` on the CPU: values, dtypes and None pass through (the pinned staging is CUDA's; see
tests/gpu/test_host_syncs_gpu.py for the copy that does not wait for the GPU)."""

from __future__ import annotations

import torch

from mmtrain.data.documents import GPTMicroBatch
from mmtrain.utils.host_copy import to_device


def test_cpu_moves_keep_values_and_none():
    t = torch.arange(12).view(3, 4)
    assert to_device(None, torch.device("cpu")) is None
    assert torch.equal(to_device(t, torch.device("cpu")), t)
    batch = GPTMicroBatch.plain(torch.arange(10).view(2, 5)).to(torch.device("cpu"))
    assert batch.document_ids is None and batch.loss_mask is None
    assert torch.equal(batch.position_ids, torch.arange(4).expand(2, 4))
