#!/usr/bin/env bash
# Issue #34 part 2 on one H200: post-training quantization of a 1B-shape model trained here on real text, one table.
#   train : python -m mmtrain.pretrain_gpt, Llama-3.2-1B shape (configs/models/llama3.2-1b.yaml), STEPS (300) steps
#           of 8 x 2048 tokens of $DATA (mmtrain-prep text output: .device/data/text, SentencePiece 32k), bf16,
#           compiled, packed documents, one checkpoint at the end in $WORK/run/checkpoints (skipped when one is there)
#   quant : python -m mmtrain.quantize --scheme fp8; --scheme w4a16 --method rtn; --scheme w4a16 --method gptq
#           --calib $DATA (CALIB_SAMPLES (128) samples of 2048 tokens of the train split); dense tensors and scales
#           bf16 (as llm-compressor writes them); TOK=PATH if the data's recorded tokenizer is not where it says
#   table : bench/quant_accuracy.py: perplexity on the valid split (python -m mmtrain.evaluate, EVAL_SAMPLES (128)
#           samples of 2048 tokens: documents the model and GPTQ never saw) and batch-1 decode new tokens/s
#           (bench/generate.py's timing, compiled, 128-token prompts, 256 new tokens) of bf16, FP8, W4A16-RTN,
#           W4A16-GPTQ, as mmtrain.generate loads them (FP8: torch._scaled_mm; int4: tinygemm)
#   gputest: tests/gpu/test_quantize_gpu.py (the CUDA kernels against the CPU formulas)
# Usage (repo root; carry .device):  bash bench/h200_quant.sh   (STAGES="train quant table gputest"; ~7-8 min)
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "data"
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
DATA=${DATA:-.device/data/text}
WORK=${WORK:-/tmp/h200_quant}
STEPS=${STEPS:-300}
CKPT=$WORK/run/checkpoints
mkdir -p "$WORK"
for stage in ${STAGES:-train quant table gputest}; do
  case $stage in
    train)
      if [ -f "$CKPT/latest" ]; then echo "### train: reusing $CKPT"; continue; fi
      echo "### train: 1B shape, $STEPS steps on $DATA"
      PYTHONPATH=$PWD timeout -k 10 ${TRAIN_TIMEOUT:-230} python3 -m mmtrain.pretrain_gpt \
        --config mmtrain:configs/models/llama3.2-1b.yaml "data.prefixes=[$DATA]" data.seq_length=2048 \
        data.reset_position_ids=true data.reset_attention_mask=true data.eod_mask_loss=true data.split=98,1,1 \
        train.steps=$STEPS train.micro_batch_size=8 train.global_batch_size=8 train.precision=bf16 \
        train.device=cuda train.compile=true optim.lr=6.0e-4 optim.min_lr=6.0e-5 optim.warmup_steps=30 \
        logging.run_dir=$WORK/run logging.log_every=50 2>&1 \
        | grep -E "step +(1|50|100|150|200|250|300)/|Error|error" | tail -12 ;;
    quant)
      for spec in "fp8 rtn" "w4a16 rtn" "w4a16 gptq"; do
        set -- $spec
        echo "### quantize: $1 $2"
        PYTHONPATH=$PWD timeout -k 10 ${QUANT_TIMEOUT:-120} python3 -m mmtrain.quantize --ckpt "$CKPT" \
          --scheme "$1" --method "$2" --calib "$DATA" --samples ${CALIB_SAMPLES:-128} --seq-len 2048 --dtype bf16 \
          ${TOK:+--tokenizer "$TOK"} --out "$WORK/$1-$2" 2>&1 | tail -4
      done ;;
    table)
      echo "### table"
      PYTHONPATH=$PWD timeout -k 10 ${TABLE_TIMEOUT:-330} python3 bench/quant_accuracy.py --ckpt "$CKPT" \
        --folders fp8="$WORK/fp8-rtn" w4a16-rtn="$WORK/w4a16-rtn" w4a16-gptq="$WORK/w4a16-gptq" --data "$DATA" \
        --max-samples ${EVAL_SAMPLES:-128} --output "${OUT:-$WORK}/quant_accuracy.json" 2>&1 | grep -vE "^\s*$" | tail -12 ;;
    gputest)
      echo "### GPU tests"
      PYTHONPATH=$PWD timeout -k 5 120 python3 -m pytest -q -rf -p no:cacheprovider tests/gpu/test_quantize_gpu.py 2>&1 \
        | grep -E "passed|failed|FAILED|Error" | tail -8 ;;
  esac
done
true
