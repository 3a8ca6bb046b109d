"""Build this rank's piece of the VLM, and run one micro-batch of it (the VLM's ``forward_step``).

Layout (see docs/vlm.md for the why):
- TP: the GPT plan shards the LM *and* the vision/audio encoders' blocks (same ``layers`` of
  ``TransformerBlock``s), encoders without sequence parallelism; projectors and patch/position embeddings are
  replicated. Under SP the LM embedding all-reduces (not reduce-scatters) so the whole sequence can be spliced,
  then ``split_seq`` keeps this TP rank's rows.
- PP: stage 0 holds the encoders, projectors and the embedding; stages hold the LM layers of
  ``stage_layer_ranges`` under their global names (``language.layers.<i>``). Activations between stages have
  the GPT's shape (micro_batch, seq / cp [/ tp with SP], LM hidden). No virtual stages.
- CP: every CP rank encodes all of the micro-batch's media and splices the whole sequence, then keeps its
  zig-zag chunks (``shard_sequence``); the encoders' gradients, partial per CP rank, are summed by the dp×cp
  gradient reduction like every other parameter's.
"""

from __future__ import annotations

from functools import partial

import torch

from mmtrain.config.loader import ConfigError
from mmtrain.model.attention_cp import attention_for
from mmtrain.models.vlm import VLMModel
from mmtrain.parallel.comm import split_seq
from mmtrain.parallel.context import shard_sequence
from mmtrain.parallel.dims import ParallelMesh
from mmtrain.parallel.expert import apply_expert_parallel
from mmtrain.parallel.pipeline import stage_layer_ranges
from mmtrain.parallel.tensor import apply_tensor_parallel
from mmtrain.train.build import moe_dispatch_for
from mmtrain.utils.host_copy import to_device


def _shard_spliced(x_BSD: torch.Tensor, cp: int, cp_rank: int, tp_group, sequence_parallel: bool) -> torch.Tensor:
    x = shard_sequence(x_BSD, cp, cp_rank)
    return split_seq(x, tp_group) if sequence_parallel else x


def _apply_vlm_parallel(model: VLMModel, mesh: ParallelMesh, sequence_parallel: bool = False) -> VLMModel:
    """Shard a (stage of a) ``VLMModel`` in place over the mesh's TP (and EP for an MoE LM) groups, and set up
    the spliced sequence's CP/SP split (CP attention is the strategy the LM was built with)."""
    tp = mesh.dims.tp
    sp = sequence_parallel and tp > 1
    lm = model.language
    apply_tensor_parallel(lm, mesh.tp_group, sp)
    if lm.cfg.num_experts:
        apply_expert_parallel(lm, mesh.ep_group)
    for encoder in (model.vision, model.audio):
        if encoder is not None:
            apply_tensor_parallel(encoder, mesh.tp_group, False)
    if model.pre_process:
        if sp:  # the embedding returns the whole sequence; the split happens after splicing
            lm.embed.sequence_parallel = False
        if mesh.dims.cp > 1 or sp:
            model.sequence_shard_fn = partial(_shard_spliced, cp=mesh.dims.cp, cp_rank=mesh.coord.cp,
                                              tp_group=mesh.tp_group, sequence_parallel=sp)
    return model


def build_vlm_stage(cfg, mesh: ParallelMesh, device: torch.device) -> VLMModel:
    """This rank's VLM stage, initialized as the whole model would be, sharded per ``mesh``, with the recompute/
    compile flags of ``cfg.train``, on ``device``. ``cfg``: a VLM run config (``model``: ``VLMModelConfig``,
    ``parallel``, ``train`` as in the GPT run config)."""
    p, t = cfg.parallel, cfg.train
    if p.virtual_pp > 1:
        raise ConfigError("parallel.virtual_pp > 1 is not supported for the VLM; use plain pipeline stages")
    pp, stage = mesh.dims.pp, mesh.coord.pp
    ranges = stage_layer_ranges(cfg.model.language.num_layers, pp, p.pipeline_layers)
    dispatch = moe_dispatch_for(p, mesh) if cfg.model.language.num_experts else None
    model = VLMModel(cfg.model, ranges[stage], pre_process=stage == 0, post_process=stage == pp - 1,
                     attention=attention_for(mesh.cp_group, t.document_attention, p.cp_comm), moe_dispatch=dispatch)
    model.init_weights(t.seed)
    _apply_vlm_parallel(model, mesh, p.sequence_parallel)
    encoders = [e for e in (model.vision, model.audio) if e is not None]
    for block in [b for e in (model.language, *encoders) for b in e.layers.values()]:
        block.set_recompute(t.activation_checkpointing)
        if t.compile and not model.cfg.language.num_experts:
            block.compile_parts("block")
    if t.compile and mesh.dims.tp == 1:  # the last stage's head
        model.language.compile_head()
    if device.type == "cuda" and t.attention_backend != "auto":
        chosen = t.attention_backend
        torch.backends.cuda.enable_flash_sdp(chosen == "flash")
        torch.backends.cuda.enable_cudnn_sdp(chosen == "cudnn")
        torch.backends.cuda.enable_mem_efficient_sdp(chosen == "efficient")
        torch.backends.cuda.enable_math_sdp(chosen == "math")
    return model.to(device)


def vlm_forward_step(module: VLMModel, batch, received: torch.Tensor | None, mesh: ParallelMesh,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One micro-batch (a ``MultimodalBatch``) through this rank's stage: returns (output, summed token loss,
    loss-token count). On the last stage ``output`` is the summed loss to call backward on; elsewhere it is the
    hidden states to send on (loss and count None). ``received``: the previous stage's output (stages > 0).

    Per-token tensors are cut to this rank's context-parallel chunks here; the tokens go whole to the first
    stage (it splices media, then shards). Document ids are passed only for packed batches (several samples in a
    row), so unpacked batches keep the plain causal kernel. A batch on the host (as the loader hands it) has its
    placeholders checked here, before the copies (``MediaPlaceholderError`` naming the sample), so nothing in the
    step reads the device back; the copies go through pinned memory (``to_device``), so they never wait for the
    GPU's queue."""
    cp, cp_rank = mesh.dims.cp, mesh.coord.cp
    labels, positions, loss_mask = (shard_sequence(to_device(t, device), cp, cp_rank)
                                    for t in (batch.labels, batch.position_ids, batch.loss_mask))
    doc_ids = None
    if int(batch.document_ids.max()) > 0:
        doc_ids = shard_sequence(to_device(batch.document_ids, device), cp, cp_rank)
    if module.pre_process:
        keys = getattr(batch, "__key__", None)
        # the placeholder check on the host copy, before it goes to the device: the splice then reads nothing back
        # (a device->host sync mid-forward would drain the GPU's queue every step)
        on_host = batch.tokens.device.type == "cpu"
        if on_host:
            module.check_media_placeholders(batch.tokens, batch.image_counts, batch.images.shape[0],
                                            batch.audio_counts, batch.audio.shape[0], keys)
        # frame_index: each image's temporal row (video frames); every TP/CP rank of stage 0 encodes all media
        frame_index = getattr(batch, "frame_index", None)
        media = {"images": to_device(batch.images, device), "image_counts": batch.image_counts,
                 "frame_index": to_device(frame_index, device),
                 "audio": to_device(batch.audio, device), "audio_lengths": batch.audio_lengths,
                 "audio_counts": batch.audio_counts, "sample_keys": keys, "placeholders_checked": on_host}
        out = module(to_device(batch.tokens, device), labels if module.post_process else None,
                     positions, doc_ids, **media)
    else:
        out = module(received, labels if module.post_process else None, positions, doc_ids)
    if not module.post_process:
        return out, None, None
    total = (out * loss_mask).sum()
    return total, total.detach(), loss_mask.sum().detach()
