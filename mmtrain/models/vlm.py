"""The vision(-audio)-language model: encoders -> projectors -> spliced into the GPT's token embeddings.

Components (parameter-name prefixes, used by freezing and per-component optimizer groups): ``vision``
(``VisionEncoder``), ``audio`` (``AudioEncoder``, optional), ``projector`` (``projector.image`` and
``projector.audio``), ``language`` (the language model's family's unchanged stage, built through the registry;
its own parameter names follow the prefix).

Splicing: the task encoder (``mmtrain.data.multimodal``) writes ``tokens_per_image`` copies of
``image_token_id`` per image (``tokens_per_audio`` of ``audio_token_id`` per clip) and stacks the batch's
images in row-major placeholder order. Each row's placeholder count is checked against its media count (an
error names the sample): the training step checks its batch on the host, before the copy to the device
(``check_media_placeholders``), and tells the splice so; ``splice_media`` checks itself otherwise (free on the
CPU; on a GPU it reads the counts back, a sync that would drain the device's queue mid-step). The first stage
embeds the tokens and writes the projected features into the placeholder positions in that same order
(``masked_scatter``, differentiable both ways); ``unsplice_media`` reads them back.

Pipeline parallelism: like the GPT, a stage holds the global LM layers of ``layer_range``; only the first stage
holds the encoders and projectors. Context/sequence parallelism: the first stage splices the *whole* sequence
(media may land anywhere), then ``sequence_shard_fn`` (set by ``mmtrain.train.build_vlm``) keeps this rank's part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from mmtrain.config.vlm_schema import VLMModelConfig
from mmtrain.model.projector import Projector
from mmtrain.model.vision import VisionEncoder, init_by_name
from mmtrain.models.registry import model_family
from mmtrain.models.spec import REPLICATED, ShardingSpec, merge_specs

IGNORE_INDEX = -100  # the task encoder's label of non-target positions
COMPONENTS = ("vision", "audio", "projector", "language")


class MediaPlaceholderError(ValueError):
    """A sample's placeholder tokens do not match its media (count or tokens per item)."""


def _sample_name(keys: Sequence[str] | None, row: int) -> str:
    return f"sample {keys[row]!r} (batch row {row})" if keys is not None and row < len(keys) else f"batch row {row}"


def check_placeholders(tokens_BS: torch.Tensor, token_id: int, counts_B: torch.Tensor | None, n_items: int,
                       tokens_per_item: int, what: str = "image", sample_keys: Sequence[str] | None = None) -> None:
    """Raise ``MediaPlaceholderError`` naming the sample when a row's ``token_id`` placeholders are not
    ``counts_B[b] * tokens_per_item``, or the counts do not sum to ``n_items``. Reads the tensors on the host: call
    it on host tensors (on a GPU's it is a device->host sync)."""
    per_row = (tokens_BS == token_id).sum(dim=1).cpu()
    counts = torch.zeros_like(per_row) if counts_B is None else counts_B.cpu().to(per_row.dtype)
    if int(counts.sum()) != n_items:
        raise MediaPlaceholderError(f"{what} counts per row {counts.tolist()} sum to {int(counts.sum())} but the "
                                    f"batch holds {n_items} {what}(s)")
    T = tokens_per_item if n_items else 0
    expected = counts * T
    bad = (per_row != expected).nonzero().flatten().tolist()
    if bad:
        b = bad[0]
        raise MediaPlaceholderError(
            f"{_sample_name(sample_keys, b)}: {int(per_row[b])} {what} placeholder token(s) (id {token_id}) but "
            f"{int(counts[b])} {what}(s) x {T} tokens = {int(expected[b])}; the data's tokens per {what} "
            "(model.tokens_per_image, model.audio.num_tokens) must match the model's, and the text must not contain "
            "the placeholder id")


def splice_media(x_BSD: torch.Tensor, tokens_BS: torch.Tensor, token_id: int, feats_NTD: torch.Tensor | None,
                 counts_B: torch.Tensor | None, what: str = "image",
                 sample_keys: Sequence[str] | None = None, checked: bool = False) -> torch.Tensor:
    """``x_BSD`` with the placeholder positions of ``token_id`` replaced by ``feats_NTD`` (N items of T vectors,
    row-major placeholder order; ``counts_B[b]`` items belong to row b). Raises ``MediaPlaceholderError`` naming
    the sample when a row's placeholders are not ``counts_B[b] * T`` -- unless ``checked`` (the caller ran
    ``check_placeholders`` on the batch's host copy) and the tokens are on a device, where the check would sync."""
    n_items = 0 if feats_NTD is None else feats_NTD.shape[0]
    if not checked or tokens_BS.device.type == "cpu":
        check_placeholders(tokens_BS, token_id, counts_B, n_items, 0 if feats_NTD is None else feats_NTD.shape[1],
                           what, sample_keys)
    if n_items == 0:
        return x_BSD
    return x_BSD.masked_scatter((tokens_BS == token_id)[..., None], feats_NTD.to(x_BSD.dtype))


def unsplice_media(x_BSD: torch.Tensor, tokens_BS: torch.Tensor, token_id: int, tokens_per_item: int) -> torch.Tensor:
    """The inverse of ``splice_media``: the vectors at the placeholder positions, as (N, T, D)."""
    return x_BSD[tokens_BS == token_id].view(-1, tokens_per_item, x_BSD.shape[-1])


class VLMModel(nn.Module):
    """The whole VLM (or one pipeline stage: ``layer_range`` of the LM layers; ``pre_process`` = first stage,
    with the encoders, projectors and embedding; ``post_process`` = last stage, with the head and loss).
    Call ``init_weights(seed)`` after building."""

    def __init__(self, cfg: VLMModelConfig, layer_range: tuple[int, int] | None = None,
                 pre_process: bool = True, post_process: bool = True, attention=None, moe_dispatch=None) -> None:
        """``attention``: the language model's attention strategy (``mmtrain.model.attention``; default causal);
        ``moe_dispatch``: the MoE LM's token-dispatch strategy (``mmtrain.parallel.moe_dispatch``; None: local)."""
        super().__init__()
        self.cfg = cfg
        self.pre_process, self.post_process = pre_process, post_process
        lm_width = cfg.language.shape().hidden_size
        self.vision = VisionEncoder(cfg.vision) if pre_process else None
        self.audio = None
        if pre_process and cfg.audio.enabled:
            from mmtrain.model.audio import AudioEncoder  # imports torchaudio

            self.audio = AudioEncoder(cfg.audio)
        self.projector = None
        if pre_process:
            self.projector = nn.ModuleDict(
                {"image": Projector(cfg.projector, cfg.vision.hidden_size, lm_width, cfg.projector.pixel_shuffle)})
            if cfg.audio.enabled:
                self.projector["audio"] = Projector(cfg.projector, cfg.audio.hidden_size, lm_width)
        self.language = model_family(cfg.language).build_stage(cfg.language, layer_range, pre_process, post_process,
                                                               attention=attention, moe_dispatch=moe_dispatch)
        # Set by the parallel plan (mmtrain.train.build_vlm): spliced full-sequence embeddings -> this rank's part.
        self.sequence_shard_fn: Callable[[torch.Tensor], torch.Tensor] | None = None

    def sharding_spec(self):
        """The language model's spec under ``language.``, the encoders' under ``vision.``/``audio.``, the
        projectors replicated (the components this stage holds)."""
        parts = [self.language.sharding_spec().prefixed("language.")]
        for name in ("vision", "audio"):
            if getattr(self, name) is not None:
                parts.append(getattr(self, name).sharding_spec().prefixed(f"{name}."))
        if self.projector is not None:
            parts.append(ShardingSpec({f"projector.{n}": REPLICATED for n, _ in
                                       [*self.projector.named_parameters(), *self.projector.named_buffers()]}))
        return merge_specs(*parts, family="vlm")

    # ------------------------------------------------------------------------------------------ setup
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """The LM exactly as its family's stage alone with this seed; encoders/projectors keyed by their full names."""
        self.language.init_weights(seed)
        if self.vision is not None:
            self.vision.init_weights(seed)
        if self.audio is not None:
            self.audio.init_weights(seed)
        if self.projector is not None:
            init_by_name(self.projector, seed, "projector.", self.cfg.vision.init_std, 1)

    def freeze(self, prefixes: Sequence[str], frozen: bool = True) -> list[str]:
        """Set ``requires_grad = not frozen`` on parameters named ``prefix`` or ``prefix.*`` (e.g. ``vision``,
        ``language``, ``projector.image``); returns the names changed. A prefix must start with a component name
        (it may match nothing on a pipeline stage that lacks the component)."""
        for prefix in prefixes:
            if prefix.split(".")[0] not in COMPONENTS:
                raise ValueError(f"freeze: {prefix!r} is not a VLM component; prefixes start with one of {COMPONENTS}")
        changed = []
        for name, p in self.named_parameters():
            if any(name == pre or name.startswith(pre + ".") for pre in prefixes):
                p.requires_grad_(not frozen)
                changed.append(name)
        return changed

    # ------------------------------------------------------------------------------------------ media
    def encode_images(self, images_NCHW: torch.Tensor, frame_index_N: torch.Tensor | None = None) -> torch.Tensor:
        """(N, tokens_per_image, LM width) projected image features."""
        if frame_index_N is not None:
            frame_index_N = frame_index_N.to(images_NCHW.device)
        return self.projector["image"](self.vision(images_NCHW, frame_index_N))

    def encode_audio(self, audio_MT: torch.Tensor, lengths_M: torch.Tensor) -> torch.Tensor:
        """(M, tokens_per_audio, LM width) projected audio features."""
        if self.audio is None:
            raise MediaPlaceholderError("the batch has audio but model.audio.enabled is false")
        return self.projector["audio"](self.audio(audio_MT, lengths_M))

    def check_media_placeholders(self, tokens_BS: torch.Tensor, image_counts: torch.Tensor | None, num_images: int,
                                 audio_counts: torch.Tensor | None = None, num_audio: int = 0,
                                 sample_keys: Sequence[str] | None = None) -> None:
        """The splice's placeholder checks (same errors) on a batch's host tensors, before it goes to the device:
        then the splice may skip them (``placeholders_checked=True``) and the step reads nothing back."""
        check_placeholders(tokens_BS, self.cfg.image_token_id, image_counts, num_images, self.cfg.tokens_per_image,
                           "image", sample_keys)
        if self.cfg.audio.enabled:  # without it a batch with audio fails in encode_audio, as in the splice path
            check_placeholders(tokens_BS, self.cfg.audio_token_id, audio_counts, num_audio,
                               self.cfg.tokens_per_audio, "audio", sample_keys)

    def splice(self, tokens_BS: torch.Tensor, image_feats: torch.Tensor | None, image_counts: torch.Tensor | None,
               audio_feats: torch.Tensor | None = None, audio_counts: torch.Tensor | None = None,
               sample_keys: Sequence[str] | None = None, placeholders_checked: bool = False) -> torch.Tensor:
        """Token embeddings (B, S, D) of the whole sequence with the media features at their placeholders
        (``placeholders_checked``: ``check_media_placeholders`` passed on the batch's host copy)."""
        x = self.language.embed(tokens_BS)
        x = splice_media(x, tokens_BS, self.cfg.image_token_id, image_feats, image_counts, "image", sample_keys,
                         placeholders_checked)
        if self.cfg.audio.enabled or audio_feats is not None:
            x = splice_media(x, tokens_BS, self.cfg.audio_token_id, audio_feats, audio_counts, "audio", sample_keys,
                             placeholders_checked)
        return x

    def embed_inputs(self, tokens_BS: torch.Tensor, images: torch.Tensor | None = None,
                     image_counts: torch.Tensor | None = None, audio: torch.Tensor | None = None,
                     audio_lengths: torch.Tensor | None = None, audio_counts: torch.Tensor | None = None,
                     frame_index: torch.Tensor | None = None, sample_keys: Sequence[str] | None = None,
                     placeholders_checked: bool = False) -> torch.Tensor:
        """Encode the batch's media and splice them into the full-sequence token embeddings (first stage)."""
        image_feats = self.encode_images(images, frame_index) if images is not None and len(images) else None
        audio_feats = None
        if audio is not None and len(audio):
            audio_feats = self.encode_audio(audio, audio_lengths)
        return self.splice(tokens_BS, image_feats, image_counts, audio_feats, audio_counts, sample_keys,
                           placeholders_checked)

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, inputs: torch.Tensor, labels_BS: torch.Tensor | None = None,
                position_ids_BS: torch.Tensor | None = None, doc_ids_BS: torch.Tensor | None = None,
                **media) -> torch.Tensor:
        """``inputs``: the *whole* token sequence (B, S) on the first stage (it is sharded after splicing),
        received hidden states otherwise. ``labels_BS``/``position_ids_BS``/``doc_ids_BS``: this rank's part of the
        sequence (context-parallel zig-zag chunks, as for the GPT). ``media``: the ``embed_inputs`` keywords
        (``images``, ``image_counts``, ``audio``, ``audio_lengths``, ``audio_counts``, ``frame_index``,
        ``sample_keys``, ``placeholders_checked``), first stage only. Returns per-token losses (B, S_local), 0 where the label is -100,
        on the last stage when labels are given; else logits (last stage) or hidden states."""
        if self.pre_process:
            x = self.embed_inputs(inputs, **media)
            if self.sequence_shard_fn is not None:
                x = self.sequence_shard_fn(x)
        else:
            x = inputs
        keep = None
        if labels_BS is not None and self.post_process:
            keep = labels_BS != IGNORE_INDEX
            labels_BS = labels_BS.masked_fill(~keep, 0)  # a valid id for the (vocab-parallel) cross-entropy
        out = self.language(None, labels_BS, position_ids_BS, doc_ids_BS, inputs_embeds=x)
        return out * keep if keep is not None else out

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], images: torch.Tensor | None = None, max_new_tokens: int = 32,
                 eos_id: int | None = None, audio: torch.Tensor | None = None,
                 audio_lengths: torch.Tensor | None = None, frame_index: torch.Tensor | None = None) -> list[int]:
        """Greedy decoding for one sample on one device (no KV cache: it re-runs the prefix; for demos and
        captions). ``prompt`` holds the placeholders of ``images``/``audio``; ``frame_index`` gives video frames
        their temporal rows (as in training). Returns the new token ids."""
        if not (self.pre_process and self.post_process):
            raise RuntimeError("generate() needs the whole model on one device (no pipeline stages)")
        was_training = self.training
        self.eval()
        image_feats = self.encode_images(images, frame_index) if images is not None and len(images) else None
        audio_feats = self.encode_audio(audio, audio_lengths) if audio is not None and len(audio) else None
        device = self.language.embed.weight.device
        counts_img = torch.tensor([0 if image_feats is None else image_feats.shape[0]])
        counts_aud = torch.tensor([0 if audio_feats is None else audio_feats.shape[0]])
        ids, new = list(prompt), []
        for _ in range(max_new_tokens):
            tokens = torch.tensor([ids], device=device)
            x = self.splice(tokens, image_feats, counts_img, audio_feats, counts_aud)
            logits = self.language(None, inputs_embeds=x)
            nxt = int(logits[0, -1].argmax())
            new.append(nxt)
            ids.append(nxt)
            if eos_id is not None and nxt == eos_id:
                break
        self.train(was_training)
        return new


def component_of(name: str) -> str:
    """The component (``vision``/``audio``/``projector``/``language``) a parameter name belongs to."""
    return name.split(".")[0]
