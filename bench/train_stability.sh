#!/usr/bin/env bash
# Which part of the GPU training path makes a 1B run's gradient norm explode (issue #34's training stage diverged on
# the H200 twice while the same settings on the CPU give norms ~18): the same short run, log every step, under
# several variants, two at a time on one GPU; prints each run's step lines (loss, grad_norm).
#   bash bench/train_stability.sh            (device, repo root; PREV=<an older tree> adds its row)
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "data prev"
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PY:-python3}; DATA=${DATA:-.device/data/text}; RES=${OUT:-/tmp/train_stability}; STEPS=${STEPS:-30}
mkdir -p "$RES"
base=(--config configs/models/llama3.2-1b.yaml "data.prefixes=[$PWD/$DATA]" data.split=96,3,1 train.device=cuda
      train.precision=bf16 logging.log_every=1 optim.lr=3.0e-4 optim.warmup_steps=40 checkpoint.save_final=false)
packed=(data.reset_position_ids=true data.reset_attention_mask=true data.eod_mask_loss=true)
big=(data.seq_length=2048 train.micro_batch_size=8 train.global_batch_size=8 train.steps=$STEPS)
small=(model.num_layers=2 data.seq_length=512 train.micro_batch_size=2 train.global_batch_size=2 train.steps=4 "${packed[@]}")
run() {  # name tree args...
  local name=$1 tree=$2; shift 2
  (cd "$tree" && timeout -k 5 170 $PY -m mmtrain.pretrain_gpt "${base[@]}" "$@" logging.run_dir=/tmp/stab-$name \
    > "$RES/$name.log" 2>&1)
}
run small-eager . "${small[@]}" train.compile=false &
run small-compiled . "${small[@]}" train.compile=true &
wait
run packed-compiled . "${big[@]}" "${packed[@]}" train.compile=true &
run packed-eager . "${big[@]}" "${packed[@]}" train.compile=false &
wait
run unpacked-compiled . "${big[@]}" train.compile=true &
[ -n "${PREV:-}" ] && run prev-packed-compiled "$PREV" "${big[@]}" "${packed[@]}" train.compile=true &
wait
for f in "$RES"/*.log; do
  echo "## $(basename "$f" .log)"
  grep -E "step +[0-9]+/|error|Error" "$f" | sed -E 's/.*(step +[0-9]+\/[0-9]+) \| (loss [0-9.]+) \| lr [^|]*\| (grad_norm [^ ]+).*/\1 \2 \3/' \
    | awk 'NR <= 6 || NR % 5 == 0' | head -14
done
