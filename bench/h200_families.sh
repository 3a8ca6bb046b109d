#!/usr/bin/env bash
# Issue #31 on one H200: decode speed before/after the one-forward change, and training speed of the new families
# beside transformers' own model of the same shape, in one device call (stages chosen by STAGES, each capped).
#   decode : bench/generate.py --batch 1 32 (Llama-3.2-1B shapes) in PREV (an earlier tree, `git archive` into
#            the carried .device) and in this tree, same warm machine
#   gputest: tests/gpu of attention windows, packed attention and generation
#   MODEL  : any configs/models/<MODEL>.yaml: mmtrain compiled (bench/train_gpt.py, the product's loop) then
#            bench/hf_family_baseline.py (transformers' model from the family's HF adapter), the same prepped
#            tokens (.device/data/text: mmtrain-prep text of bench/prep_text.py's corpus, SentencePiece 32k)
# Usage (repo root; carry .device):  PREV=.device/prev STAGES="decode gputest qwen3-1.7b" bash bench/h200_families.sh
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "data prev"
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
here=$PWD
DATA=${DATA:-.device/data/text}
BATCH=${BATCH:-4}; SEQ=${SEQ:-4096}
rows=()
for stage in ${STAGES:-decode gputest qwen3-1.7b gemma3-1b qwen3-moe-2b}; do
  case $stage in
    decode)
      for tree in ${PREV:-} "$here"; do
        echo "### decode: $tree"
        (cd "$tree" && PYTHONPATH=$PWD timeout -k 5 150 python3 bench/generate.py --batch 1 32 2>&1 \
          | grep -E '^\||Error' | tail -4)
      done ;;
    gputest)
      echo "### GPU tests"
      PYTHONPATH=$PWD timeout -k 5 200 python3 -m pytest -q -rf -p no:cacheprovider tests/gpu/test_attention_window_gpu.py \
        tests/gpu/test_packed_attention_gpu.py tests/gpu/test_generate_gpu.py 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -8 ;;
    *)
      model=configs/models/$stage.yaml
      echo "### $stage: mmtrain compiled, then transformers ($BATCH x $SEQ, $DATA)"
      mm=$(PYTHONPATH=$PWD timeout -k 5 ${MM_TIMEOUT:-200} python3 bench/train_gpt.py --model "$model" --data "$DATA" \
             --batch "$BATCH" --seq "$SEQ" --label "mmtrain-$stage" train.compile=true 2>&1 | tee /tmp/mm_$stage.log | grep -E '^\{' | tail -1)
      [ -n "$mm" ] || tail -5 /tmp/mm_$stage.log
      hf=$(PYTHONPATH=$PWD timeout -k 5 ${HF_TIMEOUT:-150} python3 bench/hf_family_baseline.py --model "$model" --data "$DATA" \
             --batch "$BATCH" --seq "$SEQ" 2>&1 | tee /tmp/hf_$stage.log | grep -E '^\{' | tail -1)
      [ -n "$hf" ] || tail -5 /tmp/hf_$stage.log
      echo "$mm"; echo "$hf"
      rows+=("$stage|$mm|$hf") ;;
  esac
done
echo "### table"
echo "| shape | mmtrain tokens/s | MFU | HF tokens/s | MFU | HF attention | ratio |"
echo "|---|---|---|---|---|---|---|"
for r in "${rows[@]}"; do
  python3 - "$r" <<'EOF'
import json, sys
name, mm, hf = sys.argv[1].split("|", 2)
mm = json.loads(mm) if mm.startswith("{") else {}
hf = json.loads(hf) if hf.startswith("{") else {}
ratio = f"{mm['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if mm and hf else "-"
print(f"| {name} | {mm.get('tokens_per_s', 'failed')} | {mm.get('mfu', '-')} | {hf.get('tokens_per_s', 'failed')} | "
      f"{hf.get('mfu', '-')} | {hf.get('attention', '-')} | {ratio} |")
EOF
done
true
