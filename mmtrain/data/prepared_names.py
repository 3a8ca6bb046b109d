"""Where `mmtrain-prep sft` puts its indexed datasets beside ``--output-prefix PREFIX``: the names the SFT and
preference loaders, the DPO reference table and the entry points' preflight check all use (no torch here, so
the preflight can import it before torch is loaded)."""

from __future__ import annotations

import os


def loss_mask_prefix(prefix: str | os.PathLike) -> str:
    """Where `mmtrain-prep sft` puts the loss mask of ``PREFIX`` (or of ``PREFIX_chosen`` / ``PREFIX_rejected``)."""
    return f"{os.fspath(prefix)}_loss_mask"


def preference_prefixes(prefix: str | os.PathLike) -> tuple[str, str]:
    """(chosen, rejected): the token outputs of `mmtrain-prep sft --preference --output-prefix PREFIX`."""
    return f"{os.fspath(prefix)}_chosen", f"{os.fspath(prefix)}_rejected"


def preference_datasets(prefix: str | os.PathLike) -> list[str]:
    """Every indexed dataset a preference prefix is made of: the chosen and rejected tokens and their masks."""
    return [name for side in preference_prefixes(prefix) for name in (side, loss_mask_prefix(side))]
