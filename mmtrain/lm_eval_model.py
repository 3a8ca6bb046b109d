"""An lm-evaluation-harness model for mmtrain checkpoints, registered as ``mmtrain`` (extra ``mmtrain[eval]``).

    python -m mmtrain.lm_eval --model mmtrain --model_args ckpt=CKPT,tokenizer=TOK --tasks hellaswag
    python -m mmtrain.lm_eval run --model mmtrain --model_args ckpt=CKPT --tasks my_task --include_path tasks/

lm-eval finds models only in its own registry (no plugin discovery), so ``python -m mmtrain.lm_eval`` registers
this class and then runs lm-eval's own command line with the same arguments (every lm-eval option works).
From Python, ``import mmtrain.lm_eval`` registers it for ``lm_eval.simple_evaluate(model="mmtrain", ...)``.

``model_args``: ``ckpt`` (any mmtrain checkpoint, any training layout; weights only), ``tokenizer`` (anything
``mmtrain-prep --tokenizer`` takes; default: the one the checkpoint's data manifest names), ``device``
(default cuda when there is one), ``dtype`` (float32 / bfloat16), ``max_length`` (default: the HF config the
checkpoint was converted from, else its training ``data.seq_length``), ``prefix_token_id`` (default: the
tokenizer's BOS, else its end-of-document id -- the rule of lm-eval's ``hf`` model).

Scores follow lm-eval's ``hf`` model exactly: the same context/continuation split (``TemplateLM``), left
truncation to ``max_length + 1`` tokens, rolling windows for ``loglikelihood_rolling``, and for
``generate_until`` greedy decoding cut at the stop strings (the EOS text added, as ``hf`` does).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:
    import lm_eval.models  # noqa: F401 - lm-eval's own models first: its registry fills itself only when empty
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import model_registry
except ImportError:  # the optional extra is not installed
    raise ImportError("the lm-evaluation-harness adapter needs lm-eval: pip install 'mmtrain[eval]'") from None

from mmtrain.convert.checkpoint_io import checkpoint_lora, read_full_state
from mmtrain.convert.hf_tokenizer import open_tokenizer, recorded_tokenizer
from mmtrain.model.lora import merge_adapters
from mmtrain.models.registry import model_family

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


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


class MMTrainLM(TemplateLM):
    """lm-eval's view of an mmtrain checkpoint (see the module docstring for the arguments)."""

    def __init__(self, ckpt: str, tokenizer: str | None = None, device: str | None = None, dtype: str = "float32",
                 batch_size: int | str = 1, max_batch_size: int | None = None, max_length: int | None = None,
                 prefix_token_id: int | None = None, **unused: Any) -> None:
        super().__init__()
        if unused:
            raise ValueError(f"mmtrain model_args: unknown {', '.join(sorted(unused))} (known: ckpt, tokenizer, "
                             "device, dtype, max_length, prefix_token_id)")
        if str(dtype) not in _DTYPES:
            raise ValueError(f"mmtrain model_args: dtype={dtype!r}, choose one of {', '.join(_DTYPES)}")
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model, self.cfg, meta = load_model(ckpt, self._device, _DTYPES[str(dtype)])
        run = meta.get("config") if isinstance(meta.get("config"), dict) else {}
        tok = open_tokenizer(tokenizer) if tokenizer else recorded_tokenizer(run)
        if tok is None:
            raise ValueError(f"{ckpt}: its data manifest names no tokenizer; pass model_args tokenizer=PATH")
        if tok.eod_id is None:
            raise ValueError(f"{tok.path}: the tokenizer has no end-of-text token, which lm-eval needs")
        self.tok = tok
        hf = meta.get("hf_config") if isinstance(meta.get("hf_config"), dict) else {}
        data = run.get("data") if isinstance(run.get("data"), dict) else {}
        self._max_length = int(max_length or hf.get("max_position_embeddings") or data.get("seq_length") or 2048)
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
                raise ValueError("the mmtrain lm-eval model decodes greedily; the task asks for sampling "
                                 "(do_sample / temperature > 0)")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos or None)
            max_new = int(kwargs["max_gen_toks"])
            if max_new >= self.max_length:
                raise ValueError(f"max_gen_toks={max_new} does not fit max_length={self.max_length}")
            prompt = self.tok_encode(context)[-(self.max_length - max_new):]
            [new] = _greedy_generate(self.model, [prompt], max_new, {self.eot_token_id})
            text = postprocess_generated_text(generation=self.tok_decode(new), stop=until, think_end_token=None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out


# by name, not by class: under ``python -m mmtrain.lm_eval`` this file runs twice (as __main__ and, when lm-eval
# looks the name up, as mmtrain.lm_eval); both register the same target
model_registry.register("mmtrain", target="mmtrain.lm_eval:MMTrainLM")


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the ``mmtrain`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
