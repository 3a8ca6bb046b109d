#!/usr/bin/env bash
# Issue #34's GPU figures (distillation, post-training quantization, GRPO) in ONE device call on one H200 (ends by
# LIMIT seconds, default 550), one combined table at the end. Stages, in this order (each under `timeout -k`, each
# skipped when fewer than its NEED seconds are left before LIMIT, each timeout cut to end by LIMIT):
#   train   : python -m mmtrain.pretrain_gpt, Llama-3.2-1B shape, STEPS (250) steps of 8 x 2048 tokens of
#             .device/data/text (mmtrain-prep text, SentencePiece 32k, 2.75M tokens: ~one epoch), packed documents,
#             compiled bf16, data.split=96,3,1, checkpoint at the end. Its steps after the first log interval (the
#             compile) are also the "plain" row of the distillation table (same loop, data, batch as the KD row).
#   random  : instead of train, for speed-only rows: random weights of the student's shape at the same place
#             (bench/random_checkpoint.py; perplexities then mean nothing)
#   quant   : at once (nothing timed meanwhile): python -m mmtrain.quantize fp8, w4a16 rtn, w4a16 gptq (CALIB (64)
#             samples of 2048 tokens of the train split); the teacher's random checkpoint (bench/random_checkpoint.py,
#             TEACHER (llama3-8b) shape, the student's vocabulary, bf16, ~16 GB); tests/gpu/test_quantize_gpu.py
#             QUANTS picks the folders ("fp8:rtn" for FP8 alone), GPUTESTS=0 leaves the GPU tests out, and the
#             teacher is made here only when the distill stage follows
#   table   : bench/quant_accuracy.py: perplexity on the valid split (EVAL (32) samples of 2048 tokens, never trained
#             on nor calibrated on; all four models at once), then batch-1 decode new tokens/s through
#             mmtrain.generate's engine (compiled, CUDA graphs; 128-token prompts, NEW (256) new tokens): the four
#             models compile at once in their own processes and are timed one at a time
#   grpo    : bench/grpo_h200.py mmtrain (python -m mmtrain.pretrain_gpt train.objective=grpo): 16 prompts x 8
#             completions a step, <= 128 new tokens, micro-batches of 4 prompts, medians of 3 steps after 2 warm-up
#   distill : python -m mmtrain.pretrain_gpt train.objective=distill distill.teacher=<the random teacher>, the train
#             stage's shape and batch, DSTEPS (30) steps, the median of the steps after the first log interval
#   trl     : bench/grpo_h200.py trl: TRL's GRPOTrainer on transformers' model of the same shape and task (real
#             `datasets` if it imports with the device's pyarrow, else --shim-datasets)
# Carry .device: whl/ (pydantic, xxhash, ...), whl-after34/ (compressed-tensors 0.20.1, loguru, psutil, trl 1.16.0,
# accelerate 1.16.0, datasets 5.2.0, dill, multiprocess, protobuf: bench/fetch_after_training_wheels.sh), data/ (text.*,
# sp.model).
# Usage (device, repo root):  bash bench/h200_after_training.sh        [STAGES="train quant table grpo distill trl"]
# CPU check of every entry point (tiny shapes, few steps, no compile, the real data):  TINY=1 bash bench/h200_after_training.sh
# Results in $OUT (or /tmp/h200_after_training): after_training.log, after_training.md, rows.jsonl, quant_accuracy.json and
# every stage's own log (train, q-*, teacher, gputest, table, grpo, distill, trl)
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "data wheels"
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
DEV=${DEV:-.device}
RES=${OUT:-/tmp/h200_after_training}
WORK=${WORK:-/tmp/after34}
LIMIT=${LIMIT:-550}
mkdir -p "$RES" "$WORK"
: > "$RES/rows.jsonl"
exec > >(tee "$RES/after_training.log") 2>&1
DATA=$DEV/data/text; TOK=$DEV/data/sp.model
MODEL=configs/models/llama3.2-1b.yaml; MODEL_OV=()
TEACHER=${TEACHER:-llama3-8b}; TEACHER_OV=()
RUN=(train.device=cuda train.precision=bf16 train.compile=true)
STEPS=${STEPS:-250}; DSTEPS=${DSTEPS:-30}; MB=8; SEQ=2048; SPLIT=96,3,1; LOG=10; WARM=40
CALIB=${CALIB:-64}; EVAL=${EVAL:-32}; NEW=${NEW:-256}
QA=(--device cuda --precision bf16); QDEV=cuda
GRPO=(--device cuda --prompts 16 --group 8 --micro 4 --max-new 128 --steps 3 --warmup 2)
if [ "${TINY:-0}" = 1 ]; then  # every entry point once on CPU: tiny shapes, the real data and tokenizer
  MODEL=configs/models/tiny.yaml; MODEL_OV=(model.vocab_size=32000 model.hidden_size=128 model.ffn_hidden_size=256)
  TEACHER=tiny; TEACHER_OV=("${MODEL_OV[@]}" model.num_layers=3)
  RUN=(train.device=cpu train.precision=fp32 train.compile=false)
  STEPS=6; DSTEPS=4; MB=2; SEQ=128; LOG=2; WARM=1; CALIB=4; EVAL=4; NEW=8
  QA=(--device cpu --no-compile --decode parallel); QDEV=cpu
  GRPO=(--device cpu --prompts 4 --group 4 --micro 2 --max-new 16 --steps 1 --warmup 1)
else
  for dir in "$DEV/whl" "$DEV/whl-after34"; do  # into /tmp/site: the device has neither (one folder per pip call)
    ls "$dir"/*.whl >/dev/null 2>&1 || { echo "missing $dir/*.whl: carry .device"; continue; }
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$dir"/*.whl 2>&1 \
      | grep -v "already exists"
  done
  # transformers 5.24 (the pinned range): the device's 5.17 converts the SentencePiece-BPE tokenizer otherwise, and
  # the exports (quantize's folders, TRL's tokenizer) refuse a tokenizer that does not encode as the original
  if ls "$DEV"/whl-transformers/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/transformers \
      "$DEV"/whl-transformers/*.whl 2>&1 | grep -v "already exists"
  else echo "missing $DEV/whl-transformers/*.whl: carry .device"; fi
  export PYTHONPATH=/tmp/transformers:/tmp/site:$PWD
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
$PY -c "import torch, transformers, compressed_tensors, loguru; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'compressed-tensors', compressed_tensors.__version__)" || echo "### compressed-tensors missing"
CKPT=$WORK/run/checkpoints; TCKPT=$WORK/teacher
PACKED=("data.prefixes=[$DATA]" data.seq_length=$SEQ data.reset_position_ids=true data.reset_attention_mask=true
        data.eod_mask_loss=true data.split=$SPLIT train.micro_batch_size=$MB train.global_batch_size=$MB
        "${RUN[@]}" logging.log_every=$LOG)

need() {  # seconds stage: false (and a line) when fewer than that are left before LIMIT
  [ $((LIMIT - SECONDS)) -ge "$1" ] && return 0
  echo "### skipped $2: $((LIMIT - SECONDS)) s left, it needs $1"
  echo "{\"part\": \"stage\", \"stage\": \"$2\", \"status\": \"skipped\", \"seconds\": 0}" >> "$RES/rows.jsonl"
  return 1
}
cap() { local c=$((LIMIT - SECONDS - 5)); [ "$c" -lt "$1" ] && echo "$c" || echo "$1"; }
done_stage() {  # stage t0 status
  echo "### $1: $3 in $((SECONDS - $2)) s (elapsed $SECONDS s)"
  echo "{\"part\": \"stage\", \"stage\": \"$1\", \"status\": \"$3\", \"seconds\": $((SECONDS - $2))}" >> "$RES/rows.jsonl"
}
make_teacher() {  # timeout: the random TEACHER checkpoint with the student's vocabulary at $TCKPT
  rm -rf "$TCKPT"
  local vocab
  vocab=$($PY -c "import sys, yaml; m = yaml.safe_load(open(sys.argv[1]))['model']; print(m['vocab_size'])" $MODEL)
  [ ${#MODEL_OV[@]} -gt 0 ] && vocab=32000
  timeout -k 10 "$1" $PY bench/random_checkpoint.py --model configs/models/$TEACHER.yaml --out "$TCKPT" \
    --device $QDEV --tokenizer "$TOK" "${TEACHER_OV[@]}" model.vocab_size=$vocab
}
row() { grep -E '^\{"' "$1" | tail -1; }  # the last JSON line of a log (not a Python dict TRL prints)

for stage in ${STAGES:-train quant table grpo distill trl}; do
  t0=$SECONDS
  case $stage in
    train)
      need 120 train || continue
      echo "### train: $MODEL, $STEPS steps of $MB x $SEQ on $DATA"
      rm -rf "$WORK/run"
      timeout -k 10 "$(cap 200)" $PY -m mmtrain.pretrain_gpt --config $MODEL "${MODEL_OV[@]}" "${PACKED[@]}" \
        train.steps=$STEPS optim.lr=3.0e-4 optim.min_lr=3.0e-5 optim.warmup_steps=$WARM \
        logging.run_dir=$WORK/run > "$RES/train.log" 2>&1
      grep -E "step +[0-9]+/" "$RES/train.log" | awk 'NR % 5 == 1' | tail -8
      if [ -f "$CKPT/latest" ]; then
        $PY bench/after_training_table.py metrics "$WORK/run/metrics.jsonl" --skip $LOG --part train --label plain \
          | tee -a "$RES/rows.jsonl"
        done_stage train $t0 ok
      else tail -6 "$RES/train.log"; done_stage train $t0 failed; fi ;;
    random)  # instead of train, for speed-only rows (decode): random weights of the student's shape at $CKPT
      need 30 random || continue
      rm -rf "$WORK/run"
      vocab=$($PY -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['model']['vocab_size'])" $MODEL)
      [ ${#MODEL_OV[@]} -gt 0 ] && vocab=32000
      timeout -k 10 "$(cap 90)" $PY bench/random_checkpoint.py --model $MODEL --out "$CKPT" --device $QDEV \
        --tokenizer "$TOK" "${MODEL_OV[@]}" model.vocab_size=$vocab > "$RES/random.log" 2>&1
      tail -1 "$RES/random.log"
      [ -f "$CKPT/latest" ] && done_stage random $t0 ok || done_stage random $t0 failed ;;
    quant)
      need 60 quant || continue
      [ -f "$CKPT/latest" ] || { echo "### quant: no checkpoint"; done_stage quant $t0 failed; continue; }
      echo "### quant: fp8, w4a16 rtn, w4a16 gptq ($CALIB samples), teacher $TEACHER, GPU tests: at once"
      c=$(cap 150); pids=()
      for spec in ${QUANTS:-fp8:rtn w4a16:rtn w4a16:gptq}; do
        set -- ${spec/:/ }
        rm -rf "$WORK/$1-$2"
        timeout -k 10 "$c" $PY -m mmtrain.quantize --ckpt "$CKPT" --scheme "$1" --method "$2" --calib "$DATA" \
          --samples "$CALIB" --seq-len $SEQ --dtype bf16 --device $QDEV --tokenizer "$TOK" --out "$WORK/$1-$2" > "$RES/q-$1-$2.log" 2>&1 &
        pids+=($!)
      done
      case " ${STAGES:-distill} " in *" distill "*)  # the distill stage's teacher, meanwhile
        make_teacher "$c" > "$RES/teacher.log" 2>&1 &
        pids+=($!) ;;
      esac
      [ "${GPUTESTS:-1}" = 1 ] && timeout -k 5 "$(cap 120)" $PY -m pytest -q -rf -p no:cacheprovider tests/gpu/test_quantize_gpu.py tests/gpu/test_packed_attention_gpu.py \
        > "$RES/gputest.log" 2>&1 &
      [ "${GPUTESTS:-1}" = 1 ] && pids+=($!)
      for p in "${pids[@]}"; do wait "$p"; done
      for f in "$RES"/q-*.log "$RES/teacher.log"; do [ -f "$f" ] && { echo "# $(basename "$f"):"; tail -3 "$f"; }; done
      if [ "${GPUTESTS:-1}" = 1 ]; then
        echo "# GPU tests: $(grep -E "passed|failed|skipped|error" "$RES/gputest.log" | tail -1)"
        grep -E "^FAILED|Error" "$RES/gputest.log" | head -5
      fi
      n=$(ls -d "$WORK"/fp8-rtn "$WORK"/w4a16-rtn "$WORK"/w4a16-gptq 2>/dev/null | wc -l)
      done_stage quant $t0 "$n folders"
      ;;
    table)
      need 90 table || continue
      folders=()
      for f in fp8-rtn:fp8 w4a16-rtn:w4a16-rtn w4a16-gptq:w4a16-gptq; do
        [ -d "$WORK/${f%%:*}" ] && folders+=("${f##*:}=$WORK/${f%%:*}")
      done
      [ ${#folders[@]} -gt 0 ] && folders=(--folders "${folders[@]}")
      [ -f "$CKPT/latest" ] || { echo "### table: no checkpoint"; done_stage table $t0 failed; continue; }
      echo "### table: bf16 ${folders[*]}"
      timeout -k 10 "$(cap 240)" $PY bench/quant_accuracy.py --ckpt "$CKPT" "${folders[@]}" --data "$DATA" \
        --data-split $SPLIT --max-samples $EVAL --new $NEW "${QA[@]}" --output "$RES/quant_accuracy.json" \
        > "$RES/table.log" 2>&1
      grep -vE "^\s*$" "$RES/table.log" | tail -14
      [ -f "$RES/quant_accuracy.json" ] && done_stage table $t0 ok || done_stage table $t0 failed ;;
    grpo|trl)
      need 60 $stage || continue
      rm -rf "${WORK:?}/$stage"
      engine=mmtrain; extra=()
      if [ $stage = trl ]; then
        engine=trl
        $PY -c "import datasets, pandas; datasets.Dataset.from_list([{'a': 1}])" >/dev/null 2>&1 \
          || { echo "# datasets does not import here: --shim-datasets"; extra=(--shim-datasets); }
      fi
      echo "### $stage: bench/grpo_h200.py $engine"
      limit=150; [ $stage = trl ] && limit=240  # TRL: ~100 s to import and build before its first step
      timeout -k 5 "$(cap $limit)" $PY bench/grpo_h200.py $engine "${MODEL_OV[@]}" --model $MODEL --tokenizer "$TOK" "${GRPO[@]}" \
        "${extra[@]}" --work "$WORK/$stage" > "$RES/$stage.log" 2>&1
      cp "$WORK/$stage/mmtrain_run/metrics.jsonl" "$RES/$stage-metrics.jsonl" 2>/dev/null
      r=$(row "$RES/$stage.log")
      if [ -n "$r" ]; then
        echo "$r" | $PY -c "import json, sys; print(json.dumps({'part': 'grpo', **json.loads(sys.stdin.read())}))" \
          | tee -a "$RES/rows.jsonl"
        done_stage $stage $t0 ok
      else tail -8 "$RES/$stage.log"; done_stage $stage $t0 failed; fi ;;
    distill)
      need 70 distill || continue
      if [ ! -f "$TCKPT/latest" ]; then  # a call without the quant stage makes the teacher here
        make_teacher "$(cap 150)" > "$RES/teacher.log" 2>&1; tail -2 "$RES/teacher.log"
      fi
      [ -f "$TCKPT/latest" ] || { echo "### distill: no teacher checkpoint"; done_stage distill $t0 failed; continue; }
      echo "### distill: $TEACHER -> $MODEL, $DSTEPS steps"
      rm -rf "$WORK/distill"
      timeout -k 10 "$(cap 180)" $PY -m mmtrain.pretrain_gpt --config $MODEL "${MODEL_OV[@]}" "${PACKED[@]}" \
        train.steps=$DSTEPS train.objective=distill "distill.teacher=$TCKPT" checkpoint.save_final=false \
        logging.run_dir=$WORK/distill > "$RES/distill.log" 2>&1
      if [ -s "$WORK/distill/metrics.jsonl" ] && [ "$(wc -l < "$WORK/distill/metrics.jsonl")" -ge "$DSTEPS" ]; then
        r=$($PY bench/after_training_table.py metrics "$WORK/distill/metrics.jsonl" teacher=$TEACHER --skip $LOG \
            --part distill --label distill)
        echo "$r" | tee -a "$RES/rows.jsonl"
        [ -n "$r" ] && done_stage distill $t0 ok || done_stage distill $t0 failed
      else tail -6 "$RES/distill.log"; done_stage distill $t0 failed; fi
      rm -rf "$TCKPT" ;;
    *) echo "### unknown stage $stage" ;;
  esac
done
$PY bench/after_training_table.py table --rows "$RES/rows.jsonl" --quant "$RES/quant_accuracy.json" \
  --out "$RES/after_training.md"
echo "### total $SECONDS s"
true
