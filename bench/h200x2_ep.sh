#!/usr/bin/env bash
# One device call on two H200s: expert parallelism (issue #23's EP section). 8 experts top-2, expert FFN 4096,
# Llama-3.2-1B shapes, B4x4096 per GPU, bf16 AdamW like the anchor (Megatron-Core+TE: 38,177 tokens/s per GPU).
#  1. the MoE layers' time split from torch.profiler (bench/moe_ep_profile.py: all-to-all, grouped GEMM, router,
#     shared experts, permute/unpermute, rest; plus wall ms/iter): EP1 on GPU 0, then EP2 with exact and padded
#     all-to-all splits, and with a shared expert, overlapped or not (--overlap: forward with the dispatch
#     all-to-all and backward with the combine's reverse all-to-all; compare the wall ms/iter of the pairs);
#  2. whole-model tokens/s at EP2: exact vs padded splits, shared expert with and without the overlap;
#  3. the Megatron-Core anchor's EP2 row in the same call, when it is carried (below).
# Usage, from the repo root:  bash bench/h200x2_ep.sh
# For the anchor row, first copy here (git-ignored .device/, then carry ".device" and ".te"):
#   mkdir -p .device/whl && cp ../shared/bench/mcore_parallel_anchor.py .device/ \
#     && cp ../shared/bench/wheels/megatron_core-0.19.2-*.whl .device/whl/
# and bring TE as ../shared/te/README.md says (bash .te/install-on-device.sh puts it into /tmp/site).
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "wheels mcore"
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if ls .device/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
run() { echo "### $*"; timeout 240 "$@" 2>&1 | grep -vE 'Warning|warn\(' | tail -"${TAIL:-4}"; }
two() { run torchrun --nproc_per_node 2 --master_port "${PORT:-29621}" "$@"; }
P="bench/moe_ep_profile.py --steps 5"
TAIL=10 CUDA_VISIBLE_DEVICES=0 run python3 $P
TAIL=10 two $P
TAIL=10 PORT=29622 two $P --dispatch padded
TAIL=10 PORT=29623 two $P --shared 4096
TAIL=10 PORT=29624 two $P --shared 4096 --overlap
TAIL=10 PORT=29625 two $P --shared 4096 --overlap --dispatch padded
TAIL=10 PORT=29626 two $P --shared 4096 --dispatch padded
B="--batch 4 --seq 4096 --steps 8 --warmup 3 train.compile=true optim.master_weights=false"
MOE="model.num_experts=8 model.moe_top_k=2 model.moe_ffn_hidden_size=4096 parallel.dp=2 parallel.ep=2"
t() { TAIL=2 PORT=$1 two bench/train_gpt.py --label "$2" $B $MOE "${@:3}"; }
t 29631 moe-ep2-exact
t 29632 moe-ep2-padded parallel.ep_dispatch=padded
t 29633 moe-ep2-shared4096 model.moe_shared_ffn_hidden_size=4096
t 29634 moe-ep2-shared4096-overlap model.moe_shared_ffn_hidden_size=4096 parallel.ep_overlap_shared=true
t 29635 moe-ep2-shared4096-overlap-padded model.moe_shared_ffn_hidden_size=4096 parallel.ep_overlap_shared=true \
  parallel.ep_dispatch=padded
if [ -f .device/mcore_parallel_anchor.py ]; then
  TAIL=2 PORT=29641 two .device/mcore_parallel_anchor.py --experts 8 --ep 2
fi
