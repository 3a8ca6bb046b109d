#!/usr/bin/env bash
# Issue #33's speed rows on one H200 in one device call (at most 8 minutes), one table at the end. Stages, in the
# default order (most wanted first: what does not fit in BUDGET is skipped and says so):
#   gputest : tests/gpu/test_ssd_mamba_gpu.py, mamba-ssm's kernels (the scan the hybrid trains with on Hopper,
#             ssd_mamba.py) against the PyTorch reference (errors printed). Its first test runs the training
#             configuration (bf16, whole rows) with mamba-ssm's full autotuning: Triton compiles ~120 kernel
#             configs once (a minute or two) into its disk cache, which the later processes load (they re-time
#             the configs, seconds; TRITON_CACHE_AUTOTUNING=1 keeps the timings of the kernels without pre-hooks);
#             the other tests run each kernel's smallest config (values, not speed)
#   hybrid  : configs/models/hybrid-1b.yaml trained by mmtrain (bench/train_gpt.py: the loop mmtrain.pretrain_gpt
#             runs), compiled bf16, on the prepped tokens, at 4x4096 and 1x32768
#   llama   : configs/models/llama3.2-1b.yaml, the attention-only 1B, same loop and data, 1x32768 and 4x4096
#   hf      : the same shape in transformers (bench/hf_family_baseline.py: NemotronHForCausalLM from the family's
#             config_to_hf, bf16, its own PyTorch path) at 4x4096, transformers 5.24 (the device has 5.17, whose
#             NemotronH scan broadcasts (chunk x chunk x heads x state) products instead of 5.24's einsums)
#   ssd     : bench/ssd_scan.py, the chunked scan alone (reference vs mamba-ssm; fla's row is left out: its backward
#             is refused on Hopper and its autotuning ran this stage into its timeout before) and the compiled
#             causal conv, at 4x4096 and 1x32768
#   flatest : tests/gpu/test_ssd_triton_gpu.py, fla-core's kernels (decoding's scan on Hopper; the gradients
#             skipped there) against the references, with whatever time is left
# Carry .device (bench/fetch_hybrid_wheels.sh fills it): whl/ (fla-core 0.6.0 and einops 0.8.2, with the wheels
# other scripts put there), whl-mamba/ (mamba-ssm 2.3.2.post1 built without its CUDA extension:
# MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE; its Triton kernels only), whl-transformers/ (transformers
# 5.24.0, kept apart so other scripts keep the device's 5.17), data/text.{bin,idx,manifest.json} (mmtrain-prep
# text of bench/prep_text.py's corpus, as for bench/h200_families.sh).
# Every stage runs under `timeout -k`; a stage is skipped once BUDGET seconds (default 400) have passed, and each
# timeout is cut to end by LIMIT seconds (default 470), so the call ends inside 8 minutes.
# Usage (repo root):  bash bench/h200_hybrid.sh        [STAGES="gputest hybrid llama hf ssd flatest"]
# CPU check of the plumbing (tiny shapes, mock tokens, no compile, no GPU stages):  TINY=1 bash bench/h200_hybrid.sh
# Results: $OUT (or /tmp/h200_hybrid): hybrid.log, rows.jsonl, table.md
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "data wheels"
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
RES=${OUT:-/tmp/h200_hybrid}
BUDGET=${BUDGET:-400}
LIMIT=${LIMIT:-470}
mkdir -p "$RES"
: > "$RES/rows.jsonl"
exec > >(tee "$RES/hybrid.log") 2>&1
WHEELS=$(ls .device/whl/*.whl .device/whl-mamba/*.whl 2>/dev/null)
if [ -n "$WHEELS" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $WHEELS \
    2>&1 | grep -v "already exists"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
HF_PATH=$PYTHONPATH
if ls .device/whl-transformers/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/transformers \
    .device/whl-transformers/*.whl 2>&1 | grep -v "already exists"
  HF_PATH=/tmp/transformers:$PYTHONPATH
fi
left() { [ "$SECONDS" -lt "$BUDGET" ] || { echo "### skipped (over BUDGET=$BUDGET s): $*"; return 1; }; }
cap() { local c=$((LIMIT - SECONDS)); [ "$c" -lt "$1" ] && echo "$c" || echo "$1"; }  # a timeout ending by LIMIT

DATA=(--data .device/data/text)
HYBRID=configs/models/hybrid-1b.yaml; LLAMA=configs/models/llama3.2-1b.yaml
SHAPES=("4 4096" "1 32768"); LLAMA_SHAPES=("1 32768" "4 4096"); HF_SHAPES=("4 4096" "1 4096")  # 4x4096 ran out of memory on an H200 in transformers 5.24 (its PyTorch scan)
STEPS=(--warmup 3 --steps 5); TRAIN=(train.compile=true)
SSD=(--shapes 4x4096 1x32768 --scans reference mamba --convs compiled --iters 5)
export TRITON_CACHE_AUTOTUNING=1
if [ "${TINY:-0}" = 1 ]; then
  STAGES=${STAGES:-"hybrid llama ssd"}
  HYBRID=/tmp/h200_hybrid_tiny.yaml
  printf 'model:\n  family: nemotron_h\n  nemotron_h:\n    vocab_size: 512\n' > "$HYBRID"
  LLAMA=configs/models/tiny.yaml; DATA=(); SHAPES=("2 64" "1 128"); LLAMA_SHAPES=("1 128" "2 64")
  STEPS=(--warmup 1 --steps 2); TRAIN=(train.device=cpu train.precision=fp32 train.compile=false)
  SSD=(--shapes 1x256 --heads 4 --groups 2 --iters 1 --convs eager)
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fi
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers (mmtrain stages)', transformers.__version__)"
PYTHONPATH=$HF_PATH $PY -c "import transformers; print('transformers (hf stage)', transformers.__version__)"
$PY -c "import fla; print('fla-core', fla.__version__)" || echo "fla-core missing: carry .device/whl"
$PY -c "from mmtrain.models.nemotron_h import ssd_mamba
try: print('mamba-ssm Triton SSD kernels:', ssd_mamba.load_mamba_ssd().__file__)
except ImportError as err: print(err, '(carry .device/whl-mamba)')"

train_row() {  # label model batch seq [timeout]: one mmtrain training run -> rows.jsonl
  local out
  out=$(timeout -k 5 "$(cap "${5:-120}")" $PY bench/train_gpt.py --model "$2" --batch "$3" --seq "$4" "${DATA[@]}" \
        "${STEPS[@]}" --label "$1" "${TRAIN[@]}" 2>&1 | tee "$RES/$1-$3x$4.log" | grep -E '^\{' | tail -1)
  if [ -n "$out" ]; then echo "$out" | tee -a "$RES/rows.jsonl"
  else tail -4 "$RES/$1-$3x$4.log"; echo "{\"system\": \"$1\", \"seq\": \"$3x$4\", \"failed\": true}" >> "$RES/rows.jsonl"; fi
}

for stage in ${STAGES:-gputest hybrid llama hf ssd flatest}; do
  case $stage in
    gputest)
      left gputest || continue
      echo "### GPU tests: mamba-ssm's scan against the PyTorch reference (errors: norm-relative; autotunes first)"
      timeout -k 5 "$(cap 210)" $PY -m pytest -q -s -rfs -p no:cacheprovider tests/gpu/test_ssd_mamba_gpu.py 2>&1 \
        | grep -E "ssd-errors|passed|failed|FAILED|SKIPPED|Error" | tail -20 ;;
    flatest)
      left flatest || continue
      echo "### GPU tests: fla's kernels against the PyTorch references (what time is left)"
      timeout -k 5 "$(cap 120)" $PY -m pytest -q -s -rf -p no:cacheprovider tests/gpu/test_ssd_triton_gpu.py 2>&1 \
        | grep -E "ssd-errors|passed|failed|FAILED|Error" | tail -20 ;;
    ssd)
      left ssd || continue
      echo "### the scan and the conv alone (bench/ssd_scan.py)"
      timeout -k 5 "$(cap 90)" $PY bench/ssd_scan.py --model "$HYBRID" "${SSD[@]}" 2>&1 | grep -vE '^\{' | tail -16 ;;
    hybrid|llama)
      model=$HYBRID; shapes=("${SHAPES[@]}")
      [ "$stage" = llama ] && { model=$LLAMA; shapes=("${LLAMA_SHAPES[@]}"); }  # 32k first: the goal's row
      for shape in "${shapes[@]}"; do
        set -- $shape
        left "$stage $1x$2" || continue
        echo "### mmtrain $stage $1x$2 ($model, ${TRAIN[*]})"
        # the first hybrid row loads (or, after a failed gputest, compiles) mamba-ssm's autotuned kernels
        train_row "mmtrain-$stage" "$model" "$1" "$2" "$([ "$stage $1x$2" = "hybrid 4x4096" ] && echo 180 || echo 120)"
      done ;;
    hf)
      for shape in "${HF_SHAPES[@]}"; do
        set -- $shape
        left "hf $1x$2" || continue
        echo "### transformers NemotronHForCausalLM $1x$2 (hybrid-1b's shape)"
        # the export writes time_step_limit's low end as HF's time_step_min (its dt clamp), and transformers'
        # random init takes log(time_step_min): 0.0 fails there, so this row clamps dt at 0.001 (no speed effect)
        out=$(PYTHONPATH=$HF_PATH timeout -k 5 "$(cap 90)" $PY bench/hf_family_baseline.py --model "$HYBRID" \
              --batch "$1" --seq "$2" "${DATA[@]}" --steps 5 "model.nemotron_h.time_step_limit=[0.001,null]" 2>&1 \
              | tee "$RES/hf-$1x$2.log" | grep -E '^\{' | tail -1)
        if [ -n "$out" ]; then echo "$out" | tee -a "$RES/rows.jsonl"
        else tail -4 "$RES/hf-$1x$2.log"; echo "{\"system\": \"hf-transformers\", \"seq\": \"$1x$2\", \"failed\": true}" >> "$RES/rows.jsonl"; fi
      done ;;
  esac
done

echo "### table ($SECONDS s)"
$PY - "$RES/rows.jsonl" <<'EOF' | tee "$RES/table.md"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("| system | B x S | tokens/s | MFU | step ms | peak GiB | note |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    note = "failed (see its log)" if r.get("failed") else r.get("attention", "") + (
        f" transformers {r['transformers']}, Mamba path {r['mamba']}" if "mamba" in r else "")
    print(f"| {r['system']} | {r['seq']} | {r.get('tokens_per_s', '-')} | {r.get('mfu', '-')} | "
          f"{r.get('step_ms', '-')} | {r.get('peak_mem_gib', '-')} | {note.strip()} |")
speed = {(r["system"], r["seq"]): r.get("tokens_per_s") for r in rows}
def ratio(a, b, what):
    if speed.get(a) and speed.get(b):
        print(f"- {what}: {speed[a] / speed[b]:.2f}x ({a[0]} {a[1]} / {b[0]} {b[1]})")
seqs = sorted({r["seq"] for r in rows}, key=lambda s: int(s.split("x")[1]))
if seqs:
    ratio(("mmtrain-hybrid", seqs[-1]), ("mmtrain-llama", seqs[-1]), "hybrid vs attention-only, per token, longest")
    ratio(("mmtrain-hybrid", seqs[0]), ("hf-transformers", seqs[0]), "hybrid mmtrain vs transformers")
EOF
true
