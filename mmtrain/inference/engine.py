"""The decode engine: sequences in the slots of a static KV cache, one decode step at a time for all of them.

``DecodeEngine.add`` puts waiting sequences into free slots (one batched prefill for those that join together:
right-padded, each row's logits read at its own last position) and ``step`` runs one decode step over every
slot — the static shape a compiled / CUDA-graph step needs — and hands each active sequence its next token. A
sequence that finishes frees its slot for the next one, so new work joins the running batch at the next step
(continuous batching: the server's engine thread, ``mmtrain.inference.server_engine``). ``generate`` is the
offline use: a list of prompts in, their completions out.

Every row sees only its own cache row and draws from its own generator, so under greedy decoding each row's
tokens are those of its batch-of-one run. A failure of one sequence's own work (its prefill, its draw, its text)
ends that sequence alone with ``finish_reason`` "error" and ``error`` saying why; only a failed decode step (the
batch's one model call) raises.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

import torch
from torch import nn

from mmtrain.inference.decoder import (UnsupportedModelError, check_decodable, decoder_forward, kv_cache_bytes,
                                       kv_cache_for)
from mmtrain.inference.detokenize import CompletionText
from mmtrain.inference.memory import check_cache_fits
from mmtrain.inference.sampling import (
    DRAW_FAILED,
    RowRandom,
    SamplingParams,
    argmax_rows,
    draw_filtered,
    find_stop,
    make_generator,
    next_tokens,
    row_parameters,
)
from mmtrain.inference.step_broadcast import StepLeader


class ContextLengthError(ValueError):
    """A prompt (plus its new tokens) that does not fit the engine's context; the message gives both lengths."""


@dataclass
class Sequence:
    """One prompt being completed. ``prompt_embeds`` (S, D), when given, replace the prompt's token embeddings
    (a VLM prompt with its media spliced in). ``on_token(seq, new_text, finished)`` is called after each token
    from the engine's thread (streaming); ``decode`` turns ids into text (needed for stop strings and streaming).
    ``text`` is what decoding prompt + completion adds to the prompt's text (``detokenize.CompletionText``): a
    word keeps its leading space, and the prompt's text + ``text`` is the decode of both."""

    prompt_ids: list[int]
    params: SamplingParams
    prompt_embeds: torch.Tensor | None = None
    on_token: Callable[["Sequence", str, bool], None] | None = None
    decode: Callable[[list[int]], str] | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (a stop token or string), "length", "cancelled" or "error"
    error: str | None = None  # why it ended with "error" (this sequence alone: the others go on)
    cancelled: bool = False  # set from any thread (a client went away): the engine drops it at its next step
    slot: int = -1
    generator: RowRandom | None = None  # the row's random stream (sampled rows)
    _emitted: int = 0  # characters of ``text`` already handed to on_token
    _detok: CompletionText | None = field(default=None, repr=False)  # the text, decoded a few tokens at a time

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_text_end(self) -> int:
        """How many prompt tokens have their text before ``text``: all of them, or fewer when the prompt's ids end
        inside a character that the completion completes (``text`` then begins with that character). So
        ``decode(prompt_ids[:prompt_text_end]) + text`` is the decode of prompt + completion (an echo)."""
        return len(self.prompt_ids) if self._detok is None else self._detok.prompt_end


def check_request(prompt_tokens: int, params: SamplingParams, max_len: int) -> None:
    """Raise ``SamplingError`` for bad parameters, ``ContextLengthError`` when a prompt of ``prompt_tokens`` plus
    ``params.max_new_tokens`` exceeds ``max_len`` positions (or the prompt is empty): what an engine refuses."""
    params.check()
    if prompt_tokens == 0:
        raise ContextLengthError("the prompt is empty (at least one token is needed)")
    need = prompt_tokens + params.max_new_tokens
    if need > max_len:
        raise ContextLengthError(f"prompt of {prompt_tokens} tokens + {params.max_new_tokens} new "
                                 f"tokens = {need} exceeds the context of {max_len} positions")


# inductor options of the compiled decode step (CUDA graphs are added on a GPU): "reduce-overhead" is
# torch.compile's mode of that name; "coordinate-descent" also tunes each generated kernel's launch
# configuration; "max-autotune" also benchmarks matmul kernels against cuBLAS (minutes of compilation)
COMPILE_MODES = {
    "reduce-overhead": {},
    "coordinate-descent": {"coordinate_descent_tuning": True},
    "max-autotune": {"max_autotune": True, "coordinate_descent_tuning": True},
}


class DecodeEngine:
    """``model``: a whole Llama-family ``GPTModel`` or DeepSeek-V3-family ``DeepseekV3Model`` (TP-sharded or
    not) on ``device``, in its compute dtype. ``slots``: sequences decoded together; ``max_len``: positions per slot
    (prompt + new tokens).
    ``compile``: run the decode step under ``torch.compile`` (with CUDA graphs on a GPU). ``overlap``: run
    decode steps one ahead (default: on a GPU, where the host's work then overlaps the device's).
    ``compile_mode``: one of ``COMPILE_MODES`` (how inductor builds the compiled step; all capture CUDA graphs).
    ``peers``: on the server rank of a tensor-parallel group, the ``StepLeader`` that sends each model call's
    inputs to the other ranks first (they run ``step_broadcast.follow`` with an engine built like this one).
    ``vocab_limit``: the tokenizer's id count (``max_id + 1``): ids at or above it are never chosen, greedy or
    sampled (a model's vocabulary padded past its tokenizer's, e.g. a 128k-row head with a 32k tokenizer, would
    otherwise draw ids nothing can decode: a random or barely trained model draws them often).
    Raises ``CacheSizeError`` before allocating a cache larger than the device's free memory allows."""

    def __init__(self, model: nn.Module, slots: int, max_len: int, compile: bool = False,
                 overlap: bool | None = None, peers: StepLeader | None = None,
                 compile_mode: str = "reduce-overhead", vocab_limit: int | None = None) -> None:
        check_decodable(model)
        self.vocab_limit = vocab_limit
        self.model = model.eval()
        weight = model.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        check_cache_fits(kv_cache_bytes(model, slots, max_len, self.dtype), slots, max_len, self.device)
        self.cache = kv_cache_for(model, slots, max_len, self.dtype, self.device)
        self.slots, self.max_len = slots, max_len
        self.active: dict[int, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self._free = list(range(slots - 1, -1, -1))
        self._positions = torch.zeros(slots, 1, dtype=torch.long, device=self.device)  # next position per slot
        self._last = torch.zeros(slots, 1, dtype=torch.long, device=self.device)  # last token per slot
        self._running = torch.zeros(slots, 1, dtype=torch.long, device=self.device)  # 1: the slot's position moves
        self._decode, self._greedy = self._decode_all, self._greedy_all
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode {compile_mode!r}: one of {', '.join(COMPILE_MODES)}")
        self._compiled, self._compile_mode = compile, compile_mode
        if compile:
            self._decode, self._greedy = self._compile(self._decode_all), self._compile(self._greedy_all)
        # On a GPU decoding runs one step ahead: the next step is launched (its input tokens are on the device
        # already) before this step's tokens are read back and checked, so the host's work overlaps the GPU's. A
        # sequence that finished is decoded once more, harmlessly (its row is ignored, then freed). Sampled rows
        # draw on the device from per-slot parameters (set when they join) and uniforms copied from pinned memory:
        # a copy from pageable memory would wait for the device. Pinned buffers alternate between the step in
        # flight and the one being launched.
        cuda = self.device.type == "cuda"
        self._overlap = cuda if overlap is None else overlap
        self._inflight: tuple[list[Sequence], torch.Tensor, torch.cuda.Event | None] | None = None
        self._host_out = [torch.zeros(2, slots, dtype=torch.long, pin_memory=cuda) for _ in range(2)]  # tokens, ok
        self._host_uniforms = [torch.zeros(slots, dtype=torch.float64, pin_memory=cuda) for _ in range(2)]
        self._flip = 0
        self._uniforms = torch.zeros(slots, dtype=torch.float64, device=self.device)
        self._temperature = torch.ones(slots, device=self.device)  # a slot's sampling parameters (sampled rows)
        self._top_k = torch.zeros(slots, dtype=torch.long, device=self.device)
        self._top_p = torch.ones(slots, device=self.device)
        self._sampled = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self._peers = peers

    # ------------------------------------------------------------------------------------------ steps
    def _decode_all(self, tokens_N1: torch.Tensor, positions_N1: torch.Tensor) -> torch.Tensor:
        return self._choosable(decoder_forward(self.model, self.cache, positions_N1, tokens_BS=tokens_N1))

    def _choosable(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """The logits of the ids the tokenizer has (a view: ``vocab_limit``)."""
        return logits_BV if self.vocab_limit is None else logits_BV[:, : self.vocab_limit]

    def _greedy_all(self, tokens_N1: torch.Tensor, positions_N1: torch.Tensor) -> torch.Tensor:
        """One greedy decode step of every slot: the chosen tokens (N,). Compiled, the argmax is in the step's
        graph (``argmax_rows``, fused with the logits' cast). The inputs are updated outside it, by two small
        kernels: with the updates inside the graph, the step was slower on the H200 (832 against 853 new
        tokens/s at batch 1; bench/results/h200_2026-12-01_s8.md)."""
        return argmax_rows(self._decode_all(tokens_N1, positions_N1))

    def _compile(self, step):
        # mutated in place by the step (the cache) or between steps (its inputs): static addresses, so the CUDA
        # graph reads and writes them where they are (no copies in and out)
        for t in [*self.cache.buffers(), self._last, self._positions]:
            torch._dynamo.mark_static_address(t)
        options = dict(COMPILE_MODES[self._compile_mode])
        options["triton.cudagraphs"] = self.device.type == "cuda"
        return torch.compile(step, options=options, fullgraph=False, dynamic=False)

    def submit(self, seq: Sequence) -> None:
        """Queue ``seq``; it joins at the next ``step`` with a free slot (``check`` first)."""
        self.check(seq)
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """Raise ``ContextLengthError`` when the prompt plus ``max_new_tokens`` exceeds ``max_len`` (or the prompt
        is empty), ``SamplingError`` for bad parameters. Reads nothing the engine changes (any thread may call it)."""
        if seq.prompt_embeds is not None and self._peers is not None:
            raise UnsupportedModelError("prompt embeddings (a VLM prompt) are not served tensor-parallel")
        check_request(len(seq.prompt_ids), seq.params, self.max_len)

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """Admit waiting sequences into free slots (their prefill gives their first token), then one decode step
        for the sequences already running. Returns the sequences that finished in this step."""
        finished = self._drop_cancelled()
        running = list(self.active.values())
        if running and self._overlap:
            previous, self._inflight = self._inflight, self._launch(running)
            if previous is not None:
                finished += self._finish_inflight(previous)
        elif running:
            logits = self._run_decode()
            by_slot = [self.active.get(i) for i in range(self.slots)]
            chosen, tokens, failed = next_tokens(logits, [s and s.params for s in by_slot],
                                                 [s and s.generator for s in by_slot])
            for slot, why in failed.items():
                by_slot[slot].error = why
            self._last.copy_(chosen[:, None])  # free slots decode garbage tokens, harmlessly
            self._positions += self._running
            finished += self._accept(running, [tokens[s.slot] for s in running])
        if self._inflight is not None and not self.active:
            self._inflight = None  # every row it decoded has finished: nothing to read
        joining = [self.waiting.popleft() for _ in range(min(len(self.waiting), len(self._free)))]
        if joining:
            finished += self._prefill_apart_on_failure(joining)
        return finished

    @property
    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step's input buffers (last token, next position per slot): a follower receives them."""
        return self._last, self._positions

    def heartbeat(self) -> None:
        """While idle: tell the other TP ranks the server is alive (nothing without peers)."""
        if self._peers is not None:
            self._peers.heartbeat()

    def stop_peers(self) -> None:
        """Let the other TP ranks' ``follow`` return (nothing without peers)."""
        if self._peers is not None:
            self._peers.stop()

    @property
    def tensor_parallel(self) -> bool:
        """Whether other ranks repeat this engine's model calls (a failed step cannot be skipped then)."""
        return self._peers is not None

    def _run_decode(self) -> torch.Tensor:
        if self._peers is not None:
            self._peers.decode(self._last, self._positions)
        return self.decode_forward()

    def decode_forward(self) -> torch.Tensor:
        """One decode step of every slot from the input buffers; (slots, V) fp32 logits."""
        return self._graph_step(self._decode)

    def _graph_step(self, step) -> torch.Tensor:
        """``step`` (``_decode`` or ``_greedy``) on the input buffers."""
        if self._compiled and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are consumed
        return step(self._last, self._positions)

    def _launch(self, running: list[Sequence]) -> tuple[list[Sequence], torch.Tensor, torch.cuda.Event | None]:
        """Queue one decode step on the device: next tokens into the inputs (the argmax, or the draw of sampled
        rows), their copy (and whether each draw was finite) to pinned host memory; nothing waits."""
        sampled = [s for s in running if not s.params.greedy]
        cuda = self.device.type == "cuda"
        host = self._host_out[self._flip]
        if not sampled and self._peers is None:
            chosen, ok = self._graph_step(self._greedy), None
        else:  # the other TP ranks repeat the model call only (step_broadcast.follow)
            logits = self._run_decode()
            chosen, ok = argmax_rows(logits), None
            if sampled:
                uniforms = [0.0] * self.slots
                for s in sampled:
                    uniforms[s.slot] = s.generator.next_uniform()
                pinned = self._host_uniforms[self._flip]
                pinned.copy_(torch.tensor(uniforms, dtype=torch.float64))
                self._uniforms.copy_(pinned, non_blocking=cuda)
                drawn, ok = draw_filtered(logits, self._temperature, self._top_k, self._top_p, self._uniforms,
                                          sort_k=any(s.params.top_k > 0 for s in sampled),
                                          sort_p=any(s.params.top_p < 1 for s in sampled))
                chosen = torch.where(self._sampled & ok, drawn, chosen)
        self._flip ^= 1
        self._last.copy_(chosen[:, None])
        self._positions += self._running
        host[0].copy_(chosen, non_blocking=cuda)
        if ok is not None:
            host[1].copy_(ok, non_blocking=cuda)
        done = torch.cuda.Event() if cuda else None
        if done is not None:
            done.record()
        return running, host, done

    def _finish_inflight(self, inflight) -> list[Sequence]:
        """Read a launched step's tokens back and accept them for its rows that are still running; a sampled row
        whose draw failed ends with an error, alone."""
        seqs, host, done = inflight
        if done is not None:
            done.synchronize()
        tokens, ok = host.tolist()
        alive = [s for s in seqs if self.active.get(s.slot) is s]
        for s in alive:
            if not s.params.greedy and not ok[s.slot]:
                s.error = DRAW_FAILED
        return self._accept(alive, [tokens[s.slot] for s in alive])

    def _drop_cancelled(self) -> list[Sequence]:
        dropped = [s for s in self.active.values() if s.cancelled]
        for s in dropped:
            s.finish_reason = "cancelled"
            self._release(s)
        kept = [s for s in self.waiting if not s.cancelled]
        if len(kept) != len(self.waiting):
            for s in self.waiting:
                if s.cancelled:
                    s.finish_reason = "cancelled"
                    dropped.append(s)
            self.waiting = deque(kept)
        return dropped

    def _release(self, s: Sequence) -> None:
        del self.active[s.slot]
        self._positions[s.slot, 0] = 0  # a free slot's decode row stays inside the cache
        self._running[s.slot, 0] = 0
        self._free.append(s.slot)

    def abort_all(self) -> list[Sequence]:
        """Drop every running and waiting sequence (after a failed step); returns them. The cache stays usable:
        a slot's old keys are never attended by its next sequence."""
        dropped = list(self.active.values()) + list(self.waiting)
        self._inflight = None
        for s in list(self.active.values()):
            self._release(s)
        self.waiting.clear()
        return dropped

    def _prefill_apart_on_failure(self, seqs: list[Sequence]) -> list[Sequence]:
        """One batched prefill of ``seqs``; when it fails, each alone, so that only a sequence whose own prefill
        fails ends (with an error). Not under tensor parallelism: the other ranks have run the failed call."""
        try:
            return self._prefill(seqs)
        except Exception as exc:  # noqa: BLE001 - a failed prefill of one prompt must not end the other prompts
            if self._peers is not None:
                raise  # fatal for the server, which ends them with the running ones (they hold their slots)
            for s in seqs:
                if self.active.get(s.slot) is s:
                    self._release(s)
            if len(seqs) == 1:
                return self._end_with_error(seqs[0], f"prefill failed: {type(exc).__name__}: {exc}")
        return [s for one in seqs for s in self._prefill_apart_on_failure([one])]

    def _end_with_error(self, s: Sequence, why: str) -> list[Sequence]:
        """End ``s`` (holding no slot) with an error: its callback hears of it; returns [s]."""
        s.error, s.finish_reason = why, "error"
        if s.on_token is not None:
            s.on_token(s, "", True)
        return [s]

    def _prefill(self, seqs: list[Sequence]) -> list[Sequence]:
        for s in seqs:
            s.slot = self._free.pop()
            s.generator = make_generator(s.params)
            self.active[s.slot] = s
        lengths = [len(s.prompt_ids) for s in seqs]
        S = max(lengths)
        dev = self.device
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        self._set_slot_params(slots, [s.params for s in seqs])
        last = torch.tensor(lengths, device=dev) - 1
        if any(s.prompt_embeds is not None for s in seqs):
            positions = torch.arange(S, device=dev).expand(len(seqs), S)
            embeds = torch.zeros(len(seqs), S, self.model.embed.embedding_dim, dtype=self.dtype, device=dev)
            for b, s in enumerate(seqs):
                src = s.prompt_embeds if s.prompt_embeds is not None else self.model.embed(
                    torch.tensor(s.prompt_ids, device=dev))
                embeds[b, : lengths[b]] = src.to(dev, self.dtype)
            logits = self._choosable(decoder_forward(self.model, self.cache, positions, inputs_embeds=embeds,
                                                     slots_B=slots, last_index_B=last, kv_len=S))
        else:
            tokens = torch.zeros(len(seqs), S, dtype=torch.long, device=dev)
            for b, s in enumerate(seqs):
                tokens[b, : lengths[b]] = torch.tensor(s.prompt_ids, device=dev)
            if self._peers is not None:
                self._peers.prefill(tokens, slots, last)
            logits = self.prefill_forward(tokens, slots, last)
        self._positions[slots, 0] = last + 1
        self._running[slots, 0] = 1
        chosen, tokens, failed = next_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for b, why in failed.items():
            seqs[b].error = why
        self._last[slots, 0] = chosen
        return self._accept(seqs, tokens)

    def _set_slot_params(self, slots: torch.Tensor, params: list[SamplingParams]) -> None:
        """The joining rows' sampling parameters into their slots (the overlapped step draws from these)."""
        neutral = SamplingParams(temperature=1.0)  # a greedy row's draw is computed, then ignored
        t, k, p = row_parameters([neutral if q.greedy else q for q in params], self.device)
        self._temperature[slots], self._top_k[slots], self._top_p[slots] = t, k, p
        self._sampled[slots] = torch.tensor([not q.greedy for q in params], device=self.device)

    def prefill_forward(self, tokens_BS: torch.Tensor, slots_B: torch.Tensor, last_B: torch.Tensor) -> torch.Tensor:
        """The prefill of right-padded prompts ``tokens_BS`` into ``slots_B``; (B, V) logits at ``last_B``."""
        B, S = tokens_BS.shape
        positions = torch.arange(S, device=self.device).expand(B, S)
        return self._choosable(decoder_forward(self.model, self.cache, positions, tokens_BS=tokens_BS,
                                               slots_B=slots_B, last_index_B=last_B, kv_len=S))

    def _accept(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append each sequence's new token, apply its stops, free the slots of those that finished. A sequence
        whose draw failed (``error`` set) or whose text handling raises ends with an error, alone."""
        done = []
        for s, tok in zip(seqs, tokens):
            if s.error is None:
                try:  # inline, not a call per token: this loop is the decode step's host work
                    if tok in s.params.stop_token_ids:
                        s.finish_reason = "stop"  # text held back for an incomplete character comes out below
                    else:
                        s.token_ids.append(tok)
                        if len(s.token_ids) >= s.params.max_new_tokens:
                            s.finish_reason = "length"
                    # without stop strings or streaming the text is decoded once, at the end
                    if s.decode is not None and (s.params.stop or s.on_token is not None or s.finished):
                        self._update_text(s)
                    if s.on_token is not None:
                        self._emit(s)
                except Exception as exc:  # noqa: BLE001 - one sequence's failure must not end the others
                    s.error = f"{type(exc).__name__}: {exc}"
            if s.error is not None:
                self._release(s)
                done += self._end_with_error(s, s.error)
            elif s.finished:
                self._release(s)
                done.append(s)
        return done

    @staticmethod
    def _update_text(s: Sequence) -> None:
        if s._detok is None:
            s._detok = CompletionText(s.prompt_ids, s.decode)
        text = s._detok.update(s.token_ids, s.finished)
        if s.params.stop:
            # a stop string can only begin where it could overlap the newly added text
            start = max(0, len(s.text) - max(len(x) for x in s.params.stop))
            cut = find_stop(text, s.params.stop, start)
            if cut is not None:
                text, s.finish_reason = text[:cut], "stop"
        s.text = text

    @staticmethod
    def _emit(s: Sequence) -> None:
        """Hand on the text not yet emitted; while running, hold back what a stop string might still claim
        and an incomplete UTF-8 character (shown as U+FFFD until its last byte arrives)."""
        end = len(s.text)
        if not s.finished:
            hold = max((len(x) - 1 for x in s.params.stop), default=0)
            end = max(s._emitted, end - hold)
            while end > s._emitted and s.text[end - 1] == "\ufffd":
                end -= 1
        new, s._emitted = s.text[s._emitted:end], max(s._emitted, end)
        if new or s.finished:
            s.on_token(s, new, s.finished)


def generate(engine: DecodeEngine, prompts: Seq[list[int]], params: SamplingParams | Seq[SamplingParams],
             decode: Callable[[list[int]], str] | None = None) -> list[Sequence]:
    """Complete every prompt (token ids) with ``engine``; more prompts than slots wait for free ones. ``params``:
    one for all or one per prompt. Returns the finished sequences in prompt order (one that failed alone has
    ``finish_reason`` "error" and its ``error``)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    seqs = [Sequence(list(p), sp, decode=decode) for p, sp in zip(prompts, params)]
    for s in seqs:
        engine.submit(s)
    while engine.busy:
        engine.step()
    return seqs
