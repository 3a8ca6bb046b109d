#!/usr/bin/env bash
# Issue #34 part 1 on one H200: knowledge distillation's training speed beside plain training, one table.
# The student is Llama-3.2-1B's shape (configs/models/llama3.2-1b.yaml); each teacher a random weights-only checkpoint
# of a larger shape with the student's vocabulary (llama3-8b: Llama-3-8B's shape, the largest that fits beside the
# 1B's training on one H200), written first in bf16 (a random teacher costs what a trained one does). Both runs go
# through the product's training loop (bench/train_gpt.py -> mmtrain.train.loop.train_gpt), compiled bf16, on the
# prepped tokens (.device/data/text: mmtrain-prep text of bench/prep_text.py's corpus), packed documents,
# BATCH x SEQ per step, the median of the timed steps:
#   plain    : train.objective=lm (the baseline)
#   TEACHER  : train.objective=distill distill.teacher=<its checkpoint> (full-vocabulary KL, T=1, alpha=1): the
#              teacher's forward + the KL on top of the student's step. tokens/s counts the student's tokens.
# Usage (repo root; carry .device):  STAGES="plain llama3-8b" bash bench/h200_distill.sh
# Knobs: BATCH (4), SEQ (4096), STEPS (8 timed, 3 warmup), TOPK (0; k > 0 adds distill.top_k=k to the KD rows),
#        CKPTS (/tmp/distill_teachers: the teachers' checkpoints, deleted after each row; ~16 GB for 8B).
# Each stage is cut by `timeout -k`: the teacher checkpoint 120 s, the plain row 150 s, a distillation row 210 s
# (8 minutes at most for the default STAGES; the teacher's build reads its weights, it skips their random init).
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "data"
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
DATA=${DATA:-.device/data/text}
BATCH=${BATCH:-4}; SEQ=${SEQ:-4096}; STEPS=${STEPS:-8}; TOPK=${TOPK:-0}
CKPTS=${CKPTS:-/tmp/distill_teachers}
STUDENT=configs/models/llama3.2-1b.yaml
VOCAB=$(python3 -c "import yaml; print(yaml.safe_load(open('$STUDENT'))['model']['vocab_size'])")
rows=()

train() {  # seconds, label, overrides...: one bench/train_gpt.py row (its JSON line), or nothing when it failed
  local limit=$1 label=$2; shift 2
  PYTHONPATH=$PWD timeout -k 5 "$limit" python3 bench/train_gpt.py --model "$STUDENT" --data "$DATA" \
    --packed --batch "$BATCH" --seq "$SEQ" --steps "$STEPS" --label "$label" train.compile=true "$@" 2>&1 \
    | tee "/tmp/distill_$label.log" | grep -E '^\{' | tail -1
}

for stage in ${STAGES:-plain llama3-8b}; do
  if [ "$stage" = plain ]; then
    echo "### plain: the 1B on hard labels ($BATCH x $SEQ, $DATA)"
    row=$(train "${PLAIN_TIMEOUT:-150}" plain)
    [ -n "$row" ] || tail -5 /tmp/distill_plain.log
    echo "$row"; rows+=("plain|-|$row")
    continue
  fi
  ckpt=$CKPTS/$stage
  echo "### $stage: random teacher checkpoint (bf16, vocab $VOCAB) -> $ckpt"
  rm -rf "$ckpt"
  PYTHONPATH=$PWD timeout -k 5 ${CKPT_TIMEOUT:-120} python3 - "configs/models/$stage.yaml" "$VOCAB" "$ckpt" <<'EOF'
import sys, time
import torch
from mmtrain.config import GPTRunConfig, load_config
from mmtrain.convert.checkpoint_io import write_weights_checkpoint
from mmtrain.models.registry import model_family
model_yaml, vocab, out = sys.argv[1:4]
t0 = time.perf_counter()
cfg = load_config(GPTRunConfig, model_yaml, [f"model.vocab_size={vocab}"]).model
with torch.device("meta"):  # names and shapes only
    shapes = {n: t.shape for n, t in model_family(cfg).build_stage(cfg, (0, cfg.shape().num_layers), True,
                                                                   True).state_dict().items()}
g = torch.Generator(device="cuda").manual_seed(0)
full = {n: torch.ones(s, dtype=torch.bfloat16) if len(s) == 1 else
        (0.02 * torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g)).cpu() for n, s in shapes.items()}
write_weights_checkpoint(out, full, cfg)
print(f"{sum(t.numel() for t in full.values()) / 1e9:.2f}B parameters written in {time.perf_counter() - t0:.0f} s")
EOF
  [ -f "$ckpt/latest" ] || { rows+=("$stage|-|"); continue; }
  kd=(train.objective=distill "distill.teacher=$ckpt")
  [ "$TOPK" = 0 ] || kd+=("distill.top_k=$TOPK")
  echo "### $stage -> 1B: ${kd[*]}"
  row=$(train "${KD_TIMEOUT:-210}" "distill-$stage" "${kd[@]}")
  [ -n "$row" ] || tail -5 "/tmp/distill_distill-$stage.log"
  echo "$row"; rows+=("$stage|$TOPK|$row")
  rm -rf "$ckpt"
done
echo "### table (student: Llama-3.2-1B shape, $BATCH x $SEQ packed documents, compiled bf16, one H200)"
echo "| run | teacher | top_k | student tokens/s | step ms | peak GiB | vs plain |"
echo "|---|---|---|---|---|---|---|"
for r in "${rows[@]}"; do
  python3 - "$r" "${rows[0]}" <<'EOF'
import json, sys
name, top_k, row = sys.argv[1].split("|", 2)
base = sys.argv[2].split("|", 2)[2]
row = json.loads(row) if row.startswith("{") else {}
base = json.loads(base) if base.startswith("{") and sys.argv[2].startswith("plain|") else {}
ratio = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x" if row and base else "-"
run = "plain" if name == "plain" else "distill"
print(f"| {run} | {'-' if name == 'plain' else name} | {top_k} | {row.get('tokens_per_s', 'failed')} | "
      f"{row.get('step_ms', '-')} | {row.get('peak_mem_gib', '-')} | {ratio} |")
EOF
done
true
