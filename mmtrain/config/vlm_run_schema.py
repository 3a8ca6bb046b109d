"""The VLM run configuration: the GPT run's shared sections (``RunSections``: parallel, data, optim, train,
logging, checkpoint) with ``model`` a ``VLMModelConfig``, the ``media:`` section, and which components train
and at what learning rate.

    freeze: [vision, language]        # stage 1: only the projector(s) train
    lr_scale: {vision: 0.1}           # stage 2: the encoder at a tenth of the scheduled learning rate

Entries are parameter-name prefixes of the VLM (``vision``, ``audio``, ``projector``, ``language``, or deeper:
``language.layers.0``); the longest matching ``lr_scale`` prefix wins.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mmtrain.config.media_schema import MOVED_DATA_KEYS, MediaConfig
from mmtrain.config.schema import GPTRunConfig, RunSections, doc
from mmtrain.config.vlm_schema import VLMModelConfig

COMPONENTS = ("vision", "audio", "projector", "language")


@dataclass
class InitConfig:
    """Pretrained parts a VLM run starts from (weights only, at step 0): each a converted mmtrain checkpoint
    (``python -m mmtrain.convert hf-to-mmtrain``; a GPT run's for the language model, or any VLM checkpoint
    holding the part) or a Hugging Face folder (CLIP/SigLIP vision, Whisper, Llama/Qwen2, or a LLaVA for any of
    its parts). Components without a source keep their initialization."""

    vision: str = doc("", "Source of the vision encoder's weights.")
    audio: str = doc("", "Source of the audio encoder's weights.")
    language: str = doc("", "Source of the language model's weights.")
    projector: str = doc("", "Source of the projectors' weights (a VLM checkpoint or a LLaVA folder).")
    expect_unused: list[str] = doc([], "Source tensor names (or name prefixes, as the report prints them) that "
                                       "may be left unused; any other unused tensor is an error.")
    expect_missing: list[str] = doc([], "Parameter-name prefixes of this model (e.g. vision.layers.11) a given "
                                        "source may lack; they keep their initialization. Any other is an error.")

    def sources(self) -> dict[str, str]:
        """{component: source} for the components given."""
        return {c: getattr(self, c) for c in COMPONENTS if getattr(self, c)}


@dataclass
class VLMRunConfig(RunSections):
    """Everything `python -m mmtrain.pretrain_vlm` needs."""

    MOVED_KEYS = MOVED_DATA_KEYS  # not a field (no annotation): the loader's hints for the old data.mm_* keys

    model: VLMModelConfig = field(default_factory=VLMModelConfig, metadata={"help": "VLM shape."})
    media: MediaConfig = field(default_factory=MediaConfig, metadata={"help": "Media samples (VLM runs only)."})
    freeze: list[str] = doc([], "Parameter-name prefixes that do not train (no gradients, no optimizer state), "
                                "e.g. [vision, language] to train only the projector.")
    init_from: str = doc("", "Checkpoint (a step folder, or a root with `latest`) whose model weights start this run "
                             "at step 0 with a fresh optimizer and data order, e.g. stage 1's for stage 2 (saved with "
                             "the same parallel.tp); ignored once the run has checkpoints of its own.")
    init: InitConfig = field(default_factory=InitConfig, metadata={
        "help": "Pretrained parts (init.vision / init.audio / init.language / init.projector) at step 0; "
                "not with init_from."})
    lr_scale: dict[str, float] = doc({}, "Learning-rate multiplier per parameter-name prefix, e.g. "
                                         "{vision: 0.1, projector: 10}; the longest matching prefix wins, others 1.", gt=0)

    def language_run(self) -> GPTRunConfig:
        """The language model's run: this run's shared sections (the same objects, not copies) with
        ``model.language`` as the model; the text-only samples and the shared checks read it."""
        sections = {f.name: getattr(self, f.name) for f in dataclasses.fields(RunSections)}
        return GPTRunConfig(model=self.model.language, **sections)


def matches(name: str, prefix: str) -> bool:
    """``prefix`` names ``name`` itself or one of its parents (``language`` matches ``language.embed.weight``)."""
    return name == prefix or name.startswith(prefix + ".")


def lr_scale_for(name: str, lr_scale: dict[str, float]) -> float:
    best = max((p for p in lr_scale if matches(name, p)), key=len, default=None)
    return 1.0 if best is None else float(lr_scale[best])
