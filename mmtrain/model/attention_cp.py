"""Context-parallel attention: the attention strategy a model is built with when ``parallel.cp > 1``.

Each rank holds two zig-zag chunks of the sequence (``mmtrain.parallel.context``). Every layer all-gathers K
and V over the CP group (backward: reduce-scatter of their gradients), and each local query chunk attends to
the keys up to its own end: plain causal (SDPA, bottom-right causal bias) or, for packed documents, the
document kernel of ``mmtrain.model.attention`` (a FlexAttention block mask per chunk pair on the GPU, built
once per micro-batch from the all-gathered document ids; dense only on the CPU).

Why all-gather (the Llama 3 approach) is kept beside the ring (``parallel.cp_comm=ring``,
``mmtrain.model.attention_ring``): with GQA, K/V are small (here 8 of 32 heads), so one gather is cheap and
lets each chunk run a single fused attention call; but the gather is exposed (nothing runs while it is in
flight) and saves the whole sequence's K/V per layer. The ring hides the exchange behind attention at the
price of cp+2 partial calls per layer and a log-sum-exp merge.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmtrain.model.attention import CausalAttention, refuse_window_sinks_softcap
from mmtrain.parallel.comm import gather_seq, gather_seq_no_reduce
from mmtrain.parallel.context import zigzag_global_order


class ContextParallelAttention(CausalAttention):
    """Causal (optionally document-masked) attention of this rank's two zig-zag query chunks against the
    K/V all-gathered over ``group``. ``documents``: the document kernel, as for ``CausalAttention``."""

    def __init__(self, group, documents: Any = "auto") -> None:
        super().__init__(documents)
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def _chunks(self, c: int) -> list[tuple[int, int]]:
        """(local start, global key length) of each local query chunk of ``c`` tokens."""
        return [(j * c, (g + 1) * c) for j, g in enumerate((self.rank, 2 * self.cp - 1 - self.rank))]

    def prepare(self, doc_ids_BS: torch.Tensor | None, window: int | None = None) -> Any:
        """Per local chunk, the document mask of its queries against the keys up to its end (None: causal).
        A sliding window is refused (``parallel.cp`` with a window is a config error)."""
        refuse_window_sinks_softcap("context-parallel attention", window)
        if doc_ids_BS is None:
            return None
        kernel = self.kernel_for(doc_ids_BS.device)
        c = doc_ids_BS.shape[1] // 2
        all_ids = zigzag_global_order(gather_seq_no_reduce(doc_ids_BS, self.group, dim=1), self.cp, 1)
        masks = [kernel.mask(doc_ids_BS[:, start:start + c], all_ids[:, :kv_len], kv_len - c)
                 for start, kv_len in self._chunks(c)]
        return kernel, masks

    def __call__(self, q, k, v, prepared: Any, scale: float | None = None, sinks_H: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        refuse_window_sinks_softcap("context-parallel attention", None, sinks_H, softcap)
        # imported here: the module pulls in torch._dynamo (~1 s of every process start that never uses CP)
        from torch.nn.attention.bias import causal_lower_right

        c = q.shape[2] // 2
        k_all = zigzag_global_order(gather_seq(k, self.group, dim=2), self.cp, 2)
        v_all = zigzag_global_order(gather_seq(v, self.group, dim=2), self.cp, 2)
        gqa = q.shape[1] != k.shape[1]
        outs = []
        for j, (start, kv_len) in enumerate(self._chunks(c)):
            qj, kj, vj = q[:, :, start:start + c], k_all[:, :, :kv_len], v_all[:, :, :kv_len]
            if prepared is None:
                outs.append(F.scaled_dot_product_attention(qj, kj, vj, attn_mask=causal_lower_right(c, kv_len),
                                                           scale=scale, enable_gqa=gqa))
            else:
                kernel, masks = prepared
                outs.append(kernel.attend(qj, kj, vj, masks[j], scale))
        return torch.cat(outs, dim=2)


def attention_for(cp_group, documents: str = "auto", comm: str = "allgather") -> CausalAttention:
    """The attention strategy for a model under this CP group: context-parallel when it has several ranks.
    ``documents``: the document kernel (``train.document_attention``); ``comm``: how K/V cross the group
    (``parallel.cp_comm``): ``"allgather"`` (this module) or ``"ring"`` (``mmtrain.model.attention_ring``)."""
    if comm not in ("allgather", "ring"):
        raise ValueError(f"parallel.cp_comm must be 'allgather' or 'ring', got {comm!r}")
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        if comm == "ring":
            from mmtrain.model.attention_ring import RingContextParallelAttention

            return RingContextParallelAttention(cp_group, documents)
        return ContextParallelAttention(cp_group, documents)
    return CausalAttention(documents)
