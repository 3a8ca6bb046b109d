"""GPT loading over data-parallel ranks: one builder per node, identical indices on every rank, and a resume
at another data-parallel size that continues the single-process order exactly."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from mmtrain.data.gpt_dataset import build_gpt_samples_from_config
from mmtrain.data.loader import MicroBatches
from mmtrain.testing import run_distributed
from tests.data_helpers import run_config, write_text_dataset

MBS, STEPS_BEFORE, STEPS_TOTAL = 2, 3, 7


def _config(tmp: str):
    cfg = run_config(tmp, blend=f"{tmp}/spec.yaml")
    cfg.train.steps, cfg.train.micro_batch_size, cfg.train.global_batch_size = STEPS_TOTAL, MBS, 2 * MBS
    return cfg


def _digest(samples) -> str:
    h = hashlib.sha256()
    for d in samples.datasets:
        for a in (d.document_index, d.sample_index, d.shuffle_index):
            h.update(np.ascontiguousarray(a).tobytes())
    h.update(np.ascontiguousarray(samples.dataset_index).tobytes())
    return h.hexdigest()


def _two_rank_steps(rank: int, world_size: int, tmp: str):
    samples = build_gpt_samples_from_config(_config(tmp), split="train", dp_size=world_size)
    batches = MicroBatches(samples, MBS, rank, world_size)
    # gbs = mbs * dp: one micro-batch per step. Returned as numpy: torch tensors would travel as shared memory
    # whose sender may exit before the parent reads it.
    taken = [batches.next().numpy() for _ in range(STEPS_BEFORE)]
    return {"built": samples.built or any(d.built for d in samples.datasets), "digest": _digest(samples),
            "batches": taken, "state": batches.state_dict()}


def test_resume_after_dp_change_continues_the_single_run_order(tmp_path):
    tmp = str(tmp_path)
    write_text_dataset(tmp_path / "a", num_docs=60, token_range=(1, 100), seed=1)
    write_text_dataset(tmp_path / "b", num_docs=40, token_range=(200, 300), seed=2)
    (tmp_path / "spec.yaml").write_text("datasets: '0.6 a 0.4 b'\n")
    r0, r1 = run_distributed(_two_rank_steps, 2, tmp)
    assert r0["built"] and not r1["built"]  # LOCAL_RANK 0 built, LOCAL_RANK 1 waited and loaded
    assert r0["digest"] == r1["digest"] and r0["state"] == r1["state"] == {"consumed_samples": 4 * STEPS_BEFORE}

    # continue on one rank: same global batch as 2 micro-batches per step
    samples = build_gpt_samples_from_config(_config(tmp), split="train", dp_size=1)
    assert _digest(samples) == r0["digest"] and not samples.built
    resumed = MicroBatches(samples, MBS, 0, 1)
    resumed.load_state_dict(r0["state"])
    after = [resumed.next() for _ in range(2 * (STEPS_TOTAL - STEPS_BEFORE))]

    single = MicroBatches(samples, MBS, 0, 1)
    reference = torch.cat([single.next() for _ in range(2 * STEPS_TOTAL)])
    before = torch.cat([torch.from_numpy(np.concatenate([b0, b1])) for b0, b1 in zip(r0["batches"], r1["batches"])])
    assert torch.equal(torch.cat([before, *after]), reference)
