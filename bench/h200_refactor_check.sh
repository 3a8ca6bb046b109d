#!/usr/bin/env bash
# One device call on one H200: the 1B BF16 and FP8 rows of bench/fp8_h200.py on a tree from before a refactor
# (.device/before: `git archive <commit> | tar -x -C .device/before`) and on this tree, interleaved; then the
# DeepSeek-V3-style model's tokens/s and MFU; then the GPU tests.
# Usage, from the repo root, carrying .device (before/ and whl/: xxhash + pytest wheels for Python 3.12):
#   ROUNDS=1 SKIP_DEEPSEEK=1 SKIP_TESTS=1 bash bench/h200_refactor_check.sh   (the rows alone: ~4 x 100 s; a
#   round is 4 processes, so ROUNDS=2 or the DeepSeek row and tests need a second call)
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels before" --before REV
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ "${SKIP_PATHS:-0}" = 1 ] || { echo "### the step's passes over 1B bf16 gradients, old and new (bench/grad_scale_paths.py)"
timeout 90 python3 bench/grad_scale_paths.py 2>&1 | tail -9; }
ROWS=(bf16 "fp8 native delayed fast-bwd fp8-head")
# Each row of each tree through bench/wall_steps.py: the tree's own bench/train_gpt.py (its JSON line, its step
# timer) plus wall-clock tokens/s over the timed steps with a device sync at both ends -- the like-for-like
# figure (the trees' step timers differ: the old one stopped before the AdamW kernels finished). Both trees get
# the same logging.log_every (LOG_EVERY, default 1 = the config default; 10 shows the loop's no-sync steps).
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in before after; do
    dir=$PWD; [ $tree = before ] && dir=$PWD/.device/before
    for row in "${ROWS[@]}"; do
      echo "### round $round, $tree, $row"
      timeout 200 python3 bench/wall_steps.py --tree "$dir" --row "$row" --steps "${STEPS:-12}" \
        "logging.log_every=${LOG_EVERY:-1}" 2>&1 | grep -E '^SUMMARY|Error' | tail -4
    done
  done
done
[ "${SKIP_DEEPSEEK:-0}" = 1 ] || { echo "### deepseek-v3-style (V2-Lite-like width, 4 layers), bf16, 2 x 4096"
timeout 120 python3 bench/deepseek_v3_tokens.py --batch 2 --seq 4096 model.hidden_size=2048 model.num_layers=4 \
  model.num_attention_heads=16 model.q_lora_rank=null model.kv_lora_rank=512 model.qk_nope_head_dim=128 \
  model.qk_rope_head_dim=64 model.v_head_dim=128 model.n_routed_experts=64 model.num_experts_per_tok=6 \
  model.n_shared_experts=2 model.moe_intermediate_size=1408 model.intermediate_size=10944 \
  model.n_group=1 model.topk_group=1 model.vocab_size=102400 2>&1 | tail -2; }
[ "${SKIP_TESTS:-0}" = 1 ] || timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -4
