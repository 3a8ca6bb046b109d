"""Packed documents: what the attention and the loss need of a sample that runs across document boundaries.

``packed_document_inputs`` turns tokens into per-token position ids, document ids and a loss mask (Megatron's
rules); ``DocumentRule`` is the run's choice of those (``data.reset_position_ids`` / ``reset_attention_mask``
/ ``eod_mask_loss`` and the EOD id); ``GPTMicroBatch`` is a micro-batch that carries them, made by the loader
(``mmtrain.data.loader.MicroBatches``) so the train loop and the model only pass them on: the attention
strategy turns the document ids into its block mask once per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmtrain.utils.host_copy import to_device


def packed_document_inputs(tokens_BS1: torch.Tensor, eod_id: int | None, reset_position_ids: bool,
                           reset_attention_mask: bool, eod_mask_loss: bool
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Position ids, document ids and loss mask, each (B, S), for the inputs ``tokens_BS1[:, :-1]``.

    The token after an end-of-document token starts a new document: with ``reset_position_ids`` positions
    restart at 0 there, with ``reset_attention_mask`` it gets the next document id (attention must not cross
    document ids; without the flag every id is 0), with ``eod_mask_loss`` the loss is masked where the input is
    the EOD token (predicting a new document's first token from the previous one). Same rules as Megatron's
    ``_get_ltor_masks_and_position_ids``.
    """
    inputs = tokens_BS1[:, :-1]
    B, S = inputs.shape
    device = inputs.device
    if (reset_position_ids or reset_attention_mask or eod_mask_loss) and eod_id is None:
        raise ValueError("packed-document inputs need the end-of-document id, but the datasets' manifests name "
                         "none (prepare the data with EOD tokens appended, or turn off data.reset_position_ids, "
                         "data.reset_attention_mask and data.eod_mask_loss)")
    is_eod = inputs == eod_id if eod_id is not None else torch.zeros_like(inputs, dtype=torch.bool)
    # document of position j = number of EOD tokens strictly before j
    doc = torch.cumsum(is_eod.to(torch.int64), dim=1) - is_eod.to(torch.int64)
    positions = torch.arange(S, device=device, dtype=torch.int64).expand(B, S)
    if reset_position_ids:
        # first position of each document: index after an EOD (or 0); position = j - start of its document
        starts = torch.where(is_eod, torch.arange(1, S + 1, device=device).expand(B, S), torch.zeros_like(positions))
        starts = torch.cummax(torch.cat([torch.zeros(B, 1, dtype=torch.int64, device=device), starts[:, :-1]],
                                        dim=1), dim=1).values
        position_ids = positions - starts
    else:
        position_ids = positions.clone()
    document_ids = doc if reset_attention_mask else torch.zeros_like(doc)
    loss_mask = torch.ones(B, S, dtype=torch.float32, device=device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    return position_ids, document_ids, loss_mask


@dataclass(frozen=True)
class DocumentRule:
    """How packed samples are cut into documents: the EOD id and which of the three per-document rules apply."""

    eod_id: int | None
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool

    @classmethod
    def from_config(cls, data_cfg, eod_id: int | None) -> "DocumentRule | None":
        """The rule of a run's ``data`` section, or None when it packs no documents."""
        d = data_cfg
        if not (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss):
            return None
        return cls(eod_id, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss)

    def apply(self, tokens_BS1: torch.Tensor) -> "GPTMicroBatch":
        positions, doc_ids, loss_mask = packed_document_inputs(
            tokens_BS1, self.eod_id, self.reset_position_ids, self.reset_attention_mask, self.eod_mask_loss)
        return GPTMicroBatch(tokens_BS1, positions, doc_ids if self.reset_attention_mask else None,
                             loss_mask if self.eod_mask_loss else None)


@dataclass
class GPTMicroBatch:
    """``tokens``: (B, S + 1) int64 (inputs ``[:, :-1]``, labels ``[:, 1:]``); ``position_ids`` (B, S);
    ``document_ids`` (B, S) or None (attention is plainly causal); ``loss_mask`` (B, S) float or None."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None

    @classmethod
    def plain(cls, tokens_BS1: torch.Tensor) -> "GPTMicroBatch":
        """A micro-batch of one document per row as far as attention knows: positions 0..S-1, no masks."""
        B, S = tokens_BS1.shape[0], tokens_BS1.shape[1] - 1
        return cls(tokens_BS1, torch.arange(S, device=tokens_BS1.device).expand(B, S))

    def to(self, device: torch.device) -> "GPTMicroBatch":
        return GPTMicroBatch(*(to_device(t, device) for t in (self.tokens, self.position_ids, self.document_ids,
                                                               self.loss_mask)))
