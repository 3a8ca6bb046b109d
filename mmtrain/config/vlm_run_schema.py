"""The VLM run configuration: the GPT run's sections (parallel, data, optim, train, logging, checkpoint) with
``model`` a ``VLMModelConfig``, plus which components train and at what learning rate.

    freeze: [vision, language]        # stage 1: only the projector(s) train
    lr_scale: {vision: 0.1}           # stage 2: the encoder at a tenth of the scheduled learning rate

Entries are parameter-name prefixes of the VLM (``vision``, ``audio``, ``projector``, ``language``, or deeper:
``language.layers.0``); the longest matching ``lr_scale`` prefix wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmtrain.config.schema import (CheckpointConfig, DataConfig, LoggingConfig, OptimConfig, ParallelConfig,
                                   TrainConfig, doc)
from mmtrain.config.vlm_schema import VLMModelConfig

COMPONENTS = ("vision", "audio", "projector", "language")


@dataclass
class VLMRunConfig:
    """Everything `python -m mmtrain.pretrain_vlm` needs."""

    model: VLMModelConfig = field(default_factory=VLMModelConfig, metadata={"help": "VLM shape."})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"help": "Parallel layout."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Training data (the mm_* keys)."})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "Optimizer and schedule."})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "Step loop."})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "Logging."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"help": "Checkpoints."})
    freeze: list[str] = doc([], "Parameter-name prefixes that do not train (no gradients, no optimizer state), "
                                "e.g. [vision, language] to train only the projector.")
    init_from: str = doc("", "Checkpoint (a step folder, or a root with `latest`) whose model weights start this run "
                             "at step 0 with a fresh optimizer and data order, e.g. stage 1's for stage 2 (saved with "
                             "the same parallel.tp); ignored once the run has checkpoints of its own.")
    lr_scale: dict[str, float] = doc({}, "Learning-rate multiplier per parameter-name prefix, e.g. "
                                         "{vision: 0.1, projector: 10}; the longest matching prefix wins, others 1.", gt=0)


def matches(name: str, prefix: str) -> bool:
    """``prefix`` names ``name`` itself or one of its parents (``language`` matches ``language.embed.weight``)."""
    return name == prefix or name.startswith(prefix + ".")


def lr_scale_for(name: str, lr_scale: dict[str, float]) -> float:
    best = max((p for p in lr_scale if matches(name, p)), key=len, default=None)
    return 1.0 if best is None else float(lr_scale[best])
