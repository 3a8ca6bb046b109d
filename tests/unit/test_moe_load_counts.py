"""The MoE layers count tokens per expert for the router-bias update only while training: not in validation
(``stage.eval()``), a DPO reference or decoding. A count kept across decode steps held the previous compiled
step's output, which CUDA graphs overwrite ("accessing tensor output of CUDAGraphs that has been overwritten",
DeepSeek-V3 compiled decoding on the H200)."""

from __future__ import annotations

import pytest
import torch

from tests.inference_helpers import tiny_config, tiny_deepseek_config, tiny_model


@pytest.mark.parametrize("cfg", [tiny_deepseek_config(), tiny_config(num_experts=4, moe_top_k=2)],
                         ids=["deepseek_v3", "llama-moe"])
def test_loads_are_counted_in_training_only(cfg):
    model = tiny_model(cfg)
    moe = [m for m in model.modules() if hasattr(m, "step_load")]
    assert moe
    tokens = torch.randint(0, 512, (2, 8))
    with torch.no_grad():
        model.eval()(tokens)
    assert all(m.step_load is None for m in moe)
    model.train()(tokens)
    assert all(m.step_load is not None and int(m.step_load.sum()) > 0 for m in moe)
