"""Where each row of a model's linears goes in its family's Hugging Face export, found by running the family's own
``state_to_hf`` on a probe: every quantized linear's weight replaced by a one-column tensor of row numbers (the
other tensors as they are, or on the meta device). A family's adapter splits and renames linear weights by rows
(our fused ``attn.qkv`` = HF's q/k/v rows, ``mlp.up`` = gate/up), so the HF tensors it returns name, row by row,
where they came from. Per-row quantities (FP8 channel scales, int4 group scales, packed int4 rows) then follow the
same map in both directions, without a second copy of the family's naming rules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mmtrain.convert.compressed_tensors_format import QuantizedFolderError

_PROBE_DTYPE = torch.float64  # row numbers stay exact (no model tensor is float64)


def _hf_linear_module(hf_name: str) -> str | None:
    """The module of an HF tensor name that is a linear's weight (transformers names it ``<module>.weight``)."""
    module, _, leaf = hf_name.rpartition(".")
    return module if leaf == "weight" else None


def hf_linear_rows(state_to_hf: Callable[..., dict], cfg: Any, template: dict[str, torch.Tensor],
                   linears: dict[str, int]) -> dict[str, tuple[str, torch.Tensor]]:
    """For each HF linear (its module name) made of our linears' rows: (our weight key, the row indices it holds,
    in order). ``template``: our full state (real or meta tensors, shapes as the model's); ``linears``: our
    quantized weight keys (``...weight``) -> output rows. A row that lands nowhere, twice, or mixed into another
    tensor is a one-line error: the family's export does not map its linears row by row."""
    probe = dict(template)
    starts: list[tuple[int, str]] = []
    total = 0
    for key, rows in linears.items():
        probe[key] = torch.arange(total, total + rows, dtype=_PROBE_DTYPE).unsqueeze(1)
        starts.append((total, key))
        total += rows
    seen = torch.zeros(total, dtype=torch.int64)
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for hf_name, t in state_to_hf(probe, cfg).items():
        if t.dtype != _PROBE_DTYPE:
            continue
        module = _hf_linear_module(hf_name)
        if t.device.type == "meta" or t.ndim != 2 or t.shape[1] != 1 or module is None:
            raise QuantizedFolderError(f"{hf_name}: the HF export does not take it row by row from a linear; this "
                                       f"family's linears cannot be quantized")
        ids = t[:, 0].to(torch.int64)
        first = int(ids[0]) if len(ids) else 0
        owner = max((s for s in starts if s[0] <= first), default=(0, ""))
        start, key = owner
        rows = ids - start
        if not len(ids) or bool((rows < 0).any()) or bool((rows >= linears[key]).any()):
            raise QuantizedFolderError(f"{hf_name}: mixes rows of several linears in the HF export; this family's "
                                       f"linears cannot be quantized")
        seen[ids] += 1
        out[module] = (key, rows)
    if total and not bool((seen == 1).all()):
        row = int((seen != 1).nonzero()[0])
        key = max(s for s in starts if s[0] <= row)[1]
        raise QuantizedFolderError(f"{key}: its rows are not each in exactly one HF linear of the export; this "
                                   f"family's linears cannot be quantized")
    return out
