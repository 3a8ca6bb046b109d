"""The model-family table: every ``model.family`` name and the package that holds the family.

Adding a family is one line here (docs/adding-a-model-family.md). Plain Python, no torch, no import of any
family: the config layer (``mmtrain.config.family_sections``) loads each package's ``config`` module (the
family's config section, composed into ``ModelConfig`` as ``model.<name>``) and the registry
(``mmtrain.models.registry``) loads its ``family`` module (``FAMILY = ModelFamily(...)``) when a run uses it.

``INLINE_FAMILY`` is the one family whose shape is ``ModelConfig``'s own top-level fields (``model.*``) rather
than a ``model.<name>`` section: the Llama family, whose shape is also what the VLM encoders' blocks are built
from.
"""

from __future__ import annotations

FAMILY_PACKAGES: dict[str, str] = {
    "llama": "mmtrain.models.llama",
    "deepseek_v3": "mmtrain.models.deepseek_v3",
    "gemma3": "mmtrain.models.gemma3",
    "gpt_oss": "mmtrain.models.gpt_oss",
    "nemotron_h": "mmtrain.models.nemotron_h",
}
INLINE_FAMILY = "llama"


class FamilyContractError(TypeError):
    """A model family does not implement the contract (docs/adding-a-model-family.md); the message names the
    family, the module or class, and the missing or wrong member."""


class FamilySection:
    """What every family's config section is (``mmtrain/models/<family>/config.py``, a dataclass deriving from
    this class; the Llama family's is ``ModelConfig``'s own fields). Family-neutral code reads only these:

    - ``name``, ``vocab_size``, ``hidden_size``, ``num_layers``: fields (or properties) of the shape;
    - ``check(prefix) -> self``: cross-field checks, a ``ConfigError`` naming ``prefix`` + the field;
    - ``check_layout(parallel, prefix)``: the shape against the parallel layout (divisibility by tp / ep);
    - ``lora_targets() -> tuple[str, ...]``: the linears LoRA may adapt (``peft.lora.targets``), in order;
    - the capabilities below, class attributes a family sets to True where it has the feature (the checks
      that refuse a run without it name the key and the family).
    """

    supports_fp8 = False  # train.precision=fp8 (FP8 block linears)
    supports_cp = False  # parallel.cp > 1 (context-parallel attention)
    supports_train_sampling = False  # train.sample_every (greedy samples in the training loop)
    vlm_language = False  # a VLM run's language model (model.language: its stage's embed, forward(inputs_embeds=))
    supports_quantization = False  # python -m mmtrain.quantize (linears mapped row by row to its HF export)

    SECTION_MEMBERS = ("name", "vocab_size", "hidden_size", "num_layers", "check", "check_layout", "lora_targets")
    CAPABILITIES = ("supports_fp8", "supports_cp", "supports_train_sampling", "vlm_language", "supports_quantization")


def family_names() -> tuple[str, ...]:
    """Every family of the table, in its order."""
    return tuple(FAMILY_PACKAGES)


def unknown_family_message(name: object, key: str = "model.family") -> str:
    """The one line that refuses a family name the table does not have."""
    return (f"{key}={name!r} is not a model family; choose one of {', '.join(FAMILY_PACKAGES)} "
            "(the table in mmtrain/models/families.py)")
