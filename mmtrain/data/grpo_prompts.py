"""GRPO's prompts (``grpo.prompts``): a JSONL file read whole when the run starts, one prompt per line, and the
order in which the run takes them.

A line is an object with a ``"prompt"`` string, encoded as is with ``grpo.tokenizer`` (no template, no BOS: a chat
model's prompt is written out rendered), and any other fields, which the reward function receives as keyword
arguments (``{"prompt": "3 + 4 =", "answer": "7"}``). Blank lines are allowed; anything else that is not such an
object, a prompt of no tokens, or one too long for ``data.seq_length`` with ``grpo.max_new_tokens`` new tokens
stops the run with one line naming the file and the line.

The order: global sample ``i`` (what ``MicroBatches`` hands out: ``train.global_batch_size`` prompts a step) is
row ``[prompt, generation index, iteration]``. The generation index counts prompts as they are generated for
(``grpo.num_iterations`` steps train on one generation: their samples repeat the same prompts, ``iteration`` 0 to
mu - 1); prompts are taken in a seeded order (``data.seed``), reshuffled every pass over the file. The rollouts'
sampling seeds derive from the generation index, so a prompt's completions do not depend on the layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtrain.core.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from mmtrain.data.blend_spec import BlendSpecError
from mmtrain.data.gpt_dataset import samples_needed

_RESERVED = ("prompt", "completion")  # the reward function's own keyword arguments


class PromptFileError(BlendSpecError):
    """A prompts file that cannot be used; the message names the file, the line and the fix (a data error: the
    entry points print it as one line, like a broken blend)."""


@dataclass(frozen=True)
class Prompt:
    """One line of the prompts file: its text, token ids, the fields for the reward function, its line number."""

    text: str
    ids: tuple[int, ...]
    fields: dict
    line: int


def _record(raw: bytes, where: str) -> tuple[str, dict] | None:
    """(prompt text, other fields) of one line, None for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{where}: not JSON ({exc.msg} at column {exc.colno}); each line is one object "
                              "such as {\"prompt\": \"3 + 4 =\", \"answer\": \"7\"}") from None
    if not isinstance(record, dict):
        raise PromptFileError(f"{where}: a JSON {type(record).__name__}, not an object such as "
                              "{\"prompt\": \"3 + 4 =\", \"answer\": \"7\"}")
    prompt = record.pop("prompt", None)
    if not isinstance(prompt, str) or not prompt:
        raise PromptFileError(f"{where}: needs a non-empty \"prompt\" string (got {type(prompt).__name__})")
    bad = next((k for k in record if k in _RESERVED or not k.isidentifier()), None)
    if bad is not None:
        raise PromptFileError(f"{where}: the field {bad!r} cannot be passed to the reward function as a keyword "
                              f"argument; rename it (a Python identifier other than {' and '.join(_RESERVED)})")
    return prompt, record


def read_prompts(path: str | Path, tokenizer: Tokenizer, max_prompt_tokens: int) -> list[Prompt]:
    """Every prompt of ``path``, checked (see the module docstring); ``max_prompt_tokens``: data.seq_length -
    grpo.max_new_tokens."""
    path = Path(path)
    rows = []
    try:
        with open(path, "rb") as f:
            for line, raw in enumerate(f, 1):
                record = _record(raw, f"grpo.prompts: {path} line {line}")
                if record is not None:
                    rows.append((line, *record))
    except OSError as exc:
        raise PromptFileError(f"grpo.prompts: {path}: cannot read it ({exc.strerror})") from None
    if not rows:
        raise PromptFileError(f"grpo.prompts: {path} holds no prompt (one JSON object per line, such as "
                              "{\"prompt\": \"3 + 4 =\", \"answer\": \"7\"})")
    ids = tokenizer.encode_batch([text for _, text, _ in rows])
    prompts = []
    for (line, text, fields), tokens in zip(rows, ids):
        if not tokens:
            raise PromptFileError(f"grpo.prompts: {path} line {line}: the prompt encodes to no token")
        if len(tokens) > max_prompt_tokens:
            raise PromptFileError(f"grpo.prompts: {path} line {line}: the prompt has {len(tokens)} tokens; with "
                                  f"grpo.max_new_tokens new ones it must fit data.seq_length, so at most "
                                  f"{max_prompt_tokens}: shorten it, or raise data.seq_length")
        prompts.append(Prompt(text, tuple(tokens), fields, line))
    return prompts


class PromptOrder:
    """``[i]`` -> int64 (3,): [prompt index, generation index, iteration] of global sample ``i`` (module
    docstring); ``prompts``: the file's prompts; ``tokenizer``: the one that encoded them."""

    def __init__(self, prompts: list[Prompt], tokenizer: Tokenizer, global_batch: int, num_iterations: int,
                 seed: int, num_samples: int) -> None:
        self.prompts, self.tokenizer = prompts, tokenizer
        self.global_batch, self.num_iterations, self.seed = global_batch, num_iterations, seed
        self.num_samples = num_samples
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))}
        return self._orders[epoch]

    def __getitem__(self, i: int) -> np.ndarray:
        step, j = divmod(int(i), self.global_batch)
        window, iteration = divmod(step, self.num_iterations)
        generation = window * self.global_batch + j
        epoch, k = divmod(generation, len(self.prompts))
        return np.array([self._order(epoch)[k], generation, iteration], dtype=np.int64)


def build_prompt_order(cfg, dp_size: int) -> PromptOrder:
    """The prompts of ``grpo.prompts`` in the order a run of ``cfg`` at ``dp_size`` data-parallel ranks takes
    them; a broken file or tokenizer is a ``PromptFileError``."""
    g, t = cfg.grpo, cfg.train
    try:
        tokenizer = load_tokenizer(g.tokenizer)
    except TokenizerError as exc:
        raise PromptFileError(f"grpo.tokenizer={g.tokenizer}: {exc}") from None
    vocab = cfg.model.shape().vocab_size
    if tokenizer.max_id >= vocab:
        raise PromptFileError(f"grpo.tokenizer={g.tokenizer}: its ids reach {tokenizer.max_id} but the model's "
                              f"vocab_size is {vocab}; use the tokenizer the model was trained with")
    prompts = read_prompts(g.prompts, tokenizer, cfg.data.seq_length - g.max_new_tokens)
    global_batch = t.global_batch_size or t.micro_batch_size * dp_size
    return PromptOrder(prompts, tokenizer, global_batch, g.num_iterations, cfg.data.seed,
                       samples_needed(cfg, "train", dp_size))
