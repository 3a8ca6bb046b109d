"""GPT and multimodal loading over data-parallel ranks: one builder per node, identical indices on every rank, and
a resume at another data-parallel size that continues the single-process order exactly. One pair of spawned
ranks serves both tests (spawning is most of their time)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from mmtrain.data.blend import build_gpt_samples_from_config
from mmtrain.data.loader import MicroBatches
from mmtrain.parallel.launch import node_local_rank
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
    return {"gpt": _gpt_rank_steps(rank, world_size, tmp), "mm": _mm_rank_steps(rank, world_size, Path(tmp))}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both datasets written once, then 2 gloo ranks take their first steps of each."""
    tmp_path = tmp_path_factory.mktemp("dp")
    write_text_dataset(tmp_path / "a", num_docs=60, token_range=(1, 100), seed=1)
    write_text_dataset(tmp_path / "b", num_docs=40, token_range=(200, 300), seed=2)
    (tmp_path / "spec.yaml").write_text("datasets: '0.6 a 0.4 b'\n")
    _write_media_set(tmp_path / "mm")
    return tmp_path, run_distributed(_two_rank_steps, 2, str(tmp_path))


def _gpt_rank_steps(rank: int, world_size: int, tmp: str):
    # the launcher's local rank, read here at the top as a training script does: local rank 0 builds the indices
    samples = build_gpt_samples_from_config(_config(tmp), "train", world_size, index_builder=node_local_rank() == 0)
    batches = MicroBatches(samples, MBS, rank, world_size)
    # gbs = mbs * dp: one micro-batch per step. Returned as numpy: torch tensors would travel as shared memory
    # whose sender may exit before the parent reads it.
    taken = [batches.next().numpy() for _ in range(STEPS_BEFORE)]
    return {"built": samples.built or any(d.built for d in samples.datasets), "digest": _digest(samples),
            "batches": taken, "state": batches.state_dict()}


def test_resume_after_dp_change_continues_the_single_run_order(two_ranks):
    tmp_path, results = two_ranks
    tmp = str(tmp_path)
    r0, r1 = (r["gpt"] for r in results)
    assert r0["built"] and not r1["built"]  # local rank 0 built, local rank 1 waited and loaded
    assert r0["digest"] == r1["digest"] and r0["state"] == r1["state"] == {"consumed_samples": 4 * STEPS_BEFORE}

    # continue on one rank: same global batch as 2 micro-batches per step
    samples = build_gpt_samples_from_config(_config(tmp), "train", 1)
    assert _digest(samples) == r0["digest"] and not samples.built
    resumed = MicroBatches(samples, MBS, 0, 1)
    resumed.load_state_dict(r0["state"])
    after = [resumed.next() for _ in range(2 * (STEPS_TOTAL - STEPS_BEFORE))]

    single = MicroBatches(samples, MBS, 0, 1)
    reference = torch.cat([single.next() for _ in range(2 * STEPS_TOTAL)])
    before = torch.cat([torch.from_numpy(np.concatenate([b0, b1])) for b0, b1 in zip(r0["batches"], r1["batches"])])
    assert torch.equal(torch.cat([before, *after]), reference)


# ---- multimodal: the energon slices' order across data-parallel ranks ---------------------------------------

MM_STEPS = 3


def _write_media_set(root) -> None:
    import json

    import sentencepiece as spm

    from dataprep.cli import main as prep
    from dataprep.samples_media import write_media_samples

    manifest = write_media_samples(root / "in", num_images=16, num_audio=0, video=False, conversations=0)
    assert prep(["media", "--input", str(manifest), "--output", str(root / "a"), "--no-progress", "--val-ratio", "0",
                 "--workers", "1"]) == 0
    captions = [json.loads(line)["caption"] for line in manifest.read_text().splitlines()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(captions * 4), model_prefix=str(root / "sp"), vocab_size=300, model_type="bpe",
        byte_fallback=True, hard_vocab_limit=False, minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1)


def _mm_loader(root, mesh=None):
    from mmtrain.data.multimodal import MultimodalSettings
    from mmtrain.data.multimodal_loader import LoaderOptions, MultimodalLoader

    settings = MultimodalSettings(tokenizer=str(root / "sp.model"), seq_length=64, image_token_id=300,
                                  num_image_tokens=4, image_size=16, pack=True)
    return MultimodalLoader(root / "a", settings, LoaderOptions(micro_batch_size=2, num_slices=4,
                                                                packing_buffer_size=4), mesh=mesh)


def _mm_rank_steps(rank: int, world_size: int, root):
    from types import SimpleNamespace

    import torch.distributed as dist

    mesh = SimpleNamespace(coord=SimpleNamespace(dp=rank), dims=SimpleNamespace(dp=world_size),
                           dp_group=dist.group.WORLD)
    loader = _mm_loader(root / "mm", mesh)
    batches = [next(loader) for _ in range(MM_STEPS)]
    return {"keys": [b.__key__ for b in batches], "tokens": [b.tokens.numpy() for b in batches],
            "state": loader.global_state_dict()}


def test_multimodal_resume_after_dp_change_continues_the_single_run_order(two_ranks):
    """Two gloo ranks gather the loader state (all slices) and one process continues it: the ranks' batches,
    interleaved, then the continuation equal one process's uninterrupted order."""
    tmp_path, results = two_ranks
    tmp_path = tmp_path / "mm"
    r0, r1 = (r["mm"] for r in results)
    assert r0["state"] == r1["state"] and r0["state"]["consumed_micro_batches"] == 2 * MM_STEPS
    assert sorted(r0["state"]["slices"]) == ["0", "1", "2", "3"]

    resumed = _mm_loader(tmp_path)
    resumed.load_state_dict(r0["state"])
    after = [next(resumed) for _ in range(4)]
    single = _mm_loader(tmp_path)
    expected = [next(single) for _ in range(2 * MM_STEPS + 4)]
    got_keys = [k for pair in zip(r0["keys"], r1["keys"]) for k in pair] + [b.__key__ for b in after]
    got_tokens = [t for pair in zip(r0["tokens"], r1["tokens"]) for t in pair] + [b.tokens.numpy() for b in after]
    assert got_keys == [b.__key__ for b in expected]
    assert all(np.array_equal(a, b.tokens.numpy()) for a, b in zip(got_tokens, expected, strict=True))
