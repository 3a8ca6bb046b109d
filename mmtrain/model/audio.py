"""The optional Whisper-like audio encoder, for one device.

Waveforms (M, T) zero-padded with their lengths (M,) -> log-mel features (torchaudio ``MelSpectrogram``, log10,
Whisper's dynamic-range clamp and scaling, computed in fp32) -> conv stem (two conv1d k=3 with GELU, the second
stride 2: 10 ms frames become 20 ms positions) -> fixed sinusoidal positions -> pre-norm bidirectional
transformer blocks (padded frames hidden from attention) -> LayerNorm -> average pooling of each clip's *valid*
frames into ``num_tokens`` vectors (a fixed number of placeholders per clip, as the task encoder writes).
``encode_log_mel`` is the part after the features, what a Whisper encoder imported from Hugging Face
(``mmtrain.models.encoders_hf``) computes from its input features. The blocks live in ``layers``, so the GPT
tensor-parallel plan shards them like the vision encoder's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.config.vlm_schema import AudioConfig
from mmtrain.model.attention import BidirectionalAttention
from mmtrain.model.layers import TransformerBlock
from mmtrain.model.vision import WholeSequenceEncoder, init_by_name
from mmtrain.model.block_spec import encoder_sharding_spec


def _sinusoids(length: int, dim: int) -> torch.Tensor:
    """Whisper's fixed position table (length, dim): sin on the first half of the channels, cos on the second."""
    step = math.log(10000) / (dim // 2 - 1)
    inv = torch.exp(-step * torch.arange(dim // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None]
    return torch.cat([t.sin(), t.cos()], dim=1)


def pool_valid_frames(x_MFD: torch.Tensor, valid_M: torch.Tensor, n: int) -> torch.Tensor:
    """(M, n, D): token j of clip m averages frames [floor(j L/n), ceil((j+1) L/n)) of its L = valid_M[m] frames
    (never padding; every token covers at least one frame)."""
    f = x_MFD.shape[1]
    L = valid_M.clamp(min=1).to(torch.float32)[:, None, None]
    j = torch.arange(n, device=x_MFD.device, dtype=torch.float32)[None, :, None]
    frame = torch.arange(f, device=x_MFD.device, dtype=torch.float32)[None, None, :]
    start, end = torch.floor(j * L / n), torch.ceil((j + 1) * L / n)
    weights = ((frame >= start) & (frame < end)).to(x_MFD.dtype)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights @ x_MFD


class AudioEncoder(nn.Module, WholeSequenceEncoder):
    """``forward(audio_MT, lengths_M)`` -> (M, num_tokens, hidden_size) pooled encoder features."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        import torchaudio  # only audio models need it

        self.cfg = cfg
        block_cfg = cfg.block_config()
        # not a registered submodule: its window/filterbank stay fp32 whatever dtype the model is cast to (and it
        # is built on the CPU even when the model is built on the meta device)
        with torch.device("cpu"):
            self.__dict__["features"] = torchaudio.transforms.MelSpectrogram(
                sample_rate=cfg.sample_rate, n_fft=cfg.n_fft, hop_length=cfg.hop_length, n_mels=cfg.n_mels,
                power=2.0)
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.hidden_size, 3, padding=1)
        self.conv2 = nn.Conv1d(cfg.hidden_size, cfg.hidden_size, 3, stride=2, padding=1)
        if cfg.position_embedding == "learned":  # Whisper checkpoints store their (sinusoid-initialized) table
            self.pos_embed = nn.Parameter(_sinusoids(cfg.max_frames, cfg.hidden_size))
        else:
            self.register_buffer("positions", _sinusoids(cfg.max_frames, cfg.hidden_size), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(block_cfg, BidirectionalAttention())
                                     for i in range(cfg.num_layers)})
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def sharding_spec(self):
        """Blocks sharded as the LM's, everything else replicated (``encoder_sharding_spec``); never sequence-
        parallel (the encoder runs on whole media sequences)."""
        return encoder_sharding_spec(self, self.cfg.block_config(), "audio").for_layout(False)

    @torch.no_grad()
    def init_weights(self, seed: int, prefix: str = "audio.") -> None:
        init_by_name(self, seed, prefix, self.cfg.init_std, self.cfg.num_layers)
        if self.cfg.position_embedding == "learned":  # starts as the fixed table (as Whisper's does)
            self.pos_embed.copy_(_sinusoids(self.cfg.max_frames, self.cfg.hidden_size))

    def log_mel(self, audio_MT: torch.Tensor) -> torch.Tensor:
        """(M, n_mels, frames) Whisper-scaled log-mel features, fp32: ``samples // hop_length`` frames, as Whisper
        has (the centred spectrogram's last frame dropped), so 30 s at 10 ms hops is 3000 frames, 1500 positions."""
        mel = self.features.to(audio_MT.device)(audio_MT.float())[..., :-1]
        log = mel.clamp(min=1e-10).log10()
        log = torch.maximum(log, log.amax(dim=(1, 2), keepdim=True) - 8.0)
        return (log + 4.0) / 4.0

    def forward(self, audio_MT: torch.Tensor, lengths_M: torch.Tensor) -> torch.Tensor:
        feats = self.log_mel(audio_MT)
        frames = (feats.shape[-1] + 1) // 2
        if frames > self.cfg.max_frames:
            raise ValueError(f"audio encoder: a clip of {audio_MT.shape[1]} samples gives {frames} positions, more "
                             f"than model.audio.max_frames={self.cfg.max_frames}; cut clips shorter "
                             "(media.max_audio_seconds) or raise max_frames")
        # valid positions: the clip's spectrogram frames (len // hop), halved (rounded up) by the stem
        valid = (lengths_M.to(feats.device) // self.cfg.hop_length + 1) // 2
        return pool_valid_frames(self.encode_log_mel(feats, valid), valid, self.cfg.num_tokens)

    def encode_log_mel(self, mel_MCF: torch.Tensor, valid_M: torch.Tensor | None = None) -> torch.Tensor:
        """(M, positions, D) encoder features of log-mel features (M, n_mels, frames): the conv stem, positions,
        blocks and final LayerNorm (what Whisper's encoder computes from its input features). ``valid_M``: each
        clip's valid positions (padded ones are hidden from attention); None = all valid."""
        x = F.gelu(self.conv1(mel_MCF.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # (M, F, D)
        frames = x.shape[1]
        if frames > self.cfg.max_frames:
            raise ValueError(f"audio encoder: {mel_MCF.shape[-1]} feature frames give {frames} positions, more than "
                             f"model.audio.max_frames={self.cfg.max_frames}")
        table = self.pos_embed if self.cfg.position_embedding == "learned" else self.positions
        x = x + table[:frames].to(x.dtype)
        mask = None
        if valid_M is not None:
            keep_MF = torch.arange(frames, device=x.device)[None] < valid_M.to(x.device)[:, None]
            mask = keep_MF[:, None, None, :]  # (M, 1, 1, F): every query sees the clip's valid frames only
        for layer in self.layers.values():
            x = layer(x, None, None, mask)
        return self.norm(x)
