"""Hugging Face ``DeepseekV3ForCausalLM`` <-> this family: config.json and full (unsharded) state dicts.

Tensors map one to one, bit for bit, except two fusions: a dense MLP's (and the shared experts') ``up`` is
[gate_proj | up_proj] row-wise, and routed experts are stacked and transposed: ``experts.w_up[e]`` =
[gate_proj | up_proj]^T (D, 2F), ``experts.w_down[e]`` = down_proj^T (F, D). No row is permuted: our attention
reads HF's head layout and (interleaved) RoPE layout as they are. HF experts come in two layouts, both read:
``checkpoint`` — one tensor per expert (``mlp.experts.<e>.gate_proj.weight``, what ``save_pretrained`` writes
and the Hub's DeepSeek checkpoints hold) — and ``module`` — the fused ``mlp.experts.gate_up_proj`` (E, 2F, D) /
``down_proj`` (E, D, F) of transformers 5's in-memory ``state_dict()``; ``state_dict_to_hf`` writes either.

Strict both ways: a missing, unexpected or misshapen tensor and an HF option this model lacks are
``HFAdapterError``\\ s naming the key. Multi-token-prediction layers (``model.layers.<num_hidden_layers>...``,
DeepSeek-V3's MTP module) are refused unless ``drop_mtp_layers=True``; transformers does not build them either.
Before any tensor is mapped, the config's layer and expert counts and every shape it implies are checked against
the tensors' shapes (``mmtrain.models.hf_shapes``), naming the config key.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from mmtrain.config.loader import ConfigError
from mmtrain.models.deepseek_v3.config import DeepseekV3Config
from mmtrain.models.hf_shapes import Shapes, Size, check_count, check_shapes, config_int, indices
from mmtrain.models.hf_tensors import TakenTensors, check_mapped_shapes, embedding_norm_and_head

ARCHITECTURE = "DeepseekV3ForCausalLM"
# (our field, HF key); every one must be present in config.json
_SAME_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "intermediate_size", "first_k_dense_replace", "n_routed_experts",
              "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
              "norm_topk_prob", "moe_intermediate_size", "rms_norm_eps", "max_position_embeddings")
# integer keys and their smallest value (the null ones are checked before)
_INT_KEYS = {"num_hidden_layers": 1, "vocab_size": 1, "hidden_size": 1, "num_attention_heads": 1, "q_lora_rank": 1,
             "kv_lora_rank": 1, "qk_nope_head_dim": 0, "qk_rope_head_dim": 1, "v_head_dim": 1, "intermediate_size": 1,
             "first_k_dense_replace": 0, "n_routed_experts": 0, "n_shared_experts": 0, "num_experts_per_tok": 1,
             "n_group": 1, "topk_group": 1, "moe_intermediate_size": 1, "max_position_embeddings": 1}
_YARN_KEYS = {"yarn_factor": "factor", "yarn_original_max_position_embeddings": "original_max_position_embeddings",
              "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_mscale": "mscale",
              "yarn_mscale_all_dim": "mscale_all_dim", "yarn_truncate": "truncate"}


class HFAdapterError(ValueError):
    """An HF config or state dict this family cannot map exactly; the message names the key and the fix."""


# ------------------------------------------------------------------------------------------------ config
def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers-5 ``rope_parameters`` over the transformers-4 ``rope_theta`` + ``rope_scaling``."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def config_from_hf(hf: dict[str, Any]) -> DeepseekV3Config:
    """Our config for an HF ``config.json`` mapping (checked); ``HFAdapterError`` names an unusable key."""
    if hf.get("model_type") != "deepseek_v3":
        raise HFAdapterError(f"config.json: model_type={hf.get('model_type')!r}; this adapter reads 'deepseek_v3'")
    missing = [k for k in (*_SAME_KEYS, "num_hidden_layers") if k not in hf]
    if missing:
        raise HFAdapterError(f"config.json lacks {missing[0]!r}; write the key out "
                             "(transformers' save_pretrained does)")
    unsupported = {"hidden_act": ("silu",), "attention_bias": (False,), "attention_dropout": (0, 0.0)}
    for key, allowed in unsupported.items():
        if key in hf and hf[key] not in allowed:
            raise HFAdapterError(f"config.json: {key}={hf[key]!r} is not supported; supported: "
                                 f"{', '.join(map(repr, allowed))}")
    if hf.get("num_key_value_heads") not in (None, hf["num_attention_heads"]):
        raise HFAdapterError(f"config.json: num_key_value_heads={hf['num_key_value_heads']!r} must equal "
                             f"num_attention_heads ({hf['num_attention_heads']}): MLA expands keys to every head")
    for key in ("n_group", "topk_group", "first_k_dense_replace", "num_experts_per_tok", "norm_topk_prob"):
        if hf[key] is None:
            raise HFAdapterError(f"config.json: {key} is null; give a value")
    for key, minimum in _INT_KEYS.items():
        if not (key == "q_lora_rank" and hf[key] is None):  # null: a direct query projection
            config_int(hf, key, HFAdapterError, minimum)
    cfg = DeepseekV3Config(name=str(hf.get("_name_or_path") or "deepseek_v3"), num_layers=hf["num_hidden_layers"],
                           rope_interleave=bool(hf.get("rope_interleave", True)),
                           tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                           **{k: hf[k] for k in _SAME_KEYS})
    rope = _rope_parameters(hf)
    cfg.rope_theta = float(rope["rope_theta"])
    if rope["rope_type"] == "yarn":
        cfg.rope_scaling = "yarn"
        if rope.get("attention_factor") is not None:
            raise HFAdapterError("config.json: rope_parameters.attention_factor is not supported; YaRN's factor "
                                 "is derived from factor, mscale and mscale_all_dim")
        if "original_max_position_embeddings" not in rope:
            raise HFAdapterError("config.json: rope_parameters.original_max_position_embeddings is required for yarn")
        if rope.get("factor") is None:  # as HF: the ratio of the target to the pretraining length
            rope["factor"] = hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
        for ours, key in _YARN_KEYS.items():
            if rope.get(key) is not None:
                setattr(cfg, ours, type(getattr(cfg, ours))(rope[key]))
    elif rope["rope_type"] != "default":
        raise HFAdapterError(f"config.json: rope type {rope['rope_type']!r} is not supported; supported: "
                             "'default', 'yarn'")
    try:
        return cfg.check(prefix="config.json (mmtrain field) ")
    except ConfigError as exc:
        raise HFAdapterError(str(exc)) from None


def config_to_hf(cfg: DeepseekV3Config, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """An HF ``config.json`` mapping; ``base`` (the config converted from, if any) supplies the fields this
    model does not use (token ids, initializer_range, ...)."""
    hf: dict[str, Any] = {}
    if base and base.get("model_type") == "deepseek_v3":
        hf.update({k: v for k, v in base.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")})
    hf.update({k: getattr(cfg, k) for k in _SAME_KEYS})
    hf.update({
        "architectures": [ARCHITECTURE], "model_type": "deepseek_v3", "num_hidden_layers": cfg.num_layers,
        "num_key_value_heads": cfg.num_attention_heads, "rope_interleave": cfg.rope_interleave,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "num_nextn_predict_layers": 0,
        "rope_theta": cfg.rope_theta, "rope_scaling": None,  # legacy keys: read by transformers 4 and 5 alike
    })
    if cfg.rope_scaling == "yarn":
        hf["rope_scaling"] = {"type": "yarn", "rope_type": "yarn",
                              **{key: getattr(cfg, ours) for ours, key in _YARN_KEYS.items()}}
    return hf


# ------------------------------------------------------------------------------------------------ tensors
def _attention_names(cfg: DeepseekV3Config) -> dict[str, str]:
    """Our attention (and norm) tensor suffixes -> HF's, within one layer."""
    names = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
             "attn.kv_down.weight": "self_attn.kv_a_proj_with_mqa.weight",
             "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
             "attn.kv_up.weight": "self_attn.kv_b_proj.weight",
             "attn.proj.weight": "self_attn.o_proj.weight"}
    if cfg.q_lora_rank is None:
        names["attn.q_proj.weight"] = "self_attn.q_proj.weight"
    else:
        names.update({"attn.q_down.weight": "self_attn.q_a_proj.weight",
                      "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
                      "attn.q_up.weight": "self_attn.q_b_proj.weight"})
    return names


def _expected_shapes(cfg: DeepseekV3Config, per_expert: bool) -> Shapes:
    """Every HF tensor ``cfg`` implies (in both expert layouts; ``per_expert``: list the one-tensor-per-expert
    names), dimension by dimension, with the config.json key each size comes from."""
    d, h = Size("hidden_size", cfg.hidden_size), cfg.num_attention_heads
    vocab, kv_rank = Size("vocab_size", cfg.vocab_size), Size("kv_lora_rank", cfg.kv_lora_rank)
    q = Size("num_attention_heads", h, cfg.qk_head_dim, f"qk_nope_head_dim + qk_rope_head_dim {cfg.qk_head_dim}")
    kv_up = Size("num_attention_heads", h, cfg.qk_nope_head_dim + cfg.v_head_dim,
                 f"qk_nope_head_dim + v_head_dim {cfg.qk_nope_head_dim + cfg.v_head_dim}")
    o = Size("num_attention_heads", h, cfg.v_head_dim, f"v_head_dim {cfg.v_head_dim}")
    ffn, mi = Size("intermediate_size", cfg.intermediate_size), Size("moe_intermediate_size", cfg.moe_intermediate_size)
    experts = Size("n_routed_experts", cfg.n_routed_experts)
    shared = Size("n_shared_experts", cfg.n_shared_experts, cfg.moe_intermediate_size,
                  f"moe_intermediate_size {cfg.moe_intermediate_size}")
    out: Shapes = {"model.embed_tokens.weight": (vocab, d), "lm_head.weight": (vocab, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_layers):
        hf = f"model.layers.{i}."
        a = hf + "self_attn."
        out.update({hf + "input_layernorm.weight": (d,), hf + "post_attention_layernorm.weight": (d,),
                    a + "kv_a_proj_with_mqa.weight": (Size("kv_lora_rank + qk_rope_head_dim",
                                                           cfg.kv_lora_rank + cfg.qk_rope_head_dim), d),
                    a + "kv_a_layernorm.weight": (kv_rank,), a + "kv_b_proj.weight": (kv_up, kv_rank),
                    a + "o_proj.weight": (d, o)})
        if cfg.q_lora_rank is None:
            out[a + "q_proj.weight"] = (q, d)
        else:
            q_rank = Size("q_lora_rank", cfg.q_lora_rank)
            out.update({a + "q_a_proj.weight": (q_rank, d), a + "q_a_layernorm.weight": (q_rank,),
                        a + "q_b_proj.weight": (q, q_rank)})
        m = hf + "mlp."
        if not cfg.is_moe_layer(i):
            out.update({m + "gate_proj.weight": (ffn, d), m + "up_proj.weight": (ffn, d),
                        m + "down_proj.weight": (d, ffn)})
            continue
        out.update({m + "gate.weight": (experts, d), m + "gate.e_score_correction_bias": (experts,),
                    m + "experts.gate_up_proj": (experts, Size("moe_intermediate_size", cfg.moe_intermediate_size,
                                                               2, "2 (gate|up)"), d),
                    m + "experts.down_proj": (experts, d, mi)})
        for e in range(cfg.n_routed_experts if per_expert else 0):
            x = f"{m}experts.{e}."
            out.update({x + "gate_proj.weight": (mi, d), x + "up_proj.weight": (mi, d),
                        x + "down_proj.weight": (d, mi)})
        # after the routed experts, which check moe_intermediate_size alone
        s = m + "shared_experts."
        out.update({s + "gate_proj.weight": (shared, d), s + "up_proj.weight": (shared, d),
                    s + "down_proj.weight": (d, shared)})
    return out


def check_hf_weights(hf_tensors: dict[str, torch.Tensor], cfg: DeepseekV3Config) -> None:
    """The layer and expert counts and every shape ``cfg`` (read from config.json) implies, against the tensors'
    shapes; ``HFAdapterError`` naming the key. The weights may hold more layers (multi-token prediction's, which
    the mapping names)."""
    check_count("num_hidden_layers", cfg.num_layers, indices(hf_tensors, r"model\.layers\.(\d+)\."),
                "layers (model.layers.<i>)", HFAdapterError, at_most=True)
    per_expert = indices((n for n in hf_tensors if (m := re.match(r"model\.layers\.(\d+)\.", n))
                          and int(m.group(1)) < cfg.num_layers),
                         r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
    if per_expert and cfg.first_k_dense_replace < cfg.num_layers:
        check_count("n_routed_experts", cfg.n_routed_experts, per_expert, "experts (mlp.experts.<e>)", HFAdapterError)
    check_shapes(_expected_shapes(cfg, bool(per_expert)), hf_tensors, HFAdapterError)


def state_dict_from_hf(hf_tensors: dict[str, torch.Tensor], cfg: DeepseekV3Config,
                       drop_mtp_layers: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors of ``DeepseekV3Model(cfg)`` (its ``state_dict`` names, routing biases included) from full HF
    tensors in either expert layout, after ``check_hf_weights``. Every HF tensor is used or the call fails
    naming it."""
    check_hf_weights(hf_tensors, cfg)
    take = TakenTensors(hf_tensors, HFAdapterError)
    out = embedding_norm_and_head(take, cfg.tie_word_embeddings)
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _attention_names(cfg).items():
            out[ours + mine] = take(hf + theirs)
        if not cfg.is_moe_layer(i):
            out[ours + "mlp.up.weight"] = torch.cat([take(hf + "mlp.gate_proj.weight"),
                                                     take(hf + "mlp.up_proj.weight")])
            out[ours + "mlp.down.weight"] = take(hf + "mlp.down_proj.weight")
            continue
        out[ours + "mlp.router.weight"] = take(hf + "mlp.gate.weight")
        out[ours + "mlp.router.expert_bias"] = take(hf + "mlp.gate.e_score_correction_bias")
        if hf + "mlp.experts.gate_up_proj" in hf_tensors:  # transformers 5 in-memory layout
            out[ours + "mlp.experts.w_up"] = take(hf + "mlp.experts.gate_up_proj").transpose(1, 2).contiguous()
            out[ours + "mlp.experts.w_down"] = take(hf + "mlp.experts.down_proj").transpose(1, 2).contiguous()
        else:
            experts = [f"{hf}mlp.experts.{e}." for e in range(cfg.n_routed_experts)]
            w_up = [torch.cat([take(x + "gate_proj.weight"), take(x + "up_proj.weight")]).t() for x in experts]
            out[ours + "mlp.experts.w_up"] = torch.stack(w_up).contiguous()
            out[ours + "mlp.experts.w_down"] = torch.stack([take(x + "down_proj.weight").t()
                                                            for x in experts]).contiguous()
        s = hf + "mlp.shared_experts."
        if not cfg.n_shared_experts:  # transformers still builds a zero-width shared MLP
            take.used.update(n for n in hf_tensors if n.startswith(s) and hf_tensors[n].numel() == 0)
        else:
            out[ours + "mlp.shared.up.weight"] = torch.cat([take(s + "gate_proj.weight"), take(s + "up_proj.weight")])
            out[ours + "mlp.shared.down.weight"] = take(s + "down_proj.weight")
    extra = take.unused()
    mtp = re.compile(r"model\.layers\.(\d+)\.")
    if drop_mtp_layers:
        extra = [n for n in extra if not ((m := mtp.match(n)) and int(m.group(1)) >= cfg.num_layers)]
    if extra:
        hint = ("; it belongs to a multi-token-prediction layer: pass drop_mtp_layers=True to leave those out"
                if (m := mtp.match(extra[0])) and int(m.group(1)) >= cfg.num_layers else "")
        raise HFAdapterError(f"HF state dict has {extra[0]!r} ({len(extra)} unused tensors), which this model does "
                             f"not hold{hint}")
    _check_shapes(out, cfg)
    return out


def _check_shapes(out: dict[str, torch.Tensor], cfg) -> None:
    """The mapped tensors against the shapes of a model built from ``cfg`` (the model module loads only when a conversion runs)."""
    from mmtrain.models.deepseek_v3.model import DeepseekV3Model

    check_mapped_shapes(out, lambda: DeepseekV3Model(cfg), HFAdapterError)


def state_dict_to_hf(state: dict[str, torch.Tensor], cfg: DeepseekV3Config,
                     experts_layout: str = "checkpoint") -> dict[str, torch.Tensor]:
    """HF tensors from our full tensors: ``experts_layout`` ``checkpoint`` (one tensor per expert, for
    safetensors files) or ``module`` (the fused tensors of ``DeepseekV3ForCausalLM.state_dict()``)."""
    if experts_layout not in ("checkpoint", "module"):
        raise HFAdapterError(f"experts_layout={experts_layout!r}; use 'checkpoint' or 'module'")
    take = TakenTensors(state, HFAdapterError, "state dict")

    out = {"model.embed_tokens.weight": take("embed.weight"), "model.norm.weight": take("norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("output.weight")
    f, sf = cfg.moe_intermediate_size, cfg.shared_intermediate_size
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _attention_names(cfg).items():
            out[hf + theirs] = take(ours + mine)
        if not cfg.is_moe_layer(i):
            gate, up = take(ours + "mlp.up.weight").split([cfg.intermediate_size] * 2)
            out.update({hf + "mlp.gate_proj.weight": gate.contiguous(), hf + "mlp.up_proj.weight": up.contiguous(),
                        hf + "mlp.down_proj.weight": take(ours + "mlp.down.weight")})
            continue
        out[hf + "mlp.gate.weight"] = take(ours + "mlp.router.weight")
        out[hf + "mlp.gate.e_score_correction_bias"] = take(ours + "mlp.router.expert_bias")
        w_up, w_down = take(ours + "mlp.experts.w_up"), take(ours + "mlp.experts.w_down")
        if experts_layout == "module":
            out[hf + "mlp.experts.gate_up_proj"] = w_up.transpose(1, 2).contiguous()
            out[hf + "mlp.experts.down_proj"] = w_down.transpose(1, 2).contiguous()
        else:
            for e in range(cfg.n_routed_experts):
                gate, up = w_up[e].t().split([f, f])
                x = f"{hf}mlp.experts.{e}."
                out.update({x + "gate_proj.weight": gate.contiguous(), x + "up_proj.weight": up.contiguous(),
                            x + "down_proj.weight": w_down[e].t().contiguous()})
        if cfg.n_shared_experts:
            s = hf + "mlp.shared_experts."
            gate, up = take(ours + "mlp.shared.up.weight").split([sf, sf])
            out.update({s + "gate_proj.weight": gate.contiguous(), s + "up_proj.weight": up.contiguous(),
                        s + "down_proj.weight": take(ours + "mlp.shared.down.weight")})
    extra = take.unused()
    if extra:
        raise HFAdapterError(f"state dict has {extra[0]!r}, which DeepseekV3ForCausalLM does not hold")
    return out
