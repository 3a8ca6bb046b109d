#!/usr/bin/env bash
# Speed targets of mmtrain-prep on a quiet many-core host, each side pinned to as many cores as workers.
#   text  (issue 3): >= 4x Megatron-LM tools/preprocess_data.py, same input/tokenizer/workers, identical bytes
#   media (issue 4): >= 2x a webdataset.ShardWriter loop + `energon prepare`, end to end, at 2 workers
# Setup (here): bash bench/fetch_prep_wheels.sh   -> .device/whl/*.whl, .device/megatron-lm[-head.tar.gz]
# Run (device, repo root, carry=[".device"]):      bash bench/prep_device.sh
# Knobs: TEXT_MB (corpus MB, default 20), TEXT_TIMEOUT (s, default 240), GPT2_MB (MB for the GPT-2 case, default 6), TEXT_ROUNDS (1),
#        MEDIA_IMAGES (2000), MEDIA_AUDIO (40), MEDIA_ROUNDS (3), HEAD=0 skips the newest Megatron-LM,
#        MEDIA=0 skips the media case, PIN=0 runs text unpinned (every tool sees every core: Megatron-LM runs
#        its N worker processes, ours N workers x THREADS tokenizer threads), THREADS ("1"; "0" = auto, CPUs/N),
#        PARQUET=1 also runs ours on the corpus as Parquet (rows "ours parquet"; needs pyarrow: fetch with
#        TEXT_ONLY=1 PARQUET=1 bash bench/fetch_prep_wheels.sh, and MEDIA=0).
# About 3-4 minutes on a 16-core host (stages are cut at 240 + 90 + 200 s, inside the 600 s of one device call).
# Results: $OUT (or /tmp/prep_device) *.log and *.json, one table last.
# .device here (git-ignored; carry it): bash bench/make_device_dir.sh --parts "prep"
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONUTF8=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
RES=${OUT:-/tmp/prep_device}
WORK=${WORK:-/tmp/prep_device_work}
SITE=/tmp/site
mkdir -p "$RES" "$WORK"
command -v taskset >/dev/null || { echo "taskset missing (util-linux)"; exit 2; }
$PY - <<'EOF'
import os, sys
print(f"python {sys.version.split()[0]}; {len(os.sched_getaffinity(0))} cpus; load {os.getloadavg()}")
EOF
if ls .device/whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target "$SITE" .device/whl/*.whl
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
MEG=.device/megatron-lm
PIN_FLAG=--pin-cores; [ "${PIN:-1}" = 1 ] || PIN_FLAG=""
PARQUET_FLAG=""; [ "${PARQUET:-0}" = 1 ] && PARQUET_FLAG=--parquet

[ -d "$MEG/tools" ] || { echo "no $MEG/tools: run bench/fetch_prep_wheels.sh here first and carry .device"; exit 2; }

echo "### text: Megatron-LM $(cat $MEG/megatron/core/package_info.py | grep -E '^(MAJOR|MINOR|PATCH) ' | awk '{printf $3"."}')"
timeout "${TEXT_TIMEOUT:-240}" $PY bench/prep_text.py --megatron "$MEG" --megatron-pythonpath "$SITE" --work-dir "$WORK/text" \
  --build-mb "${TEXT_MB:-20}" --kinds sentencepiece huggingface gpt2-bpe --kind-mb "gpt2-bpe=${GPT2_MB:-6}" \
  --workers 1 2 --repeats "${TEXT_ROUNDS:-1}" $PIN_FLAG $PARQUET_FLAG --threads-per-worker ${THREADS:-1} \
  --json-out "$RES/prep_text.json" 2>&1 \
  | tee "$RES/prep_text.log" || echo "(text benchmark stopped: rc $?; see the log)"

if [ "${HEAD:-1}" = 1 ] && [ -f .device/megatron-lm-head.tar.gz ]; then
  mkdir -p "$WORK/megatron-lm-head" && tar -xzf .device/megatron-lm-head.tar.gz -C "$WORK/megatron-lm-head"
  echo "### text, GPT-2 files, newest Megatron-LM (GPT2BPETokenizer on transformers)"
  timeout 90 $PY bench/prep_text.py --megatron "$WORK/megatron-lm-head" --megatron-pythonpath "$SITE" \
    --work-dir "$WORK/text" --kinds gpt2-bpe --kind-mb "gpt2-bpe=${TEXT_MB:-20}" --workers 1 2 \
    --repeats "${TEXT_ROUNDS:-1}" $PIN_FLAG --threads-per-worker ${THREADS:-1} \
    --json-out "$RES/prep_text_head.json" 2>&1 \
    | tee "$RES/prep_text_head.log" || echo "(newest Megatron-LM run stopped: rc $?; see the log)"
fi

if [ "${MEDIA:-1}" = 1 ]; then
  echo "### media"
  timeout 200 $PY bench/prep_media.py --workdir "$WORK/media" --images "${MEDIA_IMAGES:-2000}" \
    --audio "${MEDIA_AUDIO:-40}" --workers 1 2 --repeats "${MEDIA_ROUNDS:-3}" --pin-cores --no-validating-baseline \
    --json-out "$RES/prep_media.json" 2>&1 | tee "$RES/prep_media.log" || echo "(media benchmark stopped: rc $?)"
fi

$PY - "$RES" <<'EOF'
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
pinned = json.loads((res / "prep_text.json").read_text()).get("pinned", True) if (res / "prep_text.json").exists() else True
print("\n=== mmtrain-prep speed targets (" + ("each run pinned to as many cores as workers" if pinned else
      "text unpinned: every run sees every core") + "; medians) ===")
print("ratio: reference wall time / ours, end to end (what the targets name); steady: the same without each\n"
      "tool's start-up (text only; n/a when a run is mostly start-up); CPU: reference CPU seconds / ours")
print(f"{'target':<34} {'workers':>7} {'ours':>10} {'reference':>10} {'ratio':>7} {'steady':>7} {'CPU':>6}  goal")
for name, label in (("prep_text.json", "text"), ("prep_text_head.json", "text, newest Megatron-LM")):
    f = res / name
    if not f.exists():
        continue
    table = json.loads(f.read_text())["table"]
    meg = {(r["kind"], r["workers"]): r for r in table if r["tool"] == "megatron"}
    for r in table:
        if r["tool"] == "megatron" or (r["kind"], r["workers"]) not in meg:
            continue
        m = meg[(r["kind"], r["workers"])]
        steady = r["vs_megatron_steady"]
        verdict = f">=4x end to end {'met' if r['vs_megatron'] >= 4 else 'NOT met'}"
        if steady == steady:  # not NaN
            verdict += f", steady {'met' if steady >= 4 else 'NOT met'}"
        steady = f"{steady:>6.2f}x" if steady == steady else f"{'n/a':>7}"
        print(f"{label + ' ' + r['kind'] + ' ' + r['tool'][5:]:<34} {r['workers']:>7} {r['mb_s']:>6.2f}MB/s {m['mb_s']:>6.2f}MB/s "
              f"{r['vs_megatron']:>6.2f}x {steady} {m['cpu'] / r['cpu']:>5.2f}x  {verdict}")
f = res / "prep_media.json"
if f.exists():
    m = json.loads(f.read_text())
    med = m["median_s"]

    def cpu(key):
        v = sorted(r["cpu"] for r in m["runs"][key])
        return v[len(v) // 2]

    for key, s in sorted(med.items()):
        name, n = key.split("@")
        ref_key = f"wds-copy+prepare@{n}"
        if name != "ours" or ref_key not in med:
            continue
        ref = med[ref_key]
        goal = (">=2x " + ("met" if ref / s >= 2 else "NOT met")) if n == "2" else "(the 2x goal is at 2 workers)"
        print(f"{'media vs ShardWriter+prepare':<34} {n:>7} {s:>9.2f}s {ref:>9.2f}s {ref / s:>6.2f}x {'':>7} "
              f"{cpu(ref_key) / cpu(key):>5.2f}x  {goal}")
    print(f"media input: {m['samples']} samples, {m['input_mb']:.0f} MB; wall seconds end to end")
EOF
