"""FP8 training, one interface over two backends (docs/fp8.md).

``resolve_fp8_backend`` checks the device and picks the backend at start-up (a clear ``ConfigError`` on the CPU,
below sm_89, or when TE is asked for and missing); ``apply_fp8`` then turns the chosen blocks' linears
(qkv, proj, MLP up/down, after the TP plan) into FP8 ones; ``Fp8Runtime`` is what the step loop calls:
``weights_changed()`` after the optimizer step (the native backend re-casts its FP8 weight copies once per
step, not per micro-batch) and ``after_backward(groups)`` (delayed scaling: reduce the step's amaxes, new scales);
checkpoints save ``delayed_state()`` and restore it by matmul name (``load_delayed_state``).

Blocks ``bf16_first_layers`` / ``bf16_last_layers`` (global layer indices), embeddings, norms, attention and MoE
experts stay BF16; so does the output layer unless ``fp8.output_layer`` (native backend: ``model.head.matmul``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mmtrain.config.loader import ConfigError
from mmtrain.config.schema import GPTRunConfig
from mmtrain.config.validate import NATIVE_FP8_RECIPES, TE_FP8_RECIPES
from mmtrain.model.fp8_native import Fp8Casts, Fp8Linear, Fp8Matmul, refresh_weights_in_place
from mmtrain.model.fp8_scaling import AmaxHistory, fp8_dtypes
from mmtrain.model.fp8_te import apply_te_fp8  # transformer_engine itself is imported only when used
from mmtrain.utils.log import get_logger

FP8_LINEARS = ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")


def te_import_error() -> str | None:
    """Why Transformer Engine's PyTorch API does not import here (``None``: it does). Never imported at module
    import time."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:  # not installed, or without a usable CUDA build
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no message'}"
    return None


def te_importable() -> bool:
    """Whether Transformer Engine's PyTorch API imports here."""
    return te_import_error() is None


def resolve_fp8_backend(cfg: GPTRunConfig, device: torch.device) -> str:
    """"native" or "te" for this run; ``ConfigError`` naming the key when FP8 cannot run here."""
    f = cfg.fp8
    if device.type != "cuda":
        raise ConfigError(f"train.precision=fp8 needs an FP8 GPU (Hopper sm_90 / Ada sm_89 or newer), but this run "
                          f"is on {device.type}; use train.precision=bf16")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(f"train.precision=fp8 needs compute capability 8.9 or newer; "
                          f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}: use train.precision=bf16")
    backend = f.backend
    if backend == "auto":
        # parallel.fsdp gathers native FP8 weights (Transformer Engine keeps its own)
        backend = ("te" if te_importable() and f.recipe in TE_FP8_RECIPES and not cfg.parallel.fsdp
                   else "native")
    if backend == "te" and not te_importable():
        raise ConfigError(f"fp8.backend=te but transformer_engine.pytorch does not import here ({te_import_error()}); "
                          f"install Transformer Engine or set fp8.backend=native")
    if backend == "native" and f.recipe not in NATIVE_FP8_RECIPES:
        raise ConfigError(f"fp8.recipe={f.recipe} needs Transformer Engine (fp8.backend=te), which "
                          f"{'is not installed' if not te_importable() else 'was not chosen'}; the native backend "
                          f"offers {', '.join(NATIVE_FP8_RECIPES)}")
    if backend == "te" and f.param_gather:
        raise ConfigError("fp8.param_gather=true is a native-backend option, but fp8.backend=auto chose Transformer "
                          "Engine; set fp8.backend=native or fp8.param_gather=false")
    if backend == "te" and f.fast_accum_backward:
        raise ConfigError("fp8.fast_accum_backward=true is a native-backend option, but fp8.backend=auto chose "
                          "Transformer Engine; set fp8.backend=native or fp8.fast_accum_backward=false")
    if backend == "te" and f.output_layer:
        raise ConfigError("fp8.output_layer=true is a native-backend option, but fp8.backend=auto chose Transformer "
                          "Engine; set fp8.backend=native or fp8.output_layer=false")
    if backend == "te" and cfg.train.activation_checkpointing == "full":
        raise ConfigError("train.activation_checkpointing=full recomputes blocks outside TE's FP8 autocast; with "
                          "fp8.backend=te use selective or none, or fp8.backend=native")
    if f.recipe == "mxfp8" and major < 10:
        raise ConfigError(f"fp8.recipe=mxfp8 needs a Blackwell GPU (sm_100+), this one is sm_{major}{minor}; use "
                          "fp8.recipe=blockwise (TE), tensorwise or delayed")
    return backend


def fp8_layer_indices(cfg: GPTRunConfig) -> set[int]:
    """Global indices of the blocks that compute in FP8 (all but the first/last N kept in BF16)."""
    n, f = cfg.model.num_layers, cfg.fp8
    return set(range(f.bf16_first_layers, n - f.bf16_last_layers))


def fp8_linears(model: nn.Module, cfg: GPTRunConfig) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, attribute, linear)`` of every linear of a ``GPTModel`` (stage) that computes in FP8: the
    ``FP8_LINEARS`` of the blocks in ``fp8_layer_indices`` (an MoE block has no mlp.up/down: its experts stay
    BF16). Both backends swap exactly these."""
    chosen = fp8_layer_indices(cfg)
    found = []
    for index, block in model.layers.items():
        if int(index) not in chosen:
            continue
        for path in FP8_LINEARS:
            parent_path, _, name = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            lin = getattr(parent, name, None)
            if lin is not None:
                found.append((parent, name, lin))
    return found


def apply_native_fp8(model: nn.Module, cfg: GPTRunConfig) -> list[Fp8Matmul]:
    """Swap the FP8 blocks' linears of a ``GPTModel`` (stage) for native FP8 ones, in place; returns the matmuls.
    Single-device ``nn.Linear`` become ``Fp8Linear`` (same parameter names); TP linears get an FP8 ``matmul``.
    All of them share one ``Fp8Casts`` (the model's compiled weight casts)."""
    f = cfg.fp8
    casts = Fp8Casts()
    matmuls = []
    for parent, name, lin in fp8_linears(model, cfg):
        if isinstance(lin, nn.Linear):
            lin = Fp8Linear(lin, f.recipe, f.format, f.fast_accum_backward, casts)
            setattr(parent, name, lin)
        elif hasattr(lin, "matmul"):  # ColumnParallelLinear / RowParallelLinear
            lin.matmul = Fp8Matmul(f.recipe, f.format, f.fast_accum_backward, casts)
        else:
            continue
        object.__setattr__(lin.matmul, "weight_ref", lin.weight)  # a plain reference, not a submodule param
        matmuls.append(lin.matmul)
    if f.output_layer and model.post_process:  # the LM head (this rank's vocabulary shard under TP; tied or not)
        model.head.matmul = Fp8Matmul(f.recipe, f.format, f.fast_accum_backward, casts)
        object.__setattr__(model.head.matmul, "weight_ref", model.output_weight())
        matmuls.append(model.head.matmul)
    return matmuls


class Fp8Runtime:
    """The step loop's handle on FP8 bookkeeping of this rank's model chunks (see the module docstring)."""

    def __init__(self, backend: str, cfg: GPTRunConfig, models: list[nn.Module], tp_group=None) -> None:
        """``tp_group``: weight amaxes are reduced over it, so a weight has one scale whatever the TP layout."""
        self.backend, self.cfg = backend, cfg
        self.models, self.tp_group = models, tp_group
        named = [(n, m) for model in models for n, m in model.named_modules() if isinstance(m, Fp8Matmul)]
        self.matmuls = [m for _, m in named]
        self.names = [_matmul_name(n) for n, _ in named]  # layout-independent: global layer index, "head"
        self.step_managed = False  # until the loop takes over, every forward re-casts the weights
        self.param_gather = None  # fp8.param_gather: an fp8_param_gather.Fp8ParamGather, set by the loop
        self.param_gather_note = ""
        self.history = None
        f = cfg.fp8
        if backend == "native" and f.recipe == "delayed":
            self.history = AmaxHistory(self.matmuls, f.amax_history_len, f.amax_compute_algo, f.margin,
                                       *fp8_dtypes(f.format))
        if backend == "native":
            for model in models:
                model.register_forward_pre_hook(self._refresh_weights)

    def describe(self) -> str:
        f = self.cfg.fp8
        layers = sorted(fp8_layer_indices(self.cfg))
        span = f"layers {layers[0]}-{layers[-1]}" if layers else "no layers"
        extra = (f", amax history {f.amax_history_len} ({f.amax_compute_algo}), margin {f.margin}"
                 if f.recipe == "delayed" else "")
        if self.backend == "native" and f.fast_accum_backward and f.recipe != "rowwise":
            extra += ", fast accumulation in backward GEMMs"
        count = f", {len(self.matmuls)} FP8 linears on this rank" if self.backend == "native" else ""
        gather = self.param_gather.describe() if self.param_gather is not None else self.param_gather_note
        head = self.backend == "native" and f.output_layer
        return (f"fp8: backend {self.backend}, recipe {f.recipe}, format {f.format}{extra}; {span} in FP8 "
                f"(qkv, proj, MLP){' and the output layer' if head else ''}{count}; embeddings, attention, norms"
                f"{'' if head else ' and the output layer'} in BF16{gather}")

    def _gathered(self) -> set[int]:
        """Matmuls whose FP8 copies the FP8 parameter gather keeps current while their BF16 weights are partial."""
        return self.param_gather.managed() if self.param_gather is not None else set()

    def _refresh_weights(self, module: nn.Module, args) -> None:
        """Forward pre-hook of each chunk: cast the stale FP8 weight copies (all at once, one TP all-reduce)."""
        gathered = self._gathered()
        stale = [m for m in self.matmuls if (m.weight_stale or not self.step_managed) and id(m) not in gathered]
        if stale:
            self.refresh(stale)

    @torch.no_grad()
    def refresh(self, matmuls: list[Fp8Matmul]) -> None:
        per_tensor = [m for m in matmuls if m.recipe != "rowwise"]
        if per_tensor:
            amax = torch.stack(torch._foreach_norm([m.weight_ref.detach() for m in per_tensor], float("inf")))
            amax = amax.float()  # one multi-tensor kernel for all weights
            if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.tp_group)
            if not refresh_weights_in_place(per_tensor, amax):  # the first refresh sizes the buffers
                for m, a in zip(per_tensor, amax.unbind(0)):
                    m.refresh_weight(m.weight_ref, a)
                # then casts them again the way every later refresh does, so that path's compile (which
                # synchronises) happens in this first step, not in the next one
                refresh_weights_in_place(per_tensor, amax)
        for m in matmuls:
            if m.recipe == "rowwise":  # row scales of this rank's shard (rows of a row-parallel weight are cut)
                m.refresh_weight(m.weight_ref)

    def weights_changed(self) -> None:
        """After the optimizer step: the next forward re-casts the FP8 weight copies (once per step)."""
        self.step_managed = True
        gathered = self._gathered()  # the optimizer step's FP8 parameter gather re-cast these already
        for m in self.matmuls:
            m.weight_stale = id(m) not in gathered or m.weight_stale

    def after_backward(self, groups: list) -> None:
        """Delayed scaling: this step's amaxes, reduced (MAX) over ``groups``, enter the history; new scales."""
        if self.history is not None:
            self.history.update(groups)

    def delayed_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Native delayed scaling's state for a checkpoint: {matmul name: {"amax_history": (2, L) oldest step
        first, "scales": (2,)}}; empty with another recipe or backend, or before the first update. Every rank
        holding a matmul (TP, DP, CP replicas) has the same values: its amaxes are reduced over those groups."""
        rows = self.history.rows() if self.history is not None else None
        if rows is None:
            return {}
        return {name: {"amax_history": row, "scales": m.scales}
                for name, m, row in zip(self.names, self.matmuls, rows)}

    def load_delayed_state(self, saved: dict[str, dict[str, torch.Tensor]], source: str, saved_any: bool) -> None:
        """Restore ``delayed_state`` by matmul name (``saved``: what the checkpoint has of this rank's matmuls,
        at any layout; ``saved_any``: whether it has any) and say in the log what could not be: matmuls missing
        start afresh, a history of another length is cut or padded."""
        if self.history is None or not self.matmuls:
            return
        log = get_logger("checkpoint")
        if not saved_any:
            log.info(f"fp8: {source} holds no delayed-scaling state (a BF16 checkpoint, another FP8 recipe or "
                     "backend, or written before it was saved): the amax history starts afresh")
            return
        index = {n: i for i, n in enumerate(self.names)}
        found = {index[n]: (v["amax_history"], v["scales"]) for n, v in saved.items() if n in index}
        resized = self.history.restore(found)
        missing = [n for i, n in enumerate(self.names) if i not in found]
        if resized:
            lengths = "/".join(str(n) for n in sorted({int(found[i][0].shape[-1]) for i in resized}))
            log.warning(f"fp8: {source} has amax histories of length {lengths}, fp8.amax_history_len is "
                        f"{self.history.history_len}: kept the newest steps (zeros before them when shorter) and "
                        f"recomputed the scales of {len(resized)} FP8 matmul(s) from them")
        if missing:
            log.warning(f"fp8: {source} has no delayed-scaling state for {len(missing)} of this rank's "
                        f"{len(self.names)} FP8 matmuls ({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}"
                        "): their amax history starts afresh")
        if found:
            log.info(f"fp8: restored the amax history and scales of {len(found)} FP8 matmul(s) from {source}")


def _matmul_name(module_path: str) -> str:
    """An FP8 matmul's checkpoint name from its module path in a model chunk: the linear it computes
    (``layers.3.attn.qkv``; ``head`` for the output layer's, ``head.matmul``)."""
    if module_path == "head.matmul":
        return "head"
    return module_path.removesuffix(".matmul")


def apply_fp8(model: nn.Module, cfg: GPTRunConfig, mesh, backend: str) -> None:
    """Make one model chunk FP8 with ``backend`` (from ``resolve_fp8_backend``): after the TP/CP/EP plans, before
    compile. Then ``Fp8Runtime(backend, cfg, chunks)`` is the step loop's handle."""
    if backend == "te":
        apply_te_fp8(model, cfg, mesh, fp8_linears(model, cfg))
    else:
        apply_native_fp8(model, cfg)
