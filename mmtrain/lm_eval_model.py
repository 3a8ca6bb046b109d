"""The lm-evaluation-harness model ``mmtrain`` (extra ``mmtrain[eval]``): an mmtrain checkpoint as lm-eval's
``TemplateLM``. ``mmtrain.lm_eval`` registers it (by this module's name) and wraps lm-eval's command line.

``model_args``: ``ckpt`` (any mmtrain checkpoint, any training layout; weights only), ``tokenizer`` (anything
``mmtrain-prep --tokenizer`` takes; default: the one the checkpoint names), ``device`` (default cuda when there
is one, else cpu), ``dtype`` (float32 / bfloat16), ``max_length`` (default: ``max_position_embeddings`` as the HF
export of the checkpoint writes it, which lm-eval's ``hf`` model reads; the training ``data.seq_length`` only
for a model that has no HF export), ``prefix_token_id`` (default: the tokenizer's BOS, else its
end-of-document id -- the rule of lm-eval's ``hf`` model), ``allow_other_tokenizer`` (a ``tokenizer`` that is
not the one the checkpoint names is refused unless true: ``mmtrain.core.tokenizer_record``).

Scores follow lm-eval's ``hf`` model exactly: the same context/continuation split (``TemplateLM``), left
truncation to ``max_length + 1`` tokens, rolling windows for ``loglikelihood_rolling``, and for
``generate_until`` greedy decoding cut at the stop strings (the EOS text added, as ``hf`` does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.model import TemplateLM
except ImportError:  # the optional extra is not installed
    raise ImportError("the lm-evaluation-harness adapter needs lm-eval: pip install 'mmtrain[eval]'") from None

from mmtrain.convert.checkpoint_io import checkpoint_lora, read_full_state
from mmtrain.convert.hf_tokenizer import open_tokenizer, recorded_tokenizer
from mmtrain.core.tokenizer_record import describe_record, tokenizer_mismatch
from mmtrain.model.lora import merge_adapters
from mmtrain.models.registry import model_family

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_KNOWN_ARGS = "ckpt, tokenizer, device, dtype, max_length, prefix_token_id, allow_other_tokenizer"


class MMTrainLMError(ValueError):
    """A model argument, the checkpoint or tokenizer it names, or a request the model cannot serve; one line."""


@torch.no_grad()
def _greedy_generate(model: torch.nn.Module, token_lists: list[list[int]], max_new: int,
                     stop_ids: set[int]) -> list[list[int]]:
    """The greedy continuation of each prompt (at most ``max_new`` tokens, ending before the first id in
    ``stop_ids``). A full forward per new token, one prompt at a time: simple and exact, not fast; the place for
    a KV-cache generator (mmtrain.inference) to drop in with the same signature."""
    device = next(model.parameters()).device
    out = []
    for tokens in token_lists:
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        new: list[int] = []
        for _ in range(max_new):
            nxt = int(model(ids)[0, -1].argmax())
            if nxt in stop_ids:
                break
            new.append(nxt)
            ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
        out.append(new)
    return out


def load_model(ckpt: str | Path, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, Any, dict]:
    """The whole model of ``ckpt`` on one device (eval mode; a LoRA run's adapters merged), its ModelConfig and
    complete.json."""
    full, cfg, meta = read_full_state(ckpt)
    lora = checkpoint_lora(meta, ckpt)  # a LoRA run's checkpoint: its adapters, merged into the base weights
    model = model_family(cfg).build_stage(cfg, (0, cfg.shape().num_layers), True, True, lora=lora)
    model.load_state_dict(full, strict=True)
    merge_adapters(model)
    return model.to(device=device, dtype=dtype).eval(), cfg, meta


def _batch_size(value: Any) -> int:
    if isinstance(value, int):
        return max(1, value)
    text = str(value or "1")
    return int(text) if text.isdigit() else 8  # "auto": lm-eval's search needs CUDA OOMs; a fixed size instead


def _device(device: str | None) -> torch.device:
    """``device`` (lm-eval's ``--device`` or the model argument), or cuda when there is one, else cpu."""
    if not device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise MMTrainLMError(f"device={device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise MMTrainLMError(f"device={device} but no CUDA device is visible; pass --device cpu")
    return chosen


def default_max_length(cfg, meta: dict) -> int:
    """The context limit lm-eval's ``hf`` model uses on the HF export of this checkpoint: the
    ``max_position_embeddings`` that ``mmtrain-to-hf`` writes into its config.json. A model the export cannot
    express falls back to the training ``data.seq_length``."""
    adapter = model_family(cfg).hf
    try:
        exported = adapter.config_to_hf(cfg, meta.get("hf_config"))
    except adapter.errors():  # a shape with no HF equivalent
        exported = {}
    if exported.get("max_position_embeddings"):
        return int(exported["max_position_embeddings"])
    run = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    return int(data.get("seq_length") or 2048)


def _check_tokenizer(tok, meta: dict, ckpt: str, allow_other: bool) -> None:
    """A ``tokenizer`` argument that is not the tokenizer the checkpoint names is refused (unless allowed)."""
    given = tok.describe()
    found = None if allow_other else tokenizer_mismatch(meta, given)
    if found is None:
        return
    raise MMTrainLMError(f"tokenizer={tok.path} is {describe_record(given)}, but {ckpt}'s model was "
                         f"trained with {describe_record(found[0])} (from its {found[1]}): its scores would be "
                         "meaningless; leave tokenizer= out to use that one, or add allow_other_tokenizer=true if "
                         "this is intended")


def _flag(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")


class MMTrainLM(TemplateLM):
    """lm-eval's view of an mmtrain checkpoint (see the module docstring for the arguments)."""

    def __init__(self, ckpt: str, tokenizer: str | None = None, device: str | None = None, dtype: str = "float32",
                 batch_size: int | str = 1, max_batch_size: int | None = None, max_length: int | None = None,
                 prefix_token_id: int | None = None, allow_other_tokenizer: bool | str = False,
                 **unused: Any) -> None:
        super().__init__()
        if unused:
            raise MMTrainLMError(f"mmtrain model_args: unknown {', '.join(sorted(unused))} (known: {_KNOWN_ARGS})")
        if str(dtype) not in _DTYPES:
            raise MMTrainLMError(f"mmtrain model_args: dtype={dtype!r}, choose one of {', '.join(_DTYPES)}")
        if not Path(ckpt).exists():
            raise MMTrainLMError(f"ckpt={ckpt}: not found (looked for {Path(ckpt).resolve()})")
        self._device = _device(device)
        self.model, self.cfg, meta = load_model(ckpt, self._device, _DTYPES[str(dtype)])
        tok = open_tokenizer(tokenizer) if tokenizer else recorded_tokenizer(meta)
        if tok is None:
            raise MMTrainLMError(f"{ckpt}: the checkpoint names no tokenizer; pass model_args tokenizer=PATH")
        if tok.eod_id is None:
            raise MMTrainLMError(f"{tok.path}: the tokenizer has no end-of-text token, which lm-eval needs")
        if tokenizer:
            _check_tokenizer(tok, meta, ckpt, _flag(allow_other_tokenizer))
        self.tok = tok
        self._max_length = int(max_length or default_max_length(self.cfg, meta))
        bos = getattr(tok, "bos_id", None)
        self._prefix = int(prefix_token_id) if prefix_token_id is not None else (bos if bos is not None
                                                                                 else tok.eod_id)
        self.batch_size = _batch_size(batch_size)

    # ---- what TemplateLM asks -----------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eod_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)  # as mmtrain-prep encoded the training data: no special tokens added

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(tokens, skip_special_tokens=skip_special_tokens)  # as the hf model decodes

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log-probabilities of the continuation, whether it is the greedy one) per request; batches of
        similar length, right-padded (causal attention: padding after a row never changes its logits)."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            rows = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in batch]
            width = max(len(r) for r in rows)
            ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=self.device)
            logprobs = F.log_softmax(self.model(ids).float(), dim=-1)
            for row, i in enumerate(batch):
                cont = requests[i][2]
                n = len(rows[row])
                picked = logprobs[row, n - len(cont):n]
                target = torch.tensor(cont, dtype=torch.long, device=self.device)
                score = picked.gather(1, target[:, None]).sum().item()
                results[i] = (score, bool((picked.argmax(-1) == target).all()))
                self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for (string,) in [r.args for r in requests]:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            total = sum(s for s, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows]))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        out = []
        for context, gen_kwargs in [r.args for r in requests]:
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), 256)
            if kwargs.get("do_sample"):
                raise MMTrainLMError("the mmtrain lm-eval model decodes greedily; the task asks for sampling "
                                 "(do_sample / temperature > 0)")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos or None)
            max_new = int(kwargs["max_gen_toks"])
            if max_new >= self.max_length:
                raise MMTrainLMError(f"max_gen_toks={max_new} does not fit max_length={self.max_length}")
            prompt = self.tok_encode(context)[-(self.max_length - max_new):]
            [new] = _greedy_generate(self.model, [prompt], max_new, {self.eot_token_id})
            text = postprocess_generated_text(generation=self.tok_decode(new), stop=until, think_end_token=None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out
