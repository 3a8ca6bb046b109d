"""How the next token is chosen, and when a sequence stops.

``SamplingParams`` is one request's choice: greedy (temperature 0) or temperature / top-k / top-p sampling from
its own seeded generator, so a row's tokens never depend on the other rows of its batch. Stops: max new tokens,
stop token ids (the tokenizer's end-of-document id by default) and stop strings, checked on the decoded text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MAX_NEW_TOKENS_LIMIT = 1 << 20  # a sanity bound; the context length is the real one
_TINY = torch.finfo(torch.float32).tiny  # the smallest temperature divided by (see filtered_probs)
_SHIFT_BELOW = 1e-3  # temperatures below which the logits are shifted before dividing (fp32 could overflow)


class SamplingError(ValueError):
    """Impossible sampling parameters; the message names the parameter."""


@dataclass
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep every token; ``seed`` None draws from a
    fresh nondeterministic seed; ``stop_token_ids`` end the sequence (the token is not part of the text);
    ``stop`` strings end it where they first appear (the text is cut before them)."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default_factory=tuple)

    def check(self) -> None:
        """Raise ``SamplingError`` naming the first impossible value."""
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise SamplingError(f"max_new_tokens must be an integer in 1..{MAX_NEW_TOKENS_LIMIT}, "
                                f"got {self.max_new_tokens!r}")
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise SamplingError(f"temperature must be >= 0 and finite, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise SamplingError(f"seed must be an integer in 0..2**63-1, got {self.seed!r}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The row's own CPU generator (None for greedy): sampling draws on the host from the row's probabilities."""
    if params.greedy:
        return None
    g = torch.Generator()
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def filtered_probs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities (fp32) after temperature, top-k and top-p (the smallest set of most likely tokens whose
    mass reaches top_p; the most likely token always stays). Finite for every temperature > 0 and top_p in (0, 1]
    the checks accept: below ``_SHIFT_BELOW`` the logits are shifted so the largest is 0 before the division
    (nothing overflows to inf - inf; softmax shifts them anyway, so larger temperatures skip the pass), a
    temperature below fp32's smallest normal number divides as that number (the distribution is the greedy one
    already), and the most likely token is never filtered out (a top_p below fp32's resolution keeps it alone)."""
    logits = logits_V.float()
    if params.temperature < _SHIFT_BELOW:
        logits = logits - logits.max()
    logits = logits / max(params.temperature, _TINY)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each one
        drop = before >= params.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def argmax_rows(logits_BV: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``logits_BV.argmax(-1)`` (the first index of each row's largest value) in two passes: the best of every
    ``chunk`` entries, then the best chunk. One pass over a 128k vocabulary at batch 1 is one row for one thread
    block (28 us on the H200, 2% of a 1B model's decode step); in chunks it spreads over the GPU."""
    B, V = logits_BV.shape
    if V <= 2 * chunk:
        return logits_BV.argmax(-1)
    padded = F.pad(logits_BV, (0, -V % chunk), value=float("-inf"))
    best_BC, where_BC = padded.view(B, -1, chunk).max(-1)
    c = best_BC.argmax(-1)  # the first chunk holding the row's largest value: the first index overall
    return c * chunk + where_BC.gather(1, c[:, None])[:, 0]


def next_tokens(logits_BV: torch.Tensor, params: list[SamplingParams | None],
                generators: list[torch.Generator | None]) -> tuple[torch.Tensor, list[int], dict[int, str]]:
    """One token per row, as a device tensor (B,) and a host list: the argmax for greedy rows (and rows whose
    params are None: free slots), a draw from the row's generator otherwise. One device op and one read-back
    for an all-greedy batch. A row whose draw fails (its logits hold NaN or inf) keeps the argmax and is named
    in the third result, row -> why: the caller ends that row alone."""
    chosen = argmax_rows(logits_BV)
    drawn, failed = {}, {}
    for b, (p, g) in enumerate(zip(params, generators)):
        if p is not None and not p.greedy:
            try:
                drawn[b] = int(torch.multinomial(filtered_probs(logits_BV[b].cpu(), p), 1, generator=g))
            except Exception as exc:  # noqa: BLE001 - one row's failure must not end the batch
                failed[b] = f"sampling failed: {exc}"
    if drawn:
        rows = torch.tensor(list(drawn), device=chosen.device)
        chosen = chosen.index_put((rows,), torch.tensor(list(drawn.values()), device=chosen.device))
    return chosen, chosen.tolist(), failed


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    """The index in ``text`` where the first stop string begins (searching from ``start``), or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
