"""A family HF adapter's reading of full tensors by name, every tensor accounted for: the adapters
refuse a state dict with a tensor they did not use (a layer or expert the config does not describe), naming it."""

from __future__ import annotations

from typing import Mapping

import torch


class TakenTensors:
    """``take(name)``: the tensor ``name`` of ``tensors`` (``what``: how messages call them), remembered as
    used; a missing name is ``error`` (the adapter's one-line refusal class). ``unused()``: the names never
    taken, sorted; ``used`` may be added to for tensors an adapter skips on purpose. Both directions of a
    bridge use it: HF tensors in, our full tensors out."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], error: type[Exception],
                 what: str = "HF state dict") -> None:
        self.tensors, self.error, self.what = tensors, error, what
        self.used: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise self.error(f"{self.what} lacks {name!r}")
        self.used.add(name)
        return self.tensors[name]

    def unused(self) -> list[str]:
        return sorted(set(self.tensors) - self.used)


def embedding_norm_and_head(take: TakenTensors, tied: bool, embed: str = "model.embed_tokens.weight",
                            norm: str = "model.norm.weight") -> dict[str, torch.Tensor]:
    """Our ``embed`` / ``norm`` / ``output`` weights from a decoder's ``model.embed_tokens``, ``model.norm`` and
    ``lm_head`` (``embed`` / ``norm``: the HF names where a model calls them otherwise). Tied: no ``output``, and
    an ``lm_head.weight`` that is there (in-memory tied models list the shared tensor twice) must equal the
    embedding."""
    out = {"embed.weight": take(embed), "norm.weight": take(norm)}
    if not tied:
        out["output.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in take.tensors and not torch.equal(take("lm_head.weight"), out["embed.weight"]):
        raise take.error(f"lm_head.weight differs from {embed} but tie_word_embeddings is true; "
                         "set tie_word_embeddings=false in config.json")
    return out


def check_mapped_shapes(out: Mapping[str, torch.Tensor], build_model, error: type[Exception]) -> None:
    """Our mapped tensors against the shapes of ``build_model()``, built on the meta device (no memory): a tensor
    of another shape means config.json and the weights disagree (one line naming the tensor); a tensor the model
    has but ``out`` lacks is a gap in the adapter's mapping."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build_model().state_dict().items()}
    for name, shape in expected.items():
        if name in out and tuple(out[name].shape) != shape:
            raise error(f"tensor for {name} has shape {tuple(out[name].shape)}, the config implies {shape}; "
                        "config.json and the weights disagree")
    missing = sorted(set(expected) - set(out))
    if missing:  # a bug here, not in the input: every expected name has a mapping
        raise error(f"no HF tensor mapped to {missing[0]!r}")
