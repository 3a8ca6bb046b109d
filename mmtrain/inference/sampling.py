"""How the next token is chosen, and when a sequence stops.

``SamplingParams`` is one request's choice: greedy (temperature 0) or temperature / top-k / top-p sampling from
its own seeded random stream (``RowRandom``), so a row's tokens never depend on the other rows of its batch; every
sampled row of a step draws at once on the logits' device. Stops: max new tokens,
stop token ids (the tokenizer's end-of-document id by default) and stop strings, checked on the decoded text.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MAX_NEW_TOKENS_LIMIT = 1 << 20  # a sanity bound; the context length is the real one
_TINY = torch.finfo(torch.float32).tiny  # the smallest temperature divided by (see filtered_probs)


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


class RowRandom:
    """A sampled row's own random stream: draw ``n`` of seed ``s`` is a pure function of (s, n) (a SplitMix64
    hash), so a row's tokens never depend on its batch mates, its slot or the device's other work."""

    __slots__ = ("seed", "draws")

    def __init__(self, seed: int) -> None:
        self.seed, self.draws = seed, 0

    def next_uniform(self) -> float:
        """The row's next uniform number in [0, 1) (53 random bits), advancing the stream."""
        u = (_mix64(_mix64(self.seed) ^ self.draws) >> 11) * (1.0 / (1 << 53))
        self.draws += 1
        return u


def make_generator(params: SamplingParams) -> RowRandom | None:
    """The row's own random stream (None for greedy); a request without a seed gets a fresh random one."""
    if params.greedy:
        return None
    return RowRandom(secrets.randbits(63) if params.seed is None else params.seed)


_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64: its finalizer of ``x`` plus the golden-ratio increment."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def inverse_cdf(probs_BV: torch.Tensor, uniforms_B: torch.Tensor) -> torch.Tensor:
    """The token of each row whose cumulative probability first exceeds the row's uniform times the row's total
    (fp64 sums): index i with probability p_i, never one of probability 0."""
    cdf = probs_BV.double().cumsum(-1)
    target = uniforms_B.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_max(probs_BV.shape[-1] - 1)


def filtered_probs_rows(logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor,
                        top_p_B: torch.Tensor, sort_k: bool | None = None, sort_p: bool | None = None) -> torch.Tensor:
    """Each row's probabilities (fp32) after its temperature, top-k (0: none) and top-p (1: none): the smallest set
    of most likely tokens whose mass reaches top_p; the most likely token always stays. Finite for every
    temperature > 0 and top_p in (0, 1] the checks accept: the logits are shifted so each row's largest is 0 before
    the division (nothing overflows to inf - inf), a temperature below fp32's smallest normal number divides as
    that number (the distribution is the greedy one already), and the most likely token is never filtered out (a
    top_p below fp32's resolution keeps it alone). Sorts only when a row asks for top-k or top-p: ``sort_k`` /
    ``sort_p`` say whether one does where the caller knows (None: read from the tensors, a wait for the device).
    A row's probabilities do not depend on the other rows' parameters."""
    logits = logits_BV.float()
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature_B.float().clamp_min(_TINY)[:, None]
    V = logits.shape[-1]
    k = torch.where((top_k_B > 0) & (top_k_B < V), top_k_B, V)
    if bool((k < V).any()) if sort_k is None else sort_k:
        kth = logits.sort(-1, descending=True).values.gather(1, (k - 1)[:, None].long())
        logits = logits.masked_fill(logits < kth, float("-inf"))  # k = V: the smallest value, nothing goes
    probs = logits.softmax(-1)
    if bool((top_p_B < 1).any()) if sort_p is None else sort_p:
        sorted_probs, order = probs.sort(-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each one
        nucleus = top_p_B < 1
        drop = before >= torch.where(nucleus, top_p_B.float(), float("inf"))[:, None]
        drop[:, 0] = False
        kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = torch.where(nucleus[:, None], kept / kept.sum(-1, keepdim=True), probs)
    return probs


def filtered_probs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``filtered_probs_rows`` of one row and its parameters."""
    return filtered_probs_rows(logits_V[None], *row_parameters([params], logits_V.device))[0]


def row_parameters(params: list[SamplingParams], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' temperatures (fp32), top-k (int64) and top-p (fp32) as tensors on ``device``."""
    return (torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device))


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


def draw_rows(logits_BV: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> tuple[torch.Tensor,
                                                                                                     torch.Tensor]:
    """One draw per row from its filtered probabilities, all rows at once on the logits' device (``inverse_cdf``
    of the row's uniform). Returns the tokens (B,) and whether each row's probabilities were finite (a row with
    NaN or inf logits, or a NaN temperature, is not)."""
    uniforms_B = torch.tensor(uniforms, dtype=torch.float64, device=logits_BV.device)
    return draw_filtered(logits_BV, *row_parameters(params, logits_BV.device), uniforms_B,
                         sort_k=any(p.top_k > 0 for p in params), sort_p=any(p.top_p < 1 for p in params))


def draw_filtered(logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor,
                  uniforms_B: torch.Tensor, sort_k: bool | None = None,
                  sort_p: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``draw_rows`` from parameters and uniforms already on the device: nothing waits for the device when
    ``sort_k`` and ``sort_p`` are given (``filtered_probs_rows``), so the engine can queue a sampled step ahead."""
    probs = filtered_probs_rows(logits_BV, temperature_B, top_k_B, top_p_B, sort_k, sort_p)
    ok = torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0)
    return inverse_cdf(probs.nan_to_num(0.0), uniforms_B), ok


DRAW_FAILED = ("sampling failed: the row's probabilities are not finite (NaN or inf logits, or a NaN "
               "temperature)")


def next_tokens(logits_BV: torch.Tensor, params: list[SamplingParams | None],
                generators: list[RowRandom | None]) -> tuple[torch.Tensor, list[int], dict[int, str]]:
    """One token per row, as a device tensor (B,) and a host list: the argmax for greedy rows (and rows whose
    params are None: free slots), a draw from the row's random stream otherwise, every sampled row at once on the
    logits' device (one read-back in all). A row whose draw fails (its logits hold NaN or inf) keeps the argmax
    and is named in the third result, row -> why: the caller ends that row alone."""
    chosen = argmax_rows(logits_BV)
    rows = [b for b, p in enumerate(params) if p is not None and not p.greedy]
    if not rows:
        return chosen, chosen.tolist(), {}
    index = torch.tensor(rows, device=chosen.device)
    drawn, ok = draw_rows(logits_BV.index_select(0, index), [params[b] for b in rows],
                          [generators[b].next_uniform() for b in rows])
    chosen = chosen.index_put((index,), torch.where(ok, drawn, chosen.index_select(0, index)))
    values = torch.cat([chosen, ok.long()]).tolist()  # the one read-back: tokens, then each draw's ok
    failed = {b: DRAW_FAILED for b, good in zip(rows, values[len(chosen):]) if not good}
    return chosen, values[:len(chosen)], failed


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    """The index in ``text`` where the first stop string begins (searching from ``start``), or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
