#!/usr/bin/env bash
# Issue #34 part 3 on one H200 (about 4 minutes, each stage capped): GRPO rollouts/s and the split of a step between
# generation and training for the Llama-3.2-1B shape, mmtrain (python -m mmtrain.pretrain_gpt with
# train.objective=grpo: the policy's own KV-cache decoder on the training stage) beside TRL's GRPOTrainer
# (transformers' model of the same shape, its generate) in the same call. Same tokenizer (.device/data/sp.model; TRL
# gets its HF export), task (arithmetic sample prompts, mmtrain.rewards:arithmetic_exact_match), batch (PROMPTS
# prompts x GROUP completions a step, micro-batches of MICRO prompts), MAX_NEW new tokens at most, temperature 1,
# beta 0, TRL's default loss (dapo), bf16, random init (a speed figure: completions run to MAX_NEW tokens unless
# the end-of-document token is drawn), no activation recompute; medians of STEPS steps after 2 of warm-up
# (bench/grpo_h200.py says how each figure is measured).
# Setup (here): bash bench/fetch_grpo_wheels.sh    -> .device/whl-grpo (trl, accelerate, psutil, protobuf)
# Run (device, repo root, carry=[".device"]: whl/ for xxhash, whl-grpo/, data/sp.model):  bash bench/h200_grpo.sh
# A CPU check of the script: MODEL=configs/models/tiny.yaml DEVICE=cpu TOK=<a tokenizer.json of < 512 ids> PROMPTS=4
# GROUP=4 MICRO=2 MAX_NEW=16 STEPS=2 bash bench/h200_grpo.sh
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "data wheels"
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
for dir in .device/whl .device/whl-grpo; do
  ls $dir/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site $dir/*.whl 2>&1 | grep -v "already exists"
done
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TOK=${TOK:-.device/data/sp.model}
COMMON=(--model "${MODEL:-configs/models/llama3.2-1b.yaml}" --device "${DEVICE:-cuda}" --tokenizer "$TOK"
        --prompts "${PROMPTS:-16}" --group "${GROUP:-8}" --micro "${MICRO:-4}" --max-new "${MAX_NEW:-128}" --steps "${STEPS:-6}" --warmup 2)
rows=()
echo "### mmtrain GRPO (python -m mmtrain.pretrain_gpt train.objective=grpo)"
mm=$(timeout -k 5 "${MM_TIMEOUT:-200}" python3 bench/grpo_h200.py mmtrain "${COMMON[@]}" 2>&1 | tee /tmp/grpo_mm.log \
     | grep -E '^\{' | tail -1)
[ -n "$mm" ] || tail -8 /tmp/grpo_mm.log
echo "$mm"; rows+=("$mm")
echo "### TRL GRPOTrainer"
datasets_flag=--shim-datasets
python3 -c "import datasets, pandas" 2>/dev/null && datasets_flag=""
trl=$(timeout -k 5 "${TRL_TIMEOUT:-260}" python3 bench/grpo_h200.py trl "${COMMON[@]}" $datasets_flag 2>&1 \
      | tee /tmp/grpo_trl.log | grep -E '^\{' | tail -1)
[ -n "$trl" ] || grep -E "Error|error" /tmp/grpo_trl.log | tail -5
echo "$trl"; rows+=("$trl")
echo "### table"
echo "| engine | rollouts/s | step s | generation s | training s | completion tokens | peak GiB |"
echo "|---|---|---|---|---|---|---|"
for r in "${rows[@]}"; do
  python3 - "$r" <<'PY'
import json, sys
r = json.loads(sys.argv[1]) if sys.argv[1].startswith("{") else {}
if r:
    print(f"| {r['engine']} | {r['rollouts_per_s']} | {r['step_s']} | {r['generation_s']} | {r['train_s']} | "
          f"{r['completion_tokens']} | {r['peak_mem_gib']} |")
PY
done
true
