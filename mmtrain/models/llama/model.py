"""Decoder-only language model (Llama family), for one device, optionally one pipeline stage of it.

A stage holds the global layers ``layer_range`` under their global indices (``layers.7...``), so parameter
names — and checkpoints — are the same whatever the pipeline layout. The first stage embeds tokens, the last
one normalizes, projects to the vocabulary and computes per-token losses with its ``head`` (a
``mmtrain.model.head.LossHead``; the TP plan's vocab-parallel head never gathers full logits).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from mmtrain.config.schema import ModelConfig
from mmtrain.model.attention import CausalAttention
from mmtrain.model.head import LossHead
from mmtrain.model.kv_cache import StaticKVCache, decoded_rows
from mmtrain.model.layers import TransformerBlock, make_norm, rope_cos_sin, rope_frequencies
from mmtrain.model.lora import add_lora, reset_dora_magnitudes
from mmtrain.model.moe import Experts
from mmtrain.models.llama.spec import llama_sharding_spec
from mmtrain.models.contract import LanguageStageDefaults
from mmtrain.models.spec import ShardingSpec
from mmtrain.parallel.moe_dispatch import LocalDispatch


class GPTModel(LanguageStageDefaults, nn.Module):
    """Decoder-only LM (or one pipeline stage of it: ``layer_range``, ``pre_process`` = holds the embedding,
    ``post_process`` = holds the final norm, output layer and loss; ``head``: its strategy, default the
    one-device ``LossHead``; ``attention``: the attention strategy every layer shares, default
    ``CausalAttention()``, e.g. ``mmtrain.model.attention_cp.ContextParallelAttention`` under CP;
    ``moe_dispatch``: the MoE layers' token-dispatch strategy, default local, or
    ``mmtrain.parallel.expert.expert_dispatch``'s all-to-all; ``lora``: a ``LoraConfig`` with rank > 0 adds LoRA
    adapters to its target linears and freezes everything else). Call ``init_weights(seed)`` after building."""

    def __init__(self, cfg: ModelConfig, layer_range: tuple[int, int] | None = None,
                 pre_process: bool = True, post_process: bool = True, head: LossHead | None = None,
                 attention=None, moe_dispatch: LocalDispatch | None = None, lora=None) -> None:
        super().__init__()
        self.cfg = cfg
        start, end = layer_range or (0, cfg.num_layers)
        self.layer_range = (start, end)
        self.pre_process, self.post_process = pre_process, post_process
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if pre_process else None
        self.attention = attention if attention is not None else CausalAttention()
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, self.attention, moe_dispatch=moe_dispatch,
                                                              routed=cfg.moe_layer(i))
                                     for i in range(start, end)})
        self.norm = make_norm(cfg) if post_process else None
        # A tied last stage that does not hold the embedding keeps its own copy, kept equal by the trainer.
        own_output = post_process and not (cfg.tie_embeddings and pre_process)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_output else None
        self.head = (head or LossHead()) if post_process else None
        self.sequence_parallel = False  # the layout the TP plan applied (resolves the spec's partial gradients)
        self.register_buffer("inv_freq", rope_frequencies(cfg.attention_head_dim, cfg.rope_theta,
                                                           cfg.rope_scaling_factor),
                             persistent=False)
        self.lora = lora if lora is not None and lora.rank else None
        if self.lora is not None:
            add_lora(self, list(self.lora.targets_for(cfg)), self.lora.rank, self.lora.alpha, self.lora.dora)

    def sharding_spec(self) -> ShardingSpec:
        """How every tensor of the whole model is sharded (``mmtrain.models.llama.spec``), for this layout."""
        return llama_sharding_spec(self.cfg, self.lora).for_layout(self.sequence_parallel)

    # ------------------------------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic per-parameter init keyed by (seed, parameter name): any stage split or rank of the same
        model gets the same values. Output projections of each block are scaled by 1/sqrt(2 * num_layers); LoRA's
        ``B`` starts at zero and a DoRA magnitude at its weight's row norms (the adapted model starts as the base)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith(("bias", "lora_B.weight")):  # LoRA's B at zero: the adapted model starts as the base
                p.zero_()
            elif name.endswith("lora_A.weight"):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif p.ndim == 1:  # norm weights
                p.fill_(1.0)
            else:
                scale = (std / (2 * self.cfg.num_layers) ** 0.5
                         if name.endswith(("proj.weight", "down.weight", "experts.w_down")) else std)
                if name == "output.weight" and self.cfg.tie_embeddings:
                    name_for_seed = "embed.weight"  # a tied copy starts equal to the embedding
                    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name_for_seed.encode()))
                owner = self.get_submodule(name.rpartition(".")[0])
                if isinstance(owner, Experts):  # this rank's experts of the whole model's values
                    p.copy_(owner.own_slice(torch.randn((owner.num_total, *p.shape[1:]), generator=g) * scale))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * scale)
        reset_dora_magnitudes(self)  # DoRA magnitudes: the row norms of the weights just set

    # ------------------------------------------------------------------------------------------ forward
    @property
    def head_matmul(self) -> nn.Module | None:
        """The output layer's FP8 matmul (``fp8.output_layer``), or None."""
        return self.head.matmul if self.head is not None else None

    def compile_head(self) -> None:
        """The family contract's head hook (``mmtrain.models.contract.FamilyStage``): the cross-entropy (fuses the
        fp32 upcast, log-softmax and backward); with an FP8 output layer the whole ``head_loss``, so its casts of
        the (huge) logits gradient fuse with the loss."""
        if self.head is None:
            return
        if self.head_matmul is not None:
            self.head_loss = torch.compile(self.head_loss)
        else:
            self.head.compile_loss()

    def forward(self, inputs: torch.Tensor | None, labels_BS: torch.Tensor | None = None,
                position_ids_BS: torch.Tensor | None = None, doc_ids_BS: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs``: token ids (B, S) on the first stage, hidden states (B, S, D) otherwise.
        ``inputs_embeds``: (B, S, D) used instead of embedding ``inputs`` (a VLM's spliced text+media embeddings).
        ``doc_ids_BS``: document index of each token of packed sequences; attention then stays inside documents
        (pair it with position ids that restart at each document); the attention strategy turns them into its
        mask once here, outside the (compiled) blocks; ``cfg.sliding_window`` restricts every layer's queries to the
        keys of that window (with or without documents).
        Returns per-token losses (B, S) on the last stage when ``labels_BS`` is given, else logits (last stage)
        or hidden states (other stages)."""
        if inputs_embeds is not None:
            x = inputs_embeds
        else:
            x = self.embed(inputs) if self.pre_process else inputs
        if position_ids_BS is None:
            if not self.pre_process:
                raise ValueError("a pipeline stage without the embedding needs position_ids_BS")
            # the full length: under sequence parallelism x holds only this rank's part of the sequence
            B, S = (inputs if inputs_embeds is None else inputs_embeds).shape[:2]
            position_ids_BS = torch.arange(S, device=x.device).expand(B, S)
        window = self.cfg.sliding_window or None
        if window and doc_ids_BS is None and window < position_ids_BS.shape[1]:
            doc_ids_BS = torch.zeros_like(position_ids_BS)  # one document: the window's mask built once, here
        attn_mask = self.attention.prepare(doc_ids_BS, window)
        cos, sin = rope_cos_sin(position_ids_BS, self.inv_freq, x.dtype)
        for layer in self.layers.values():
            x = layer(x, cos, sin, attn_mask)
        if not self.post_process:
            return x
        x = self.head.prepare(self.norm(x))
        if labels_BS is None:
            return self.head.full_logits(self.logits(x))
        return self.head_loss(x, labels_BS)

    # ------------------------------------------------------------------------------------------ decoding
    def new_kv_cache(self, slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> StaticKVCache:
        """The family contract's cache for ``decode``: keys and values of this rank's KV heads per layer."""
        first = next(iter(self.layers.values())).attn
        return first.new_kv_cache(len(self.layers), slots, max_len, dtype, device)

    def decode(self, cache: StaticKVCache, positions_BS: torch.Tensor, tokens_BS: torch.Tensor | None = None,
               inputs_embeds: torch.Tensor | None = None, slots_B: torch.Tensor | None = None,
               last_index_B: torch.Tensor | None = None, kv_len: int | None = None) -> torch.Tensor:
        """The family contract's cached forward (a whole model, TP-sharded or not): new tokens (or embeddings: a
        VLM's spliced prompt) of rows ``slots_B`` at ``positions_BS``, their keys/values stored in ``cache``.
        Returns fp32 logits over the whole vocabulary (B, V) of one position per row: ``last_index_B[b]``
        (default the last column). ``kv_len``: attend only the first ``kv_len`` cached positions."""
        x = inputs_embeds if inputs_embeds is not None else self.embed(tokens_BS)
        cos, sin = rope_cos_sin(positions_BS, self.inv_freq, x.dtype)
        for i, layer in enumerate(self.layers.values()):
            x = layer.decode(x, cos, sin, cache, i, slots_B, positions_BS, kv_len)
        x = self.head.prepare(self.norm(decoded_rows(x, last_index_B)))
        return self.head.full_logits(self.logits(x))[:, 0].float()

    def head_loss(self, x: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """Per-token losses from the hidden states: output layer, then the head's loss (the build may compile
        this method, so the FP8 output layer's casts fuse with the loss kernels)."""
        return self.head.loss(self.logits(x), labels_BS)


def count_parameters(cfg: ModelConfig, active: bool = False) -> int:
    """Parameters of the whole model (embedding counted once when tied); ``active``: only the experts a token
    uses (top-k), which is what the FLOPs follow. Biases are not counted; q/k norms are."""
    d, f, v, L = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.num_layers
    hd = cfg.attention_head_dim
    attn = d * (cfg.num_attention_heads * hd + 2 * cfg.kv_heads * hd) + cfg.num_attention_heads * hd * d
    attn += 2 * hd if cfg.qk_norm else 0
    per_mlp = 3 if cfg.activation == "swiglu" else 2
    fe = cfg.moe_ffn_hidden_size or f
    experts = cfg.moe_top_k if active else cfg.num_experts
    routed = d * fe * per_mlp * experts + cfg.num_experts * d + d * cfg.moe_shared_ffn_hidden_size * per_mlp
    moe_layers = sum(cfg.moe_layer(i) for i in range(L))  # the others (moe_dense_layers) keep a dense MLP
    mlps = moe_layers * routed + (L - moe_layers) * d * f * per_mlp
    return L * (attn + 2 * d) + mlps + v * d * (1 if cfg.tie_embeddings else 2) + d


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token: 6 * (non-embedding params + output layer) + causal attention: QK^T and AV over
    half the sequence on average, 6 * 2 * L * S * (heads * head_dim) / 2 (= 6·L·S·d when head_dim * heads = d)."""
    d, v, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    dense = count_parameters(cfg, active=True) - v * d * (1 if cfg.tie_embeddings else 2) + v * d
    return 6.0 * dense + 6.0 * L * seq_length * cfg.num_attention_heads * cfg.attention_head_dim
