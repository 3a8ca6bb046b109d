"""Tiny checkpoints and tokenizers for the generation and serving tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from mmtrain.models.deepseek_v3.config import DeepseekV3Config
from mmtrain.models.nemotron_h.config import NemotronHConfig
from mmtrain.config.schema import ModelConfig
from mmtrain.convert.checkpoint_io import write_weights_checkpoint
from mmtrain.models.registry import model_family

TEXT = ["The quick brown fox jumps over the lazy dog.", "Numbers 1234567890 and code: def f(x): return x * 2",
        "Café, naïve, résumé and 東京.", "Hello world, hello model, hello server."] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_config(**overrides) -> ModelConfig:
    """Sharp logits (large init) so greedy choices are far from ties."""
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                vocab_size=512, init_std=0.25, rope_theta=10000.0)
    return ModelConfig(**{**base, **overrides})


def tiny_deepseek_config(**overrides) -> ModelConfig:
    """A DeepSeek-V3-style shape (MLA with low-rank q and kv, v_head_dim != qk dims, 8 routed experts in 4 groups
    plus a shared one, the first layer dense), sharp logits as ``tiny_config``; ``overrides``: shape fields."""
    shape = dict(vocab_size=512, hidden_size=32, num_layers=3, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16,
                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, intermediate_size=48, moe_intermediate_size=16,
                 n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, init_std=0.3)
    return ModelConfig(family="deepseek_v3", deepseek_v3=DeepseekV3Config(**{**shape, **overrides}))


# a Nemotron-H hybrid: Mamba-2 (8 heads in 2 groups), attention (GQA) and MLP layers; chunks of 4 tokens
NEMOTRON_H_SHAPE = dict(vocab_size=128, hidden_size=32, hybrid_override_pattern="M*M-MM", num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8, mamba_head_dim=6,
                        ssm_state_size=5, n_groups=2, conv_kernel=4, chunk_size=4)


def tiny_nemotron_h_config(**overrides) -> ModelConfig:
    """``NEMOTRON_H_SHAPE`` (``overrides``: shape fields) with sharp logits, as ``tiny_config``."""
    shape = {**NEMOTRON_H_SHAPE, "vocab_size": 512, "initializer_range": 0.3, **overrides}
    return ModelConfig(family="nemotron_h", nemotron_h=NemotronHConfig(**shape))


def tiny_hf_nemotron_h(**overrides):
    """A random transformers ``NemotronHForCausalLM`` of ``NEMOTRON_H_SHAPE`` (``overrides``: NemotronHConfig
    fields), fp32, eval mode, weights set so that greedy completions vary (a unit embedding and output layer, the
    other matrices doubled, vectors near their init: norms near 1, dt well above the time_step_min clamp). Its
    time_step_limit is [time_step_min, inf], the clamp transformers 5.24 applies, so that 5.25 (which reads
    time_step_limit) computes the same and the adapter reads it."""
    import transformers

    torch.manual_seed(0)
    clamp = (overrides.get("time_step_min", transformers.NemotronHConfig.time_step_min), math.inf)
    config = transformers.NemotronHConfig(**{**NEMOTRON_H_SHAPE, "pad_token_id": 0, "eos_token_id": None,
                                             "time_step_limit": clamp, **overrides})
    model = transformers.NemotronHForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(0.3 * torch.randn_like(p) + (1.0 if "norm" in name else 0.0))
            elif "embeddings" in name or "lm_head" in name:
                p.normal_(0.0, 1.0)
            else:
                p.mul_(2.0)
    return model.eval()


def tiny_model(cfg: ModelConfig | None = None, seed: int = 3) -> torch.nn.Module:
    """The whole model of ``cfg`` (default ``tiny_config()``; any family), seeded, in eval mode."""
    cfg = cfg or tiny_config()
    model = model_family(cfg).build_stage(cfg, (0, cfg.shape().num_layers), True, True)
    model.init_weights(seed)
    with torch.no_grad():  # non-trivial norm weights and routing biases, as a trained model has
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if cfg.family == "deepseek_v3" and name.endswith("expert_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


def uncached_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` by the model's full forward, one new token at a time (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` by transformers' ``generate`` (exactly n: no end-of-text stop)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def load_whole_model(ckpt: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The whole model of a checkpoint (any saved layout) on the CPU, as ``mmtrain.generate`` loads it."""
    from mmtrain.inference.loading import load_checkpoint_model
    from mmtrain.parallel import ParallelDims, init_distributed, shutdown_distributed

    init_distributed()
    try:
        return load_checkpoint_model(ckpt, ParallelDims(1).build(), "cpu", dtype)[0]
    finally:
        shutdown_distributed()


def tiny_checkpoint(root: Path, cfg: ModelConfig | None = None, tp: int = 1) -> Path:
    """A weights-only checkpoint root of ``tiny_model`` written at ``tp``; returns the root."""
    model = tiny_model(cfg)
    write_weights_checkpoint(root, {k: v.detach().clone() for k, v in model.state_dict().items()},
                             cfg or tiny_config(), tp=tp)
    return root


def tiny_tokenizer(folder: Path, chat_template: bool = True) -> Path:
    """A byte-level BPE tokenizer.json (< 512 ids, eos </s>), with a chat template in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXT, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "</s>"}
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def metaspace_tokenizer(folder: Path) -> Path:
    """A SentencePiece-style tokenizer.json (< 512 ids, eos </s>, no byte fallback): a word's leading space is a
    '▁', and decoding drops the one of its first token, so a completion decoded alone loses its leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(TEXT, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder / "tokenizer.json"
