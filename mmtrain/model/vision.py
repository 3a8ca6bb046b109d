"""The ViT image encoder (SigLIP/CLIP-like), for one device.

Images (N, 3, H, W) -> patches (conv with stride = patch size) (+ a class token) -> + 2D positions (+ a temporal
row for video frames) -> optional norm (CLIP's pre_layrnorm) -> pre-norm *bidirectional* transformer blocks (the
LM's ``TransformerBlock`` with ``BidirectionalAttention``) -> optional final norm -> features (N, P, D). The features may be
an earlier block's output (``feature_layer``, LLaVA's ``vision_feature_layer``) and may drop the first token
(``drop_first_token``), so CLIP and SigLIP towers imported from Hugging Face (``mmtrain.models.encoders_hf``)
compute exactly what LLaVA takes from them. The blocks live in ``layers`` like the GPT's, so the GPT tensor-
parallel plan (``mmtrain.parallel.tensor.apply_tensor_parallel``) shards this encoder unchanged (without
sequence parallelism: its input, the images, is the same on every TP rank).

Dynamic resolution is tiling: ``tile_image`` cuts an image into up to ``max_tiles`` tiles of ``image_size``
(grid chosen by aspect ratio) plus a thumbnail of the whole image; each tile is then one image for the
encoder and for the placeholders. Video: frames are images; ``frame_index`` selects their temporal row.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.config.vlm_schema import VisionConfig
from mmtrain.model.attention import BidirectionalAttention
from mmtrain.model.layers import TransformerBlock, make_norm
from mmtrain.model.block_spec import encoder_sharding_spec


def _sincos_2d(grid: int, dim: int) -> torch.Tensor:
    """Fixed 2D sin-cos position table (grid*grid, dim): half the channels encode the row, half the column."""
    if dim % 4:
        raise ValueError(f"sincos2d positions need a width divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter))
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    out = []
    for coord in (rows.reshape(-1), cols.reshape(-1)):
        angles = coord[:, None].double() * omega[None]
        out += [angles.sin(), angles.cos()]
    return torch.cat(out, dim=1).float()


def _rope_2d_cos_sin(grid: int, head_dim: int, theta: float, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (1, P, 1, head_dim) for ``apply_rope``: the first half of the rotary pairs turn with the patch row,
    the second half with its column."""
    quarter = head_dim // 4
    inv_freq = 1.0 / (theta ** (torch.arange(quarter, dtype=torch.float32, device=device) / quarter))
    rows, cols = torch.meshgrid(torch.arange(grid, device=device), torch.arange(grid, device=device), indexing="ij")
    angles = torch.cat([rows.reshape(-1, 1) * inv_freq, cols.reshape(-1, 1) * inv_freq], dim=1)  # (P, hd/2)
    angles = torch.cat([angles, angles], dim=-1)[None, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def tile_image(image_CHW: torch.Tensor, tile: int, max_tiles: int) -> torch.Tensor:
    """Dynamic resolution: (n, 3, tile, tile) = the image resized onto the rows x cols grid (rows * cols <=
    max_tiles) whose aspect ratio is closest to the image's, cut into tiles, then a thumbnail of the whole image
    (no thumbnail when the grid is 1x1). Each tile takes one image's placeholders."""
    _, h, w = image_CHW.shape
    grids = [(r, c) for r in range(1, max_tiles + 1) for c in range(1, max_tiles + 1) if r * c <= max_tiles]
    aspect = w / h
    rows, cols = min(grids, key=lambda g: (abs(math.log(g[1] / g[0] / aspect)), -g[0] * g[1]))
    x = image_CHW[None].float()
    thumb = F.interpolate(x, size=(tile, tile), mode="bilinear", antialias=True, align_corners=False)
    if rows * cols == 1:
        return thumb
    big = F.interpolate(x, size=(rows * tile, cols * tile), mode="bilinear", antialias=True, align_corners=False)
    tiles = big.unfold(2, tile, tile).unfold(3, tile, tile)  # (1, 3, rows, cols, tile, tile)
    tiles = tiles.permute(0, 2, 3, 1, 4, 5).reshape(rows * cols, 3, tile, tile)
    return torch.cat([tiles, thumb])


class WholeSequenceEncoder:
    """The TP plan's members (``mmtrain.models.contract.TensorParallelModel``) of a media encoder: it runs on
    whole media sequences (never sequence-parallel) and has no output head."""

    def set_sequence_parallel(self, sequence_parallel: bool) -> None:
        if sequence_parallel:
            raise ValueError(f"{type(self).__name__}: a media encoder is never sequence-parallel")

    def swap_head(self, make_head) -> None:
        """No output head: nothing to swap."""


class VisionEncoder(nn.Module, WholeSequenceEncoder):
    """ViT over fixed-size images (or tiles/frames). ``forward(images_NCHW, frame_index_N=None)`` -> (N, P, D)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        block_cfg = cfg.block_config()
        self.patch_embed = nn.Conv2d(3, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size, bias=cfg.patch_bias)
        self.class_embed = nn.Parameter(torch.zeros(cfg.hidden_size)) if cfg.class_token else None
        self.pos_embed = (nn.Parameter(torch.zeros(cfg.num_positions, cfg.hidden_size))
                          if cfg.position_embedding == "learned" else None)
        if cfg.position_embedding == "sincos2d":
            self.register_buffer("pos_table", _sincos_2d(cfg.grid, cfg.hidden_size), persistent=False)
        self.temporal_embed = (nn.Embedding(cfg.max_video_frames, cfg.hidden_size) if cfg.temporal_embedding
                               else None)
        self.pre_norm = make_norm(block_cfg) if cfg.pre_norm else None
        self.layers = nn.ModuleDict({str(i): TransformerBlock(block_cfg, BidirectionalAttention())
                                     for i in range(cfg.num_layers)})
        self.norm = make_norm(block_cfg) if cfg.post_norm else None

    def sharding_spec(self):
        """Blocks sharded as the LM's, everything else replicated (``encoder_sharding_spec``); never sequence-
        parallel (the encoder runs on whole media sequences)."""
        return encoder_sharding_spec(self, self.cfg.block_config(), "vision").for_layout(False)

    @torch.no_grad()
    def init_weights(self, seed: int, prefix: str = "vision.") -> None:
        """Per-parameter init keyed by (seed, full name): the same values on every rank and stage layout."""
        init_by_name(self, seed, prefix, self.cfg.init_std, self.cfg.num_layers)

    def forward(self, images_NCHW: torch.Tensor, frame_index_N: torch.Tensor | None = None) -> torch.Tensor:
        c = self.cfg
        if images_NCHW.shape[-2:] != (c.image_size, c.image_size):
            raise ValueError(f"vision encoder: images of {tuple(images_NCHW.shape[-2:])} pixels, the model takes "
                             f"{c.image_size}x{c.image_size} (model.vision.image_size; the media path resizes to it)")
        dtype = self.patch_embed.weight.dtype
        x = self.patch_embed(images_NCHW.to(dtype)).flatten(2).transpose(1, 2)  # (N, P, D)
        if self.class_embed is not None:
            x = torch.cat([self.class_embed.to(x.dtype).expand(x.shape[0], 1, -1), x], dim=1)
        if self.pos_embed is not None:
            x = x + self.pos_embed
        elif c.position_embedding == "sincos2d":
            x = x + self.pos_table.to(x.dtype)
        if self.temporal_embed is not None:
            if frame_index_N is None:
                frame_index_N = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
            x = x + self.temporal_embed(frame_index_N.clamp(max=c.max_video_frames - 1))[:, None, :]
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        cos = sin = None
        if c.position_embedding == "rope2d":
            cos, sin = _rope_2d_cos_sin(c.grid, c.hidden_size // c.num_attention_heads, c.rope_theta, x.dtype,
                                       x.device)
        # feature_layer -k stops after block num_layers - k: the blocks after it (kept, so the weights round-trip
        # to the pretrained tower) do not run
        for i in range(c.num_layers + c.feature_layer + (1 if c.feature_layer else 0)):
            x = self.layers[str(i)](x, cos, sin, None)
        if c.feature_layer == 0 and self.norm is not None:
            x = self.norm(x)
        return x[:, 1:] if c.drop_first_token else x


@torch.no_grad()
def init_by_name(module: nn.Module, seed: int, prefix: str, std: float, num_layers: int) -> None:
    """GPT-style init keyed by (seed, ``prefix`` + parameter name): biases 0, norm weights 1, matrices normal(std),
    block output projections scaled by 1/sqrt(2 * num_layers)."""
    for name, p in module.named_parameters():
        full = prefix + name
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(full.encode()))
        if name.endswith("bias"):
            p.zero_()
        elif name == "class_embed":
            p.copy_(torch.randn(p.shape, generator=g) * std)
        elif p.ndim == 1:
            p.fill_(1.0)
        else:
            scale = std / (2 * max(num_layers, 1)) ** 0.5 if name.endswith(("proj.weight", "down.weight")) else std
            p.copy_(torch.randn(p.shape, generator=g) * scale)
