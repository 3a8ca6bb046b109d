"""Chat SFT throughput and memory: mmtrain packed SFT (full fine-tuning and LoRA) against a Hugging Face
forward/backward baseline on the same conversations, one process, one table.

    python bench/sft_lora.py [--model configs/models/llama3.2-1b.yaml] [--seq 4096] [--batch 2] [--steps 8]
    python bench/sft_lora.py --tiny            # CPU check of the script (tiny model, a few steps)

Synthetic conversations (lengths uniform in [--min-len, --max-len] tokens, the second half of each carrying the
loss) are written as an `mmtrain-prep sft`-format dataset (tokens + loss mask + manifest); mmtrain runs its real
training loop (``data.type=sft``: packed, per-conversation attention) with full weights and with LoRA. The HF
rows run ``LlamaForCausalLM`` of the same shape on the same conversations one per row, padded to the longest
(labels -100 outside the loss), with AdamW, in a plain forward/backward loop; and, when ``peft`` is importable,
the same with LoRA. The ``hf-trainer`` rows run ``transformers.Trainer`` itself (bf16 autocast, fused AdamW),
padded or packed by ``DataCollatorWithFlattening``. Tokens/s counts real (non-padding) tokens per second; "loss tok/s" only the
tokens that carry the loss; memory is the peak allocated by the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config  # noqa: E402
from mmtrain.core.indexed import IndexedDatasetWriter, token_dtype_for  # noqa: E402
from mmtrain.parallel import ParallelDims, init_distributed, pick_device  # noqa: E402
from mmtrain.train.loop import train_gpt  # noqa: E402
from mmtrain.utils.log import setup_logging  # noqa: E402


def write_dataset(prefix: Path, count: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
    """Conversations of random tokens; the second half of each carries the loss. Returns their lengths."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, count).astype(np.int32)
    tokens = rng.integers(1, vocab, int(lengths.sum())).astype(token_dtype_for(vocab))
    mask = np.concatenate([np.r_[np.zeros(n // 2), np.ones(n - n // 2)] for n in lengths]).astype(np.uint8)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for p, data in ((prefix, tokens), (Path(f"{prefix}_loss_mask"), mask)):
        with IndexedDatasetWriter(p, data.dtype) as w:
            w.add(data, lengths)
            w.commit()
    Path(f"{prefix}.manifest.json").write_text(json.dumps({
        "command": "mmtrain-prep sft", "kind": "sft", "eod_id": 0,
        "tokenizer": {"type": "synthetic", "path": "none", "sha256": "synthetic", "max_id": vocab - 1}}))
    return lengths, tokens, mask


def mmtrain_row(label: str, cfg_path: str, prefix: Path, a, extra: list[str], device) -> dict:
    cfg = load_config(GPTRunConfig, cfg_path, [
        "data.type=sft", f"data.prefixes=[{prefix}]", f"data.seq_length={a.seq}", "data.split=1,0,0",
        f"train.micro_batch_size={a.batch}", f"train.steps={a.steps + a.warmup}", "optim.warmup_steps=1",
        "optim.lr=1e-5", "optim.min_lr=0", "train.eval_every=0", f"logging.run_dir={a.workdir}/{label}", "logging.log_every=1",
        "checkpoint.save_final=false", f"train.device={device.type}",
        f"train.precision={'bf16' if device.type == 'cuda' else 'fp32'}", *a.overrides, *extra])
    validate_gpt_config(cfg, 1)
    mesh = ParallelDims.from_config(cfg.parallel, 1).build()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    result = train_gpt(cfg, mesh, device)
    dt = statistics.median(result.step_times[a.warmup:])
    rows = [json.loads(x) for x in (Path(a.workdir) / label / "metrics.jsonl").read_text().splitlines()]
    # real tokens per step: the samples are packed, so nearly every position is a conversation token
    samples = cfg.train.micro_batch_size * (a.seq + 1)
    del result
    return {"label": label, "step_s": dt, "tok_s": samples / dt, "params_trained_M": None,
            "mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "loss_last": rows[-1]["loss"]}


def hf_llama(transformers, cfg_path: str, a, lora: bool):
    """``LlamaForCausalLM`` of the run's shape (random init, SDPA), with peft LoRA on all seven projections when
    ``lora``; None when ``lora`` and peft is not importable."""
    m = load_config(GPTRunConfig, cfg_path, a.overrides).model
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.kv_heads, vocab_size=m.vocab_size,
        max_position_embeddings=max(a.seq + 1, 128), rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings,
        attn_implementation="sdpa"))
    if not lora:
        return model
    try:
        import peft
    except ImportError:
        return None
    return peft.get_peft_model(model, peft.LoraConfig(
        r=a.lora_rank, lora_alpha=2 * a.lora_rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"]))


def hf_row(label: str, cfg_path: str, lengths, tokens, mask, a, device, lora: bool) -> dict | None:
    try:
        import transformers
    except ImportError:
        return None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = hf_llama(transformers, cfg_path, a, lora)
    if model is None:
        return None
    model = model.to(device, dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5,
                            fused=device.type == "cuda")
    starts = np.r_[0, np.cumsum(lengths)]
    # the same token budget per step as mmtrain's packed samples, one conversation per row, padded
    per_step, times, cursor, real = [], [], 0, []
    for _ in range(a.steps + a.warmup):
        rows, budget = [], a.batch * (a.seq + 1)
        while budget > 0:
            i = cursor % len(lengths)
            cursor += 1
            n = min(int(lengths[i]), a.seq + 1)
            rows.append(i)
            budget -= n
        per_step.append(rows)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for rows in per_step:
        width = min(max(int(lengths[i]) for i in rows), a.seq + 1)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        attn = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):
            n = min(int(lengths[i]), width)
            t = torch.as_tensor(tokens[starts[i]:starts[i] + n].astype(np.int64))
            ids[r, :n], attn[r, :n] = t, 1
            labels[r, :n] = torch.where(torch.as_tensor(mask[starts[i]:starts[i] + n] > 0), t, -100)
        ids, labels, attn = ids.to(device), labels.to(device), attn.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        real.append(int(attn.sum()))
    dt = statistics.median(times[a.warmup:])
    out = {"label": label, "step_s": dt, "tok_s": statistics.median(real[a.warmup:]) / dt,
           "mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
           "loss_last": float(loss)}
    del model, opt
    return out


def hf_trainer_row(label: str, cfg_path: str, lengths, tokens, mask, a, device, lora: bool,
                   flatten: bool) -> dict | None:
    """``transformers.Trainer`` as users run it (bf16 autocast over fp32 weights, fused AdamW), one conversation
    per row padded to the longest (``flatten=False``) or ``DataCollatorWithFlattening``'s packing (position ids
    restart per conversation); about the same tokens per step as the other rows. Step times come from a
    callback that synchronises the device at each step's start and end; real tokens from the collator."""
    try:
        import transformers
    except ImportError:
        return None
    model = hf_llama(transformers, cfg_path, a, lora)  # fp32 weights: the Trainer's bf16 is autocast
    if model is None:
        return None
    starts = np.r_[0, np.cumsum(lengths)]
    rows = []
    for i, n in enumerate(lengths):
        n = min(int(n), a.seq + 1)
        ids = tokens[starts[i]:starts[i] + n].astype(np.int64)
        rows.append({"input_ids": ids.tolist(),
                     "labels": np.where(mask[starts[i]:starts[i] + n] > 0, ids, -100).tolist()})
    per_row = max(1, round(a.batch * (a.seq + 1) / float(np.mean(np.minimum(lengths, a.seq + 1)))))
    real: list[int] = []
    flattening = transformers.DataCollatorWithFlattening(return_position_ids=True) if flatten else None

    def collate(features):
        real.append(sum(len(f["input_ids"]) for f in features))
        if flattening is not None:
            return flattening(features)
        width = max(len(f["input_ids"]) for f in features)
        out = {k: torch.full((len(features), width), fill, dtype=torch.long)
               for k, fill in (("input_ids", 0), ("labels", -100), ("attention_mask", 0))}
        for r, f in enumerate(features):
            n = len(f["input_ids"])
            out["input_ids"][r, :n] = torch.tensor(f["input_ids"])
            out["labels"][r, :n] = torch.tensor(f["labels"])
            out["attention_mask"][r, :n] = 1
        return out

    times: list[float] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            torch.cuda.synchronize() if device.type == "cuda" else None
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            torch.cuda.synchronize() if device.type == "cuda" else None
            times.append(time.perf_counter() - self.t0)

    args = transformers.TrainingArguments(
        output_dir=str(Path(a.workdir) / label), per_device_train_batch_size=1 if flatten else per_row,
        max_steps=a.steps + a.warmup, learning_rate=1e-5, bf16=device.type == "cuda", logging_steps=10**6,
        report_to=[], save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
        remove_unused_columns=False, optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",
        use_cpu=device.type != "cuda")
    if flatten:  # the flattening collator packs the rows of one batch: a batch of per_row conversations
        args.per_device_train_batch_size = per_row
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=collate,
                                   callbacks=[StepTimer()])
    out = trainer.train()
    dt = statistics.median(times[a.warmup:])
    row = {"label": label, "step_s": dt, "tok_s": statistics.median(real[a.warmup:len(times)]) / dt,
           "mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
           "loss_last": float(out.training_loss)}
    del trainer, model
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "configs/models/llama3.2-1b.yaml"))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--workdir", default="/tmp/mmtrain-bench-sft")
    ap.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    ap.add_argument("--tiny", action="store_true", help="CPU check: tiny model and sizes")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.tiny:
        a.model = str(REPO / "configs/models/tiny.yaml")
        a.seq, a.batch, a.steps, a.warmup, a.min_len, a.max_len, a.lora_rank = 64, 2, 3, 1, 8, 40, 4
    device = pick_device("auto")
    rank, world = init_distributed("auto", device)
    setup_logging(rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    vocab = load_config(GPTRunConfig, a.model, a.overrides).model.vocab_size
    prefix = Path(a.workdir) / "data" / "sft"
    lengths, tokens, mask = write_dataset(prefix, 4000 if not a.tiny else 200, a.min_len, a.max_len, vocab)
    runs = [
        ("mmtrain-sft-full", lambda: mmtrain_row("mmtrain-sft-full", a.model, prefix, a, [], device)),
        ("mmtrain-sft-lora", lambda: mmtrain_row("mmtrain-sft-lora", a.model, prefix, a,
                                                 [f"peft.lora.rank={a.lora_rank}",
                                                  f"peft.lora.alpha={2 * a.lora_rank}", "optim.lr=2e-4"], device)),
        ("hf-full-padded", lambda: hf_row("hf-full-padded", a.model, lengths, tokens, mask, a, device, False)),
        ("hf-lora-padded", lambda: hf_row("hf-lora-padded", a.model, lengths, tokens, mask, a, device, True)),
        ("hf-trainer-full-padded", lambda: hf_trainer_row("hf-trainer-full-padded", a.model, lengths, tokens, mask,
                                                          a, device, lora=False, flatten=False)),
        ("hf-trainer-full-flattened", lambda: hf_trainer_row("hf-trainer-full-flattened", a.model, lengths,
                                                             tokens, mask, a, device, lora=False, flatten=True)),
        ("hf-trainer-lora-flattened", lambda: hf_trainer_row("hf-trainer-lora-flattened", a.model, lengths,
                                                             tokens, mask, a, device, lora=True, flatten=True)),
    ]
    results = []
    for label, fn in runs:
        if a.only and label not in a.only:
            continue
        try:
            row = fn()
        except torch.OutOfMemoryError:
            row = {"label": label, "error": "out of memory"}
        if row is not None:
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n| run | step s | tok/s | peak GiB | last loss |  (seq {a.seq}, batch {a.batch}, {a.model})")
    print("|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['label']} | {r['error']} | | | |")
            continue
        mem = f"{r['mem_gib']:.1f}" if r["mem_gib"] is not None else "-"
        print(f"| {r['label']} | {r['step_s']:.3f} | {r['tok_s']:,.0f} | {mem} | {r['loss_last']:.3f} |")


if __name__ == "__main__":
    main()
