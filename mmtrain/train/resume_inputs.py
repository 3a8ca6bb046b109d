"""What a resume must not change silently: the learning-rate schedule and the data order.

Every checkpoint records both in its ``complete.json`` (``schedule`` and ``data_order``: dotted config keys ->
the values the run used). A resumed run compares its own with the checkpoint's. A difference is a
``CheckpointError`` naming every changed key (``train.steps: 40 in the checkpoint, 60 now``), unless the config
says what to do: ``checkpoint.schedule_change`` (``use_config``: this run's schedule from the resumed step on;
``use_checkpoint``: keep the checkpoint's) and ``checkpoint.data_order_change`` (``use_config``: this run's order,
continuing at the checkpoint's consumed-sample count). Megatron-LM's ``--override-opt_param-scheduler`` and
``--use-checkpoint-opt_param-scheduler`` are the model. To stop a run early without changing either, use
``train.exit_at_step``. Checkpoints written before these records are compared through the run config they store.

Which keys change the order: the text sample indices (``mmtrain.data.gpt_dataset``) depend on the data files,
split, seed, sequence length and the number of samples the run consumes, ``train.steps`` x the global batch
size; blending depends on the weights; the global order is then cut into global batches. Mock samples depend on
the seed and sequence length only. A VLM's media order also depends on the slicing, shuffling and packing keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmtrain.config.schema import OptimConfig
from mmtrain.train.checkpoint import CheckpointError, read_complete
from mmtrain.train.lr import lr_at
from mmtrain.utils.log import get_logger

# the keys each schedule's learning rate depends on (a change of any other is no change of the schedule)
_SCHEDULE_KEYS = {
    "constant": ("optim.schedule", "optim.lr", "optim.warmup_steps"),
    "cosine": ("optim.schedule", "train.steps", "optim.lr", "optim.min_lr", "optim.warmup_steps"),
    "wsd": ("optim.schedule", "train.steps", "optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.decay_fraction"),
}
_DATA_KEYS = ("data.mock", "data.seed", "data.seq_length", "data.blend", "data.prefixes", "data.weights",
              "data.split", "train.global_batch_size", "train.steps")
_VLM_DATA_KEYS = ("media.slices", "media.shuffle_buffer_size", "media.pack", "media.packing_buffer_size")
_BLEND_DIGEST = "data.blend (file content sha256)"


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of every step: ``lr_at`` over ``total_steps`` with ``optim``'s schedule keys."""

    total_steps: int
    optim: OptimConfig

    def lr(self, step: int) -> float:
        return lr_at(step, self.total_steps, self.optim)

    def record(self) -> dict[str, Any]:
        """The dotted keys this schedule is made of, as a checkpoint stores them."""
        o = self.optim
        return {"train.steps": self.total_steps, "optim.schedule": o.schedule, "optim.lr": o.lr,
                "optim.min_lr": o.final_lr(),  # the value it stands for: an unset min_lr records lr / 10
                "optim.warmup_steps": o.warmup_steps, "optim.decay_fraction": o.decay_fraction}


def schedule_of(cfg) -> LrSchedule:
    return LrSchedule(cfg.train.steps, cfg.optim)


def _schedule_from_record(record: dict[str, Any], optim: OptimConfig) -> LrSchedule:
    o = dataclasses.replace(optim, **{k.split(".", 1)[1]: v for k, v in record.items() if k.startswith("optim.")})
    return LrSchedule(int(record["train.steps"]), o)


def _get(config: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        config = config[part]
    return config


def data_order_record(config: dict, dp: int) -> dict[str, Any]:
    """The data-order inputs of a run config (as ``dataclasses.asdict`` gives it) at data-parallel size ``dp``."""
    keys = [k for k in _DATA_KEYS if not (_get(config, "data.mock") and k in ("train.steps", "data.blend"))]
    keys += list(_VLM_DATA_KEYS) if "freeze" in config else []  # a VLM run config
    if config["data"].get("type", "gpt") == "sft":  # only then: records of older checkpoints keep their keys
        keys += ["data.type", "data.sft_pack"]
    record = {k: _get(config, k if "media" in config or not k.startswith("media.") else _before_media(k))
              for k in keys}
    t = config["train"]
    record["train.global_batch_size"] = t["global_batch_size"] or t["micro_batch_size"] * dp  # 0 means mbs x dp
    blend = config["data"]["blend"]
    if blend and not config["data"]["mock"]:
        try:  # an edited blend spec changes the order under the same path
            record[_BLEND_DIGEST] = hashlib.sha256(Path(blend).read_bytes()).hexdigest()[:16]
        except OSError:
            record[_BLEND_DIGEST] = None  # unreadable here: the data build reports it
    return record


def _before_media(key: str) -> str:
    """Where a ``media.*`` key was before the media section: ``data.mm_*`` (checkpoints of older versions)."""
    return "data.mm_" + key.split(".", 1)[1]


def resume_records(cfg, schedule: LrSchedule, dp: int) -> dict[str, Any]:
    """What a checkpoint of this run stores in ``complete.json`` next to its config."""
    return {"schedule": schedule.record(), "data_order": data_order_record(dataclasses.asdict(cfg), dp)}


def _saved_records(meta: dict) -> tuple[dict | None, dict | None]:
    """The checkpoint's schedule and data-order records (derived from its stored config for older ones)."""
    if "schedule" in meta and "data_order" in meta:
        renamed = {_before_media(k): k for k in _VLM_DATA_KEYS}
        return meta["schedule"], {renamed.get(k, k): v for k, v in meta["data_order"].items()}
    config = meta.get("config") or {}
    if not config:
        return None, None
    o, t = config["optim"], config["train"]
    schedule = {"train.steps": t["steps"], **{f"optim.{k}": o[k] for k in
                                             ("schedule", "lr", "min_lr", "warmup_steps", "decay_fraction")}}
    if schedule["optim.min_lr"] is None:  # unset: what it stands for, as schedule records hold it
        schedule["optim.min_lr"] = OptimConfig(lr=o["lr"]).final_lr()
    return schedule, data_order_record(config, int(meta.get("layout", {}).get("dp", 1)))


def _same(a: Any, b: Any) -> bool:
    """Equal; two floats within rounding (an unset min_lr's lr / 10 is 2.9999999999999997e-05 for 3e-4)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def _changes(saved: dict, now: dict, keys) -> list[str]:
    return [f"{k}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} now" for k in keys
            if not _same(saved.get(k), now.get(k))]


def resolve_resume(found: Path | None, cfg, dp: int) -> LrSchedule:
    """The schedule this run steps with; with a (full) checkpoint ``found`` also the checks above: raises
    ``CheckpointError`` naming every changed schedule or data-order key that the config does not allow."""
    schedule = schedule_of(cfg)
    if found is None:
        return schedule
    log = get_logger("train")
    meta = read_complete(Path(found))
    if meta.get("weights_only"):
        return schedule
    saved_schedule, saved_order = _saved_records(meta)
    if saved_schedule is None:
        log.warning(f"{found} records neither its schedule nor its config: resuming with this run's schedule "
                    "and data order unchecked")
        return schedule
    c, step = cfg.checkpoint, int(meta.get("step", 0))
    now = schedule.record()
    keys = dict.fromkeys(_SCHEDULE_KEYS[saved_schedule["optim.schedule"]] + _SCHEDULE_KEYS[now["optim.schedule"]])
    schedule_changes = _changes(saved_schedule, now, keys)
    order_now = data_order_record(dataclasses.asdict(cfg), dp)
    order_changes = _changes(saved_order, order_now, dict.fromkeys([*saved_order, *order_now]))
    problems, fixes = [], []
    if schedule_changes and c.schedule_change == "error":
        problems.append("the learning-rate schedule (" + "; ".join(schedule_changes) + ")")
        fixes.append(f"checkpoint.schedule_change=use_config (this run's schedule from step {step + 1}) or "
                     "use_checkpoint (keep the checkpoint's)")
    if order_changes and c.data_order_change == "error":
        problems.append("the data order (" + "; ".join(order_changes) + ")")
        fixes.append("checkpoint.data_order_change=use_config (this run's order, continuing at the checkpoint's "
                     "consumed-sample count)")
    if problems:
        raise CheckpointError(f"{found}: resuming would change {' and '.join(problems)}; resume with the "
                              f"checkpoint's values (train.exit_at_step stops a run early without changing them), "
                              f"or set {' and '.join(fixes)}")
    if order_changes:
        log.warning(f"checkpoint.data_order_change=use_config: the data order changes at step {step + 1} "
                    f"({'; '.join(order_changes)})")
    if not schedule_changes:
        return schedule
    kept = _schedule_from_record(saved_schedule, cfg.optim)
    if c.schedule_change == "use_checkpoint":
        log.warning(f"checkpoint.schedule_change=use_checkpoint: keeping the checkpoint's learning-rate schedule "
                    f"({'; '.join(schedule_changes)}); the run still stops at train.steps={cfg.train.steps}")
        return kept
    log.warning(f"checkpoint.schedule_change=use_config: the learning-rate schedule changes at step {step + 1} "
                f"({'; '.join(schedule_changes)}): lr {kept.lr(step + 1):.3e} under the checkpoint's schedule, "
                f"{schedule.lr(step + 1):.3e} now")
    return schedule
