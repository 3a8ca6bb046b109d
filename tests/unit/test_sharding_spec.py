"""The sharding spec: one entry for every tensor of each family's model, resolved per layout, and nothing
outside the family folders matches parameter names (the TP plan, checkpoints, bridge and grads read the spec)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from mmtrain.config.schema import ModelConfig
from mmtrain.models.deepseek_v3.shape_file import load_deepseek_v3_config
from mmtrain.models.deepseek_v3.model import DeepseekV3Model
from mmtrain.models.llama.model import GPTModel
from mmtrain.models.llama.spec import llama_sharding_spec
from mmtrain.models.spec import ParamSpec, ShardingSpec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
BASE = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64)
LLAMA_SHAPES = {
    "dense": {},
    "gqa-qkbias-qknorm-tied": dict(num_query_groups=2, qkv_bias=True, qk_norm=True, tie_embeddings=True),
    "layernorm-gelu-bias": dict(norm="layernorm", activation="gelu", add_bias=True),
    "moe-shared": dict(num_experts=4, moe_top_k=2, moe_shared_ffn_hidden_size=32, moe_router="sigmoid"),
}


def _covers_exactly(model: torch.nn.Module, spec: ShardingSpec) -> None:
    """Every parameter and persistent buffer has its entry; the spec has nothing else but a tied copy."""
    names = set(model.state_dict())
    params = dict(model.named_parameters())
    assert names <= set(spec), sorted(names - set(spec))
    extra = set(spec) - names
    assert all(spec[n].tied_to in names for n in extra), sorted(extra)
    for n in names:
        assert spec[n].buffer == (n not in params), n


@pytest.mark.parametrize("shape", sorted(LLAMA_SHAPES))
def test_llama_spec_has_one_entry_per_tensor_and_fused_parts_add_up(shape):
    cfg = ModelConfig(**BASE, **LLAMA_SHAPES[shape])
    model = GPTModel(cfg)
    spec = model.sharding_spec()
    _covers_exactly(model, spec)
    for name, t in model.state_dict().items():
        s = spec[name]
        if s.parts:
            assert sum(s.parts) == t.shape[s.dim], name
            assert all(p % s.unit == 0 for p in s.parts), name
        if s.expert_dim is not None:
            assert t.shape[s.expert_dim] == cfg.num_experts and s.grad_reduce_group == "edp", name
    # every pipeline stage's names are in the whole model's spec (a tied last stage holds the copy)
    for stage in (GPTModel(cfg, (0, 1), post_process=False), GPTModel(cfg, (1, 2), pre_process=False)):
        assert set(stage.state_dict()) <= set(spec)
    assert spec.stored_name("output.weight") == ("embed.weight" if cfg.tie_embeddings else "output.weight")


@pytest.mark.parametrize("q_lora_rank,tied", [(32, False), (None, True)])
def test_deepseek_v3_spec_uses_the_same_type(q_lora_rank, tied):
    cfg = dataclasses.replace(load_deepseek_v3_config(ROOT / "configs/models/deepseek-v3-tiny.yaml"),
                              q_lora_rank=q_lora_rank, tie_word_embeddings=tied)
    model = DeepseekV3Model(cfg)
    spec = model.sharding_spec()
    _covers_exactly(model, spec)
    kv_up = spec["layers.0.attn.kv_up.weight"]
    assert kv_up.tp == "column" and kv_up.unit == cfg.qk_nope_head_dim + cfg.v_head_dim
    assert spec["layers.0.attn.kv_down.weight"].grad_partial_over_tp  # each rank back-propagates its heads only


def test_partial_gradients_resolve_per_layout():
    spec = llama_sharding_spec(ModelConfig(**BASE, qk_norm=True, num_experts=4, moe_top_k=2))
    plain, sp = spec.for_layout(False), spec.for_layout(True)
    for name in ("norm.weight", "layers.0.attn_norm.weight", "layers.1.mlp.router.weight", "layers.1.mlp.experts.w_up"):
        assert not plain[name].grad_partial_over_tp and sp[name].grad_partial_over_tp, name
    for resolved in (plain, sp):  # shared by the heads TP splits: partial whatever the layout
        assert resolved["layers.0.attn.q_norm.weight"].grad_partial_over_tp
        assert not resolved["layers.0.attn.qkv.weight"].grad_partial_over_tp
    assert spec["layers.0.attn.qkv.weight"].tp_split() == (0, (32, 32, 32))
    assert spec["layers.0.attn.proj.weight"].tp_split() == (1, None)
    assert spec["layers.0.mlp_norm.weight"].tp_split() is None
    with pytest.raises(KeyError, match="layers.9.attn.qkv.weight: no entry in the llama sharding spec"):
        spec["layers.9.attn.qkv.weight"]
    with pytest.raises(ValueError, match="ParamSpec.tp='diagonal'"):
        ParamSpec("diagonal")


# A string that names a model tensor or module path: a dotted path through the parameter tree, a bare fused /
# expert parameter name, or a ".weight"/".bias" suffix. Config field names such as "qkv_bias" do not match.
_PARAM_NAME = re.compile(r"(^|\.)(qkv|gate_up|up|down|proj|w_up|w_down|expert_bias|router|experts|embed|output|"
                         r"attn|mlp|attn_norm|mlp_norm|q_norm|k_norm|shared)(\.|$)|\.(weight|bias)$|^layers\.")


def _name_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
            and _PARAM_NAME.search(n.value)]


@pytest.mark.parametrize("package", ["parallel", "train", "convert"])
def test_no_parameter_name_matching_outside_the_model_families(package):
    found = [f"{p.relative_to(ROOT)}:{line}: {text!r}" for p in sorted((ROOT / "mmtrain" / package).glob("*.py"))
             for line, text in _name_literals(p)]
    assert not found, "parameter names matched outside mmtrain/models/<family>/ (use the sharding spec):\n" + \
        "\n".join(found)
