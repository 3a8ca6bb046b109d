"""``train.sample_every``: greedy samples of ``train.sample_prompts`` from the weights being trained, at logging
steps (sync points: ``train.sample_every`` is a multiple of ``logging.log_every``, so generating — which reads
tokens back every step — adds no host sync to other steps).

Every rank generates (the decoder runs the stage's own, possibly TP-sharded, modules: its collectives need the
whole TP group; DP replicas compute the same tokens); rank 0 logs each sample and the metrics row carries them
as ``samples`` (metrics.jsonl, TensorBoard text).
"""

from __future__ import annotations

import torch

from mmtrain.config.loader import ConfigError
from mmtrain.core.tokenizer import load_tokenizer
from mmtrain.inference.engine import DecodeEngine, generate
from mmtrain.inference.sampling import SamplingParams
from mmtrain.train.step_hooks import StepHooks
from mmtrain.utils.log import get_logger


class SampleLogger(StepHooks):
    """Completes the prompts at steps that are multiples of ``every``; ``model``: the run's whole language
    model on this rank (a VLM's ``language``); ``weights``: what makes its weights whole to read and frees them
    after (``gather_full_params`` / ``release_full_params``, the optimizer's: under ``parallel.fsdp`` the blocks
    are gathered only for their own forward, which the KV-cache decoder does not call)."""

    def __init__(self, model: torch.nn.Module, prompts: list[str], tokenizer_path: str, every: int,
                 max_new_tokens: int, rank: int, weights=None) -> None:
        self.model, self.every, self.rank, self.weights = model, every, rank, weights
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.prompts = prompts
        self.prompt_ids = self.tokenizer.encode_batch(prompts)
        empty = [i for i, ids in enumerate(self.prompt_ids) if not ids]
        if empty:
            raise ConfigError(f"train.sample_prompts[{empty[0]}] is empty (no tokens); every prompt needs text")
        eod = self.tokenizer.eod_id
        self.params = SamplingParams(max_new_tokens, stop_token_ids=() if eod is None else (eod,))

    def step_metrics(self, step: int) -> dict:
        return {"sample_step": step} if step % self.every == 0 else {}

    def host_metrics(self, values: dict) -> dict:
        """Generate now: called at the sample step's own read-back (a logging step), so with its weights."""
        if not values:
            return {}
        was_training = self.model.training
        longest = max(len(p) for p in self.prompt_ids) + self.params.max_new_tokens
        if self.weights is not None:  # collective: every rank samples at the same step
            self.weights.gather_full_params()
        try:
            with torch.no_grad():
                seqs = generate(DecodeEngine(self.model, len(self.prompt_ids), longest), self.prompt_ids,
                                self.params, decode=self.tokenizer.decode)
        finally:
            self.model.train(was_training)
            if self.weights is not None:
                self.weights.release_full_params()
        samples = [{"prompt": p, "completion": s.text, **({"error": s.error} if s.error else {})}
                   for p, s in zip(self.prompts, seqs)]
        if self.rank == 0:
            log = get_logger("train")
            for i, s in enumerate(samples):
                failed = f" (failed: {s['error']})" if "error" in s else ""
                log.info(f"sample {i} at step {values['sample_step']}: {s['prompt']!r} -> {s['completion']!r}{failed}")
        return {"samples": samples}
