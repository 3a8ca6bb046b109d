"""The TE backend's wiring, on the CPU, against a stand-in ``transformer_engine`` package (TE itself needs a GPU):
which linears become TE modules, that parameter names and the state dict do not change, the recipe built from
the fp8 section, and that the forward runs inside TE's autocast with the TP group. The real TE runs in
tests/gpu/test_fp8_gpu.py and bench/fp8_h200.py."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.models.llama.model import GPTModel

FAKE_PYTORCH = '''
import contextlib
import torch
from torch import nn

CALLS = []


class Linear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda", **kw):
        super().__init__()
        assert not kw, kw
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=params_dtype)) if bias else None

    def forward(self, inp):
        CALLS.append("linear")
        return nn.functional.linear(inp, self.weight, self.bias)

    def get_extra_state(self):
        return torch.tensor([1])

    def set_extra_state(self, state):
        pass


@contextlib.contextmanager
def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
    CALLS.append(("autocast", enabled, recipe, amax_reduction_group))
    yield
'''

FAKE_RECIPE = '''
import enum


class Format(enum.Enum):
    E4M3 = "E4M3"
    HYBRID = "HYBRID"


class _Recipe:
    def __init__(self, **kw):
        self.kw = kw


class DelayedScaling(_Recipe): pass
class Float8CurrentScaling(_Recipe): pass
class Float8BlockScaling(_Recipe): pass
class MXFP8BlockScaling(_Recipe): pass
'''


@pytest.fixture
def fake_te(tmp_path, monkeypatch):
    root = tmp_path / "transformer_engine"
    (root / "pytorch").mkdir(parents=True)
    (root / "common").mkdir()
    (root / "__init__.py").write_text("")
    (root / "pytorch" / "__init__.py").write_text(textwrap.dedent(FAKE_PYTORCH))
    (root / "common" / "__init__.py").write_text("")
    (root / "common" / "recipe.py").write_text(textwrap.dedent(FAKE_RECIPE))
    monkeypatch.syspath_prepend(str(tmp_path))
    from mmtrain.model import fp8_te

    monkeypatch.setattr(fp8_te, "_TE_LINEAR", None)
    import transformer_engine.pytorch as te

    yield te
    for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
        del sys.modules[name]


class _Mesh:
    tp_group = None


def test_te_backend_swaps_linears_in_place_and_runs_in_autocast(fake_te, monkeypatch):
    import torch.distributed as dist

    from mmtrain.model.fp8 import apply_fp8, te_importable
    from mmtrain.model.fp8_te import te_recipe

    assert te_importable()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    cfg = load_config(GPTRunConfig, None, [
        "model.num_layers=3", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
        "model.vocab_size=64", "train.precision=fp8", "fp8.recipe=delayed", "fp8.amax_history_len=16",
        "fp8.bf16_last_layers=1"])
    model = GPTModel(cfg.model)
    model.init_weights(0)
    ids = torch.randint(0, 64, (2, 8))
    want = model(ids)
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    apply_fp8(model, cfg, _Mesh(), "te")  # blocks 0 and 1 (bf16_last_layers=1)
    assert type(model.layers["0"].attn.qkv).__name__ == "TeLinear"
    assert isinstance(model.layers["2"].attn.qkv, nn.Linear)  # bf16_last_layers=1
    assert model.layers["1"].attn.qkv.part_sizes == (32, 32, 32)
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys  # TE's _extra_state is left out
    fake_te.CALLS.clear()
    assert torch.allclose(model(ids), want)  # the stand-in computes in full precision: same values
    assert fake_te.CALLS[0][0] == "autocast" and fake_te.CALLS.count("linear") == 8
    recipe = fake_te.CALLS[0][2]
    assert type(recipe).__name__ == "DelayedScaling"
    assert recipe.kw == {"margin": 0, "fp8_format": recipe.kw["fp8_format"], "amax_history_len": 16,
                         "amax_compute_algo": "max"}
    assert recipe.kw["fp8_format"].name == "HYBRID"
    for name, kind in (("tensorwise", "Float8CurrentScaling"), ("blockwise", "Float8BlockScaling"),
                       ("mxfp8", "MXFP8BlockScaling")):
        cfg.fp8.recipe = name
        assert type(te_recipe(cfg)).__name__ == kind
