"""The vision-language (and audio) model's shape: encoders, projector, and the GPT language model.

Same style as ``mmtrain.config.schema``: every field has a default and its help text. ``VLMModelConfig`` is the
``model:`` section of a VLM run config (``configs/vlm/model_*.yaml`` overlay it). The number of placeholder
tokens per image is *derived* (``tokens_per_image``) from the vision shape and the projector's pixel shuffle;
the media path reads it, the image size, the placeholder ids and the audio settings from here (the ``media:``
section, ``mmtrain.config.media_schema``, has only what the data path alone decides).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mmtrain.config.schema import ModelConfig, doc


@dataclass
class VisionConfig:
    """The ViT image encoder (SigLIP/CLIP-like). Video frames are images with a temporal position."""

    image_size: int = doc(32, "Side of the square input image (and of each tile) in pixels; the media path "
                              "resizes images and video frames to it.", ge=1)
    patch_size: int = doc(8, "Side of a square patch; image_size must be a multiple of it.", ge=1)
    hidden_size: int = doc(64, "Width of the encoder's residual stream.", ge=1)
    num_layers: int = doc(2, "Number of (bidirectional, pre-norm) transformer blocks.", ge=1)
    num_attention_heads: int = doc(4, "Attention heads of the encoder.", ge=1)
    ffn_hidden_size: int = doc(128, "Inner width of the encoder MLP.", ge=1)
    norm: Literal["layernorm", "rmsnorm"] = doc("layernorm", "Normalization layer kind.")
    norm_eps: float = doc(1e-6, "Epsilon of the normalization layers.", gt=0)
    activation: Literal["gelu", "swiglu", "gelu_erf", "quick_gelu"] = doc(
        "gelu", "MLP activation: gelu (tanh approximation; SigLIP), quick_gelu (CLIP), gelu_erf (exact), swiglu.")
    add_bias: bool = doc(True, "Biases on all attention and MLP linears (SigLIP/CLIP: true).")
    patch_bias: bool = doc(True, "Bias on the patch convolution (SigLIP: true, CLIP: false).")
    class_token: bool = doc(False, "Prepend a learned class token to the patches (CLIP); it has its own row of "
                                   "the learned position table.")
    pre_norm: bool = doc(False, "Normalize the embedded patches before the first block (CLIP's pre_layrnorm).")
    position_embedding: Literal["learned", "sincos2d", "rope2d"] = doc(
        "learned", "2D patch positions: a learned table (SigLIP), fixed 2D sin-cos, or 2D rotary embeddings in "
                   "attention (half the rotary frequencies on rows, half on columns).")
    rope_theta: float = doc(10000.0, "Base of the 2D rotary frequencies (position_embedding=rope2d).", gt=0)
    post_norm: bool = doc(True, "A final norm after the last block (SigLIP's post-layernorm); applied to the "
                                "features when feature_layer is 0.")
    feature_layer: int = doc(0, "Which output is the image features: 0 = after the last block and the final norm "
                                "(if any); -k = the k-th last block's output, before any final norm (LLaVA's "
                                "vision_feature_layer, e.g. -2; Hugging Face hidden_states[-k]).", le=0)
    drop_first_token: bool = doc(False, "Drop the encoder's first output token from the features (LLaVA's "
                                        "vision_feature_select_strategy=default: the class token of CLIP).")
    temporal_embedding: bool = doc(True, "Add a learned temporal row per video frame (row 0 for still images); "
                                         "imported towers have none.")
    max_tiles: int = doc(1, "Dynamic resolution: an image may be cut into up to this many image_size tiles (plus a "
                            "thumbnail when > 1), each encoded and counted as one image; 1 = fixed size.", ge=1)
    max_video_frames: int = doc(8, "Rows of the temporal position embedding: frame i of a video adds row i "
                                   "(still images add row 0).", ge=1)
    init_std: float = doc(0.02, "Standard deviation of the normal weight initialization.", ge=0)

    @property
    def grid(self) -> int:
        """Patches per image side."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def num_positions(self) -> int:
        """Rows of the learned position table: the patches, plus the class token."""
        return self.num_patches + int(self.class_token)

    @property
    def num_features(self) -> int:
        """Feature vectors per image the encoder returns (before the projector's pixel shuffle)."""
        return self.num_positions - int(self.drop_first_token)

    def block_config(self) -> ModelConfig:
        """The ``ModelConfig`` the shared transformer blocks (``mmtrain.model.layers``) are built from."""
        return ModelConfig(name="vision", num_layers=self.num_layers, hidden_size=self.hidden_size,
                           ffn_hidden_size=self.ffn_hidden_size, num_attention_heads=self.num_attention_heads,
                           norm=self.norm, norm_eps=self.norm_eps, activation=self.activation,
                           add_bias=self.add_bias, init_std=self.init_std, rope_theta=self.rope_theta)


@dataclass
class AudioConfig:
    """The optional Whisper-like audio encoder: log-mel features, a conv stem, transformer blocks, pooling."""

    enabled: bool = doc(False, "Build the audio encoder (needs model.audio_token_id); without it audio samples "
                                "are refused.")
    sample_rate: int = doc(16000, "Waveform rate in Hz; the media path resamples (linearly) to it.", ge=1)
    n_mels: int = doc(80, "Mel bands of the log-mel features.", ge=1)
    n_fft: int = doc(400, "FFT size of the spectrogram (25 ms at 16 kHz).", ge=1)
    hop_length: int = doc(160, "Samples between feature frames (10 ms at 16 kHz).", ge=1)
    hidden_size: int = doc(64, "Width of the encoder's residual stream.", ge=1)
    num_layers: int = doc(2, "Number of (bidirectional, pre-norm) transformer blocks.", ge=1)
    num_attention_heads: int = doc(4, "Attention heads of the encoder.", ge=1)
    ffn_hidden_size: int = doc(128, "Inner width of the encoder MLP.", ge=1)
    max_frames: int = doc(1500, "Encoder positions after the stride-2 conv stem (1500 = 30 s at 10 ms hops).", ge=1)
    num_tokens: int = doc(8, "Placeholder tokens per audio clip: the encoder output is average-pooled over the "
                             "clip's valid frames into this many vectors.", ge=1)
    norm_eps: float = doc(1e-5, "Epsilon of the LayerNorms.", gt=0)
    activation: Literal["gelu", "gelu_erf"] = doc("gelu", "MLP activation of the blocks: gelu (tanh approximation) "
                                                          "or gelu_erf (exact; Whisper).")
    position_embedding: Literal["sinusoidal", "learned"] = doc(
        "sinusoidal", "Fixed sinusoidal positions, or a learned table of max_frames rows (Whisper checkpoints "
                      "store theirs), initialized to the same sinusoids.")
    init_std: float = doc(0.02, "Standard deviation of the normal weight initialization.", ge=0)

    def block_config(self) -> ModelConfig:
        return ModelConfig(name="audio", num_layers=self.num_layers, hidden_size=self.hidden_size,
                           ffn_hidden_size=self.ffn_hidden_size, num_attention_heads=self.num_attention_heads,
                           norm="layernorm", norm_eps=self.norm_eps, activation=self.activation, add_bias=True,
                           init_std=self.init_std)


@dataclass
class ProjectorConfig:
    """Encoder features -> language-model width (one projector per modality, same shape rules)."""

    num_layers: int = doc(2, "Linear layers of the MLP (GELU between them); 1 is a single linear map.", ge=1)
    hidden_size: int = doc(0, "Inner width of the MLP; 0 uses the language model's hidden_size.", ge=0)
    pixel_shuffle: int = doc(1, "Images: merge each f x f block of neighbouring patches into one token (f^2 times "
                                "fewer tokens, f^2 times wider features); 1 disables. The patch grid must divide.", ge=1)
    input_norm: bool = doc(True, "LayerNorm on the (shuffled) encoder features before the MLP.")


@dataclass
class VLMModelConfig:
    """A vision(-audio)-language model: encoders -> projectors -> placeholder positions of the GPT's input."""

    name: str = doc("tiny-vlm", "Free-form name of the shape, shown in logs.")
    vision: VisionConfig = field(default_factory=VisionConfig, metadata={"help": "Image/video encoder."})
    audio: AudioConfig = field(default_factory=AudioConfig, metadata={"help": "Optional audio encoder."})
    projector: ProjectorConfig = field(default_factory=ProjectorConfig, metadata={"help": "Projectors."})
    language: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The GPT language model."})
    image_token_id: int = doc(-1, "Placeholder token id where image features go (the media path writes it "
                                  "tokens_per_image times per image); required, < language.vocab_size.", ge=-1)
    audio_token_id: int = doc(-1, "Placeholder token id of audio features; used when audio.enabled.", ge=-1)

    @property
    def tokens_per_image(self) -> int:
        """(image_size / patch_size)^2 (+ a class token, - a dropped first token) / pixel_shuffle^2: the
        placeholders each image (tile, frame) takes."""
        return self.vision.num_features // (self.projector.pixel_shuffle ** 2)

    @property
    def tokens_per_audio(self) -> int:
        return self.audio.num_tokens


def check_vlm_model(m: VLMModelConfig, prefix: str = "model", tp: int = 1) -> None:
    """Raise ``ConfigError`` on an impossible VLM shape or on encoders that ``tp`` (parallel.tp) cannot shard
    (the TP plan shards their heads and MLP like the LM's). Keys are named with ``prefix``."""
    from mmtrain.config.loader import ConfigError

    v, a, pr, lm = m.vision, m.audio, m.projector, m.language
    if v.image_size < 1 or v.patch_size < 1 or v.image_size % v.patch_size:
        raise ConfigError(f"{prefix}.vision.image_size ({v.image_size}) must be a positive multiple of "
                          f"{prefix}.vision.patch_size ({v.patch_size})")
    if v.hidden_size % v.num_attention_heads:
        raise ConfigError(f"{prefix}.vision.hidden_size ({v.hidden_size}) must be divisible by "
                          f"{prefix}.vision.num_attention_heads ({v.num_attention_heads})")
    if v.position_embedding == "rope2d" and (v.hidden_size // v.num_attention_heads) % 4:
        raise ConfigError(f"{prefix}.vision.position_embedding=rope2d needs a head dim divisible by 4, got "
                          f"{v.hidden_size // v.num_attention_heads}")
    if -v.feature_layer >= v.num_layers:
        raise ConfigError(f"{prefix}.vision.feature_layer ({v.feature_layer}) must be in [-{v.num_layers - 1}, 0] "
                          f"({prefix}.vision.num_layers={v.num_layers})")
    if v.drop_first_token and v.num_positions < 2:
        raise ConfigError(f"{prefix}.vision.drop_first_token leaves no features of a one-patch image")
    if pr.pixel_shuffle > 1 and v.num_features != v.num_patches:
        raise ConfigError(f"{prefix}.projector.pixel_shuffle ({pr.pixel_shuffle}) needs the features to be the "
                          f"patch grid: {prefix}.vision.class_token and drop_first_token must both be on or off")
    if v.class_token and v.position_embedding != "learned":
        raise ConfigError(f"{prefix}.vision.class_token needs {prefix}.vision.position_embedding=learned")
    if pr.pixel_shuffle < 1 or v.grid % pr.pixel_shuffle:
        raise ConfigError(f"{prefix}.projector.pixel_shuffle ({pr.pixel_shuffle}) must divide the patch grid "
                          f"{v.grid} = vision.image_size / vision.patch_size ({v.image_size} / {v.patch_size})")
    if pr.num_layers < 1:
        raise ConfigError(f"{prefix}.projector.num_layers must be >= 1, got {pr.num_layers}")
    if not 0 <= m.image_token_id < lm.vocab_size:
        raise ConfigError(f"{prefix}.image_token_id ({m.image_token_id}) must be a token id in "
                          f"[0, {prefix}.language.vocab_size={lm.vocab_size})")
    if a.enabled:
        if not 0 <= m.audio_token_id < lm.vocab_size or m.audio_token_id == m.image_token_id:
            raise ConfigError(f"{prefix}.audio_token_id ({m.audio_token_id}) must be a token id in "
                              f"[0, {lm.vocab_size}) other than {prefix}.image_token_id")
        if a.hidden_size % a.num_attention_heads or a.num_tokens < 1:
            raise ConfigError(f"{prefix}.audio.hidden_size ({a.hidden_size}) must be divisible by "
                              f"{prefix}.audio.num_attention_heads ({a.num_attention_heads}) and "
                              f"{prefix}.audio.num_tokens >= 1")
    encoders = [("vision", v)] + ([("audio", a)] if a.enabled else [])
    for name, enc in encoders:
        for key in ("num_attention_heads", "ffn_hidden_size"):
            if getattr(enc, key) % tp:
                raise ConfigError(f"{prefix}.{name}.{key} ({getattr(enc, key)}) must be divisible by parallel.tp "
                                  f"({tp}): the encoder is tensor-parallel like the language model")
