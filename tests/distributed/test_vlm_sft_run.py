"""VLM SFT: pretrain_vlm's loop on chat shards (images in user turns, `mmtrain-prep media --tokenizer`) counts
the loss on the assistant tokens only: its first step's loss equals a direct fp64 computation over exactly the
tokens the prep's mask marks, from the same initial weights and the same first batch; the loss falls."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

from dataprep.cli import main as prep
from mmtrain.config import load_config
from mmtrain.config.vlm_run_schema import VLMRunConfig
from mmtrain.config.vlm_validate import validate_vlm_config
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from tests.sft_helpers import IMAGE_TOKEN, build_vlm_chat_input

pytest.importorskip("megatron.energon")
pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument:UserWarning")

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "vlm" / "sft_tiny_cpu.yaml"
SMALL = ["train.steps=3", "train.global_batch_size=2", "model.vision.num_layers=1", "model.language.num_layers=1",
         "logging.log_every=100", "checkpoint.keep_last=0", "optim.lr=3e-3"]


def _cfg(run_dir: str, blend: str, tok: str) -> VLMRunConfig:
    return load_config(VLMRunConfig, CONFIG, [*SMALL, f"logging.run_dir={run_dir}", f"data.blend={blend}",
                                              f"media.tokenizer={tok}"])


def _stored_chats(folder: Path) -> dict[str, dict]:
    chats = {}
    for shard in folder.glob("shard-*.tar"):
        with tarfile.open(shard) as tar:
            for m in tar:
                if m.name.endswith(".json"):
                    chats[m.name.split(".", 1)[0]] = json.loads(tar.extractfile(m).read())["chat"]
    return chats


def _run_and_recompute(rank: int, world_size: int, run_dir: str, blend: str, tok: str):
    from mmtrain.data.vlm_sources import build_vlm_batches
    from mmtrain.models.vlm import VLMModel
    from mmtrain.train.vlm_train import train_vlm

    cfg = _cfg(run_dir, blend, tok)
    validate_vlm_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    losses = train_vlm(cfg, mesh, torch.device("cpu")).losses

    # the same first batch and initial weights, and the loss written out from the prep's own tokens and mask
    batch = build_vlm_batches(cfg, mesh, "train").next()
    model = VLMModel(cfg.model)
    model.init_weights(cfg.train.seed)
    with torch.no_grad():
        logits = model(batch.tokens, None, batch.position_ids, None, images=batch.images,
                       image_counts=batch.image_counts, frame_index=batch.frame_index, audio=batch.audio,
                       audio_lengths=batch.audio_lengths, audio_counts=batch.audio_counts)
    logp = torch.log_softmax(logits.double(), dim=-1)
    chats, n_img = _stored_chats(Path(blend)), cfg.model.tokens_per_image
    expanded = {}
    for key, chat in chats.items():
        ids, target = [], []
        for t, m in zip(chat["tokens"], chat["loss_mask"]):
            ids += [cfg.model.image_token_id] * n_img if t == -1 else [t]
            target += [0] * n_img if t == -1 else [m]
        expanded[key] = ids, target
    total, count, keys = torch.zeros((), dtype=torch.float64), 0, []
    for row in range(batch.tokens.shape[0]):
        tokens = batch.tokens[row].tolist()
        key = next((k for k, (ids, _) in expanded.items() if tokens[:len(ids) - 1] == ids[:-1]), None)
        assert key is not None, (tokens, {k: v[0] for k, v in expanded.items()})  # the row's sample, whole
        ids, target = expanded[key]
        for j in range(1, len(ids)):
            if target[j]:  # token j is the assistant's: predicted from position j - 1
                total -= logp[row, j - 1, ids[j]]
                count += 1
        keys.append(key)
    return losses, float(total / count), count, int((batch.tokens != 0).sum()), keys


def test_vlm_sft_loss_is_the_assistant_tokens_loss(tmp_path):
    tok, manifest = build_vlm_chat_input(tmp_path / "data", copies=2)
    shards = tmp_path / "shards"
    assert prep(["media", "--input", str(manifest), "--output", str(shards), "--tokenizer", str(tok),
                 "--chat-template", "chatml", "--workers", "1", "--val-ratio", "0", "--no-progress"]) == 0
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tok / "tokenizer.json")).get_vocab()
    cfg = _cfg("unused", str(shards), str(tok))
    assert max(vocab.values()) < cfg.model.image_token_id < cfg.model.language.vocab_size  # the config fits it
    losses, direct, count, nonpad, keys = run_distributed(_run_and_recompute, 1, str(tmp_path / "run"),
                                                         str(shards), str(tok))[0]
    assert len(keys) == 2 and 0 < count < nonpad / 2  # prompts, system turns and placeholders carry no loss
    assert losses[0] == pytest.approx(direct, rel=1e-5)
    assert losses[-1] < losses[0]
