"""How much of causal attention FlexAttention visits in packed micro-batches: per micro-batch, the key blocks of
its block mask (partial and full) over the causal count, from the product's loader on prepped text.

    python bench/packed_blocks.py --data .device/data/text [--batch 4] [--seq 4096] [--batches 40]

Runs on the CPU (no model, no GPU): the loader with the packed keys (positions restart, attention inside each
document, EOD loss mask) as bench/train_gpt.py --packed sets them, and ``mmtrain.model.attention.
document_block_mask`` on each micro-batch's document ids. Prints the fractions' spread and each one in order.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mmtrain.config import GPTRunConfig, load_config  # noqa: E402
from mmtrain.data.documents import DocumentRule  # noqa: E402
from mmtrain.data.loader import MicroBatches  # noqa: E402
from mmtrain.model.attention import FLEX_BLOCK, document_block_mask  # noqa: E402
from mmtrain.train import loop  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="prefix of prepped text with EOD tokens (e.g. .device/data/text)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--vocab-size", type=int, default=32000, help="at least the data's largest token id + 1")
    a = ap.parse_args()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    cfg = load_config(GPTRunConfig, None, [
        "data.mock=false", f"data.prefixes=[{a.data}]", "data.split=100,0,0", f"data.seq_length={a.seq}",
        f"train.micro_batch_size={a.batch}", "data.reset_position_ids=true", "data.reset_attention_mask=true",
        "data.eod_mask_loss=true", f"model.vocab_size={a.vocab_size}", "train.device=cpu",
        "logging.run_dir=/tmp/mmtrain-packed-blocks"])
    samples = loop._build_samples(cfg, "train", 1, True)
    batches = MicroBatches(samples, a.batch, 0, 1, documents=DocumentRule.from_config(cfg.data, samples.eod_id))
    n = -(-a.seq // FLEX_BLOCK)
    causal = n * (n + 1) // 2
    fractions, documents = [], []
    for _ in range(a.batches):
        mb = batches.next()
        mask = document_block_mask(mb.document_ids, mb.document_ids, 0)
        visited = (mask.kv_num_blocks.sum(-1) + mask.full_kv_num_blocks.sum(-1)).float() / causal
        fractions.append(float(visited.mean()))
        documents.append(float((mb.document_ids[:, -1] + 1).float().mean()))
    print(f"{a.batches} micro-batches of {a.batch}x{a.seq}: block fraction mean {statistics.mean(fractions):.3f}, "
          f"median {statistics.median(fractions):.3f}, {min(fractions):.3f} to {max(fractions):.3f} "
          f"(stdev {statistics.stdev(fractions):.3f}); documents a row {statistics.mean(documents):.1f}")
    print(" ".join(f"{f:.2f}" for f in fractions))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
