"""A complete custom training loop on mmtrain's public API: layout, model, schedule, gradients, optimizer,
checkpoint save and reload. The counterpart of Megatron-LM's examples/run_simple_mcore_train_loop.py.

    torchrun --nproc_per_node 2 examples/simple_train_loop.py --tp 2          # or --pp 2
    torchrun --nproc_per_node 2 examples/simple_train_loop.py --pp 2 --data shards/web   # real .bin/.idx data

Runs on the CPU with gloo (default) or on GPUs with NCCL (--device cuda).
"""

import argparse
import os
import tempfile

import torch

import mmtrain as mt

ap = argparse.ArgumentParser()
ap.add_argument("--tp", type=int, default=1)
ap.add_argument("--pp", type=int, default=1)
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--data", default="", help="an indexed dataset prefix; default: mock tokens")
ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
ap.add_argument("--ckpt", default="", help="checkpoint folder (default: a temporary one)")
args = ap.parse_args()

# 1. Configuration: defaults + overrides, validated against the world size before any group exists.
world = int(os.environ.get("WORLD_SIZE", "1"))
data = [f"data.prefixes=[{args.data}]"] if args.data else ["data.mock=true"]
cfg = mt.load_config(mt.GPTRunConfig, None, [
    *data, "data.seq_length=64", "model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4",
    "model.ffn_hidden_size=128", f"parallel.tp={args.tp}", f"parallel.pp={args.pp}", f"train.device={args.device}",
    "train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=8", f"train.steps={args.steps}",
    "optim.lr=3e-3", "optim.warmup_steps=2"])
mt.validate_gpt_config(cfg, world_size=world)

# 2. Processes and the parallel layout: every process group is built once, here, and passed around.
device = mt.pick_device(cfg.train.device)
rank, world = mt.init_distributed("auto", device)
mesh = mt.ParallelDims.from_config(cfg.parallel, world).build()

# 3. This rank's model piece (pipeline stage, TP shard), gradient buckets and the distributed optimizer.
model = mt.build_gpt_stage(cfg, mesh, device)
buckets = [mt.GradBuckets(list(model.parameters()), mesh.dp_cp_group, distributed_optimizer=True,
                          param_dtype=torch.float32)]
optimizer = mt.MixedPrecisionAdamW(buckets, lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

# 4. Data: each data-parallel rank takes its micro-batches from one global order.
samples = mt.MockGPTSamples(cfg.model.vocab_size, cfg.data.seq_length) if cfg.data.mock else \
    mt.build_gpt_samples_from_config(cfg, "train", mesh.dims.dp, index_builder=mesh.node_local_rank == 0)
batches = mt.MicroBatches(samples, cfg.train.micro_batch_size, mesh.coord.dp, mesh.dims.dp)
num_micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * mesh.dims.dp)


def train_step(step: int) -> float:
    for group in optimizer.param_groups:
        group["lr"] = mt.lr_at(step, cfg.train.steps, cfg.optim)
    for b in buckets:
        b.reset()
    micro = [batches.next() for _ in range(num_micro)]
    # forward-backward over the micro-batches (1F1B across pipeline stages); losses are token sums
    stats = mt.reduce_loss_stats(mt.run_micro_batches(model, micro, mesh, cfg, device, buckets), mesh)
    mt.finalize_grads(model, mesh, buckets, optimizer, num_tokens=stats[1].item())
    mt.clip_grad_norm(model, mesh, optimizer, max_norm=1.0)
    optimizer.step()
    return (stats[0] / stats[1]).item()


for step in range(1, cfg.train.steps + 1):
    loss = train_step(step)
    if rank == 0:
        print(f"step {step:2d}  loss {loss:.4f}", flush=True)

# 5. Checkpoint: save, rebuild everything from scratch, load, and check the next step matches.
holder = [args.ckpt or (tempfile.mkdtemp(prefix="mmtrain-example-") if rank == 0 else None)]
torch.distributed.broadcast_object_list(holder, src=0)  # every rank saves into rank 0's folder
folder = mt.save_checkpoint(holder[0], cfg.train.steps, mesh, model, optimizer, batches.state_dict(), device)
expected = train_step(cfg.train.steps + 1)

model = mt.build_gpt_stage(cfg, mesh, device)
buckets = [mt.GradBuckets(list(model.parameters()), mesh.dp_cp_group, True, torch.float32)]
optimizer = mt.MixedPrecisionAdamW(buckets, lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
restored = mt.load_checkpoint(folder, mesh, model, optimizer, device)
batches.load_state_dict(restored["loader"])
again = train_step(cfg.train.steps + 1)
if rank == 0:
    print(f"reloaded step {restored['step']}: next loss {again:.6f} (before reload {expected:.6f})", flush=True)
    assert again == expected, "a reloaded checkpoint must continue exactly"
mt.shutdown_distributed()
