"""Precompute the DPO reference's log-probabilities of every preference pair once (``python -m
mmtrain.dpo_reference``), so that ``dpo.reference_logps: precomputed`` runs train without a reference model.

The reference is the one a DPO run of the same config would build (``build_reference``: ``dpo.reference``, else
the weights-only ``checkpoint.load``, else the seeded init) in the run's layout; every pair of the prefix (all
splits) goes through it forward-only with the run's ``data.seq_length`` and micro-batch size, and the last
pipeline stage's first TP/DP rank writes the table (``mmtrain.data.reference_logps``: atomic, checksummed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mmtrain.core.indexed import IndexedDataset
from mmtrain.data.preference_dataset import PreferencePairs
from mmtrain.data.prepared_names import preference_prefixes
from mmtrain.data.reference_logps import write_reference_logps
from mmtrain.train.build import build_gpt_stage
from mmtrain.train.checkpoint import find_checkpoint
from mmtrain.train.dpo import build_reference, pair_inputs, sequence_logps
from mmtrain.train.loop import schedule_micro_batches
from mmtrain.utils.log import get_logger


@torch.no_grad()
def compute_reference_logps(cfg, mesh, device: torch.device) -> Path | None:
    """Write ``PREFIX.dpo_reference.{bin,json}`` for the run ``cfg``; returns the record's path on the writing
    rank, None elsewhere."""
    prefix = str(Path(cfg.data.prefixes[0]).absolute())
    found = find_checkpoint(cfg.checkpoint.load, cfg.logging.run_dir)
    reference = build_reference(cfg, mesh, device, found, build_gpt_stage)
    count = len(IndexedDataset(preference_prefixes(prefix)[0]))
    pairs = PreferencePairs(prefix, cfg.data.seq_length, cfg.data.seed, count, (0, count), with_index=True)
    mbs, S = cfg.train.micro_batch_size, cfg.data.seq_length
    order = list(range(count)) + [0] * (-count % mbs)  # the first epoch holds every pair once; pad the last batch
    micro = [torch.stack([torch.as_tensor(pairs[i]) for i in order[k:k + mbs]]) for k in range(0, len(order), mbs)]
    values = np.zeros((count, 2), np.float64)

    def step(i, received, module=reference):
        inputs, labels, positions, doc_ids, mask = pair_inputs(micro[i].to(device))
        out = module(inputs if module.pre_process else received, labels if module.post_process else None,
                     positions, doc_ids)
        if module.post_process:
            logps = sequence_logps(out, mask).double().cpu().numpy()
            docs = micro[i][:, 8, 0].numpy()
            for row in range(min(mbs, count - i * mbs)):  # not the padding rows
                values[docs[row]] = (logps[row], logps[mbs + row])
        return out

    schedule_micro_batches(step, len(micro), reference, mesh, cfg, device, None,
                           (2 * mbs, S, cfg.model.shape().hidden_size))
    if not (reference.post_process and mesh.coord.tp == 0 and mesh.coord.dp == 0 and mesh.coord.cp == 0):
        return None
    source = cfg.dpo.reference or (str(found) if found is not None else f"seeded init (train.seed={cfg.train.seed})")
    record = write_reference_logps(prefix, values, S, source)
    get_logger("train").info(f"wrote the reference log-probs of {count} pairs to {record}")
    return record
