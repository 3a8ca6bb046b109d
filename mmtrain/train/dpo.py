"""Direct preference optimization (``train.objective=dpo``): the policy learns to prefer the chosen answer over the
rejected one relative to a frozen reference model (Rafailov et al. 2023; IPO: Azar et al. 2023).

Per pair, with sequence log-probabilities ``log p(answer | prompt)`` summed over the answer's loss-mask tokens,
``h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))``; the sigmoid loss is ``-log sigmoid(beta * h)``.
IPO's is ``(h - 1 / (2 beta))^2`` with each answer's log-probabilities (policy and reference) divided by its
number of loss tokens first, as TRL's ``loss_type="ipo"`` does (the IPO authors' length-averaged log-likelihood).
The implicit rewards ``beta * (log pi - log ref)`` of both answers (length-averaged under IPO, as TRL logs them),
their margin and how often the chosen one wins are logged. A micro-batch of B pairs runs as one batch of 2B sequences
(chosen then rejected) through the same pipeline schedule, once forward-only through the reference (no
gradients) and once through the policy; the loss sum is divided by the global pair count like a token loss.
The reference is built like the policy (same layout) without LoRA adapters and loaded with the run's initial
weights (``dpo.reference``, else the weights-only checkpoint the run starts from, else the same seeded init).
With ``dpo.reference_logps: precomputed`` no reference is built: its log-probs come from the table
``compute_reference_logps`` wrote beside the shards (``mmtrain.data.reference_logps``), looked up by each
sample's pair index (the ninth row), and the step runs the policy only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mmtrain.data.sft_dataset import sft_step_inputs
from mmtrain.train.checkpoint import is_weights_only


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
               ref_rejected: torch.Tensor, beta: float, kind: str = "sigmoid",
               chosen_tokens: torch.Tensor | None = None, rejected_tokens: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards) from per-pair sequence log-probs (sums over each
    answer's loss tokens). ``ipo`` needs ``chosen_tokens`` / ``rejected_tokens``, each answer's loss-token count:
    its log-ratio is divided by it (TRL's IPO; an answer cut down to no loss token counts as one)."""
    chosen = policy_chosen - ref_chosen
    rejected = policy_rejected - ref_rejected
    if kind == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo.loss=ipo needs each answer's loss-token count")
        chosen = chosen / chosen_tokens.clamp(min=1).to(chosen.dtype)
        rejected = rejected / rejected_tokens.clamp(min=1).to(rejected.dtype)
    h = chosen - rejected
    if kind == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif kind == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"dpo.loss={kind!r}; expected sigmoid or ipo")
    return losses, (beta * chosen).detach(), (beta * rejected).detach()


def pair_inputs(batch_B8S1: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A micro-batch of pairs as 2B sequences (chosen rows first): sft_step_inputs of them (a ninth row, the
    pair index, is not an input)."""
    return sft_step_inputs(torch.cat([batch_B8S1[:, :4], batch_B8S1[:, 4:8]], dim=0))


def table_logps(batch_B9S1: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The precomputed reference log-probs of a micro-batch's 2B sequences (chosen first), from ``table``
    (pairs, 2) by the pair index in row 8, in fp32 as the reference model's ``sequence_logps`` gives them."""
    index = batch_B9S1[:, 8, 0].to(table.device)
    return torch.cat([table[index, 0], table[index, 1]]).float()


def sequence_logps(token_losses_BS: torch.Tensor, loss_mask_BS: torch.Tensor) -> torch.Tensor:
    """Sum of the log-probabilities of the loss-mask tokens per sequence (token losses are -log p)."""
    return -(token_losses_BS.float() * loss_mask_BS).sum(dim=-1)


def run_dpo_micro_batches(stage, reference, micro_batches: list[torch.Tensor], mesh, cfg, device, buckets,
                          schedule, table: torch.Tensor | None = None) -> torch.Tensor:
    """Reference forward pass (or, with ``table``, the precomputed reference log-probs), then the policy's
    forward (and backward when ``buckets`` is given), each through ``schedule`` (the loop's
    ``schedule_micro_batches``); returns [loss sum, pairs, chosen reward sum, rejected reward sum, pairs the
    chosen answer wins] (non-zero on the last stage)."""
    stats = torch.zeros(5, device=device, dtype=torch.float64)
    ref_logps: list[torch.Tensor | None] = [None] * len(micro_batches)
    if table is not None:
        ref_logps = [table_logps(b, table) for b in micro_batches]
    mbs, S = micro_batches[0].shape[0], micro_batches[0].shape[-1] - 1
    shape = (2 * mbs, S, cfg.model.shape().hidden_size)
    d = cfg.dpo

    def run(module, i, received):
        """(output, None) off the last stage; there (token losses, sequence log-probs, loss tokens per sequence)."""
        inputs, labels, positions, doc_ids, mask = pair_inputs(micro_batches[i].to(device, non_blocking=True))
        out = module(inputs if module.pre_process else received, labels if module.post_process else None,
                     positions, doc_ids)
        return out, ((sequence_logps(out, mask), mask.sum(dim=-1)) if module.post_process else None)

    def reference_step(i, received, module=reference):
        with torch.no_grad():
            out, last = run(module, i, received)
        if last is not None:
            ref_logps[i] = last[0]
        return out

    def policy_step(i, received, module=stage):
        out, last = run(module, i, received)
        if last is None:
            return out
        logps, tokens = last
        n = logps.shape[0] // 2
        ref = ref_logps[i]
        losses, chosen, rejected = dpo_losses(logps[:n], logps[n:], ref[:n], ref[n:], d.beta, d.loss,
                                              tokens[:n], tokens[n:])
        total = losses.sum()
        stats[0] += total.detach().double()
        stats[1] += n
        stats[2] += chosen.sum().double()
        stats[3] += rejected.sum().double()
        stats[4] += (chosen > rejected).sum().double()
        return total

    if table is None:
        schedule(reference_step, len(micro_batches), reference, mesh, cfg, device, None, shape)
    schedule(policy_step, len(micro_batches), stage, mesh, cfg, device, buckets, shape)
    return stats


def dpo_metrics(stats: torch.Tensor, dt: float) -> dict:
    pairs = max(float(stats[1]), 1.0)
    chosen, rejected = float(stats[2]) / pairs, float(stats[3]) / pairs
    return {"reward_chosen": chosen, "reward_rejected": rejected, "reward_margin": chosen - rejected,
            "reward_accuracy": float(stats[4]) / pairs}


def build_reference(cfg, mesh, device, found, build_stage):
    """The frozen reference: the policy's layout without adapters, with the run's initial weights."""
    from mmtrain.convert.checkpoint_io import load_model_weights  # as train_gpt loads weights-only checkpoints

    ref_cfg = dataclasses.replace(cfg, peft=dataclasses.replace(
        cfg.peft, lora=dataclasses.replace(cfg.peft.lora, rank=0)))
    reference = build_stage(ref_cfg, mesh, device)
    source = cfg.dpo.reference or (found if found is not None and is_weights_only(found) else None)
    if source is None and found is not None:
        raise ValueError(f"resuming the DPO run from {found} needs dpo.reference: the weights-only checkpoint it "
                         "started from (the reference must stay the initial model)")
    if source is not None:
        load_model_weights(source, mesh, reference, run_model_cfg=cfg.model, verify=cfg.checkpoint.verify)
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference.eval()
