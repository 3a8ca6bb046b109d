"""Tiny VLM shapes and hand-made multimodal batches shared by the VLM model tests."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from mmtrain.config.schema import ModelConfig
from mmtrain.config.vlm_schema import (
    AudioConfig,
    ProjectorConfig,
    VisionConfig,
    VLMModelConfig,
)

IMAGE_ID, AUDIO_ID = 60, 61
SEQ = 32


def tiny_vlm_config(audio: bool = True, position_embedding: str = "learned") -> VLMModelConfig:
    """16 px images, 4 px patches (4x4 grid), pixel shuffle 2 -> 4 tokens per image; 2 audio tokens per clip."""
    return VLMModelConfig(
        vision=VisionConfig(image_size=16, patch_size=4, hidden_size=32, num_layers=2, num_attention_heads=4,
                            ffn_hidden_size=64, position_embedding=position_embedding),
        audio=AudioConfig(enabled=audio, n_mels=16, n_fft=128, hop_length=64, hidden_size=32, num_layers=1,
                          num_attention_heads=2, ffn_hidden_size=64, num_tokens=2),
        projector=ProjectorConfig(num_layers=2, pixel_shuffle=2),
        language=ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                             num_query_groups=2, vocab_size=64),
        image_token_id=IMAGE_ID, audio_token_id=AUDIO_ID if audio else -1)


def make_batch(seed: int = 0, audio: bool = True) -> SimpleNamespace:
    """Two rows of SEQ tokens like the task encoder's: row 0 packs two samples (1 image + caption | 1 image +
    1 audio clip + caption), row 1 holds one sample with 2 images and padding. Labels -100 on media/padding."""
    g = torch.Generator().manual_seed(seed)
    T, A = 4, 2
    rows, counts_img, counts_aud = [], [], []
    samples = [[(1, 1 if audio else 0, 9), (1, 0, 8)], [(2, 0, 10)]]
    for row in samples:
        ids, doc, pos = [], [], []
        for d, (n_img, n_aud, n_text) in enumerate(row):
            sample = [IMAGE_ID] * (T * n_img) + [AUDIO_ID] * (A * n_aud)
            sample += torch.randint(0, 56, (n_text,), generator=g).tolist()
            ids += sample
            doc += [d] * len(sample)
            pos += list(range(len(sample)))
        rows.append((ids, doc, pos))
        counts_img.append(sum(s[0] for s in row))
        counts_aud.append(sum(s[1] for s in row))
    B = len(rows)
    tokens = torch.zeros(B, SEQ, dtype=torch.long)
    labels = torch.full((B, SEQ), -100, dtype=torch.long)
    position_ids = torch.zeros(B, SEQ, dtype=torch.long)
    document_ids = torch.full((B, SEQ), -1, dtype=torch.long)
    for b, (ids, doc, pos) in enumerate(rows):
        n = len(ids)
        tokens[b, :n] = torch.tensor(ids)
        nxt = torch.tensor(ids[1:] + [0])
        lab = nxt.clone()
        lab[(nxt == IMAGE_ID) | (nxt == AUDIO_ID)] = -100
        lab[torch.tensor(doc[1:] + [-2]) != torch.tensor(doc)] = -100  # no target across a sample boundary
        labels[b, :n] = lab
        position_ids[b, :n] = torch.tensor(pos)
        document_ids[b, :n] = torch.tensor(doc)
    n_aud = sum(counts_aud)
    audio_lengths = torch.tensor([700, 450][:n_aud], dtype=torch.long)
    wave = torch.zeros(n_aud, 700)
    for i, n in enumerate(audio_lengths.tolist()):
        wave[i, :n] = torch.randn(n, generator=g) * 0.1
    return SimpleNamespace(
        tokens=tokens, labels=labels, loss_mask=(labels != -100).float(), position_ids=position_ids,
        document_ids=document_ids, images=torch.randn(sum(counts_img), 3, 16, 16, generator=g),
        image_counts=torch.tensor(counts_img), audio=wave, audio_lengths=audio_lengths,
        audio_counts=torch.tensor(counts_aud), __key__=["s0,s1", "s2"])


def prep_text_and_media(root: Path, num_docs: int, num_images: int, num_audio: int,
                        media_weight: int) -> tuple[Path, Path]:
    """A text corpus and captioned images (energon shards), prepared by the public commands in-process, and a
    blend of both (text weight 1, media ``media_weight``): (blend file, SentencePiece model)."""
    from dataprep.cli import main as prep
    from dataprep.samples import write_sample_jsonl
    from dataprep.samples_media import write_media_samples

    corpus = write_sample_jsonl(root / "corpus.jsonl", num_docs=num_docs)
    manifest = write_media_samples(root / "media_src", num_images=num_images, num_audio=num_audio, video=False,
                                   conversations=0)
    assert prep(["train-tokenizer", "--input", str(corpus), "--output-prefix", str(root / "sp"),
                 "--vocab-size", "300"]) in (0, None)
    assert prep(["text", "--input", str(corpus), "--output-prefix", str(root / "text"), "--tokenizer",
                 str(root / "sp.model"), "--append-eod", "--workers", "1"]) in (0, None)
    assert prep(["media", "--input", str(manifest), "--output", str(root / "media"), "--workers", "1",
                 "--val-ratio", "0", "--no-progress"]) in (0, None)
    blend = root / "blend.yaml"
    blend.write_text(f"train:\n  - {{path: {root / 'text'}, weight: 1}}\n"
                     f"  - {{path: {root / 'media'}, type: energon, weight: {media_weight}}}\n")
    return blend, root / "sp.model"
