"""The cached forward of a decoder-only LM, through its family's own modules (the family contract,
``mmtrain.models.contract``): ``new_kv_cache`` sizes a static cache for the model as it is on this rank, and
``decode`` runs the model's embedding, blocks (their attention through the cache), final norm and head. So it runs
whatever the modules are: whole, or sharded by the tensor-parallel plan (column/row linears do their collectives,
the vocab-parallel head gathers full logits), in fp32 or bf16. Nothing here looks inside a model: the Llama family
caches keys and values (``mmtrain.model.layers.Attention.forward_cached``), the DeepSeek-V3 family its attention
latents (``mmtrain.models.deepseek_v3.latent_decode``).
"""

from __future__ import annotations

import torch
from torch import nn


class UnsupportedModelError(ValueError):
    """A model this decoder cannot run (a pipeline stage, another family); the message says what it needs."""


def check_decodable(model: nn.Module) -> None:
    """Raise ``UnsupportedModelError`` unless ``model`` is a whole model of a registered family (embedding,
    layers, final norm and head on one rank)."""
    if not (model.pre_process and model.post_process and len(model.layers)):
        raise UnsupportedModelError(
            f"{type(model).__name__}: KV-cache decoding needs a whole model (embedding, layers, final norm and "
            "head on one rank: no pipeline stages)")


def kv_cache_for(model: nn.Module, slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str):
    """A static cache sized for ``model`` as it is on this rank (the family's ``new_kv_cache``)."""
    return model.new_kv_cache(slots, max_len, dtype, device)


def kv_cache_bytes(model: nn.Module, slots: int, max_len: int, dtype: torch.dtype) -> int:
    """The bytes ``kv_cache_for`` allocates for these sizes: the family's cache built on the meta device (shapes
    only, nothing allocated), its entries (the floating-point tensors: not its position index) added up."""
    cache = model.new_kv_cache(slots, max_len, dtype, "meta")
    tensors = [t for value in vars(cache).values() for t in (value if isinstance(value, (list, tuple)) else [value])
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.numel() * t.element_size() for t in tensors)


def decoder_forward(model: nn.Module, cache, positions_BS: torch.Tensor, tokens_BS: torch.Tensor | None = None,
                    inputs_embeds: torch.Tensor | None = None, slots_B: torch.Tensor | None = None,
                    last_index_B: torch.Tensor | None = None, kv_len: int | None = None) -> torch.Tensor:
    """Run ``model`` on new tokens (or embeddings: a VLM's spliced prompt) of rows ``slots_B`` at ``positions_BS``,
    storing what its attention caches in ``cache``. Returns fp32 logits over the whole vocabulary of one position
    per row, (B, V): ``last_index_B[b]`` (default the last column). ``kv_len``: attend only the first ``kv_len``
    cached positions (a prefill that knows its longest row; None attends all, the static decode shape)."""
    return model.decode(cache, positions_BS, tokens_BS, inputs_embeds, slots_B, last_index_B, kv_len)
