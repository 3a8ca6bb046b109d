"""bench/vlm_pack_h200.py (issue #18's packed-VLM row) runs end to end at tiny sizes on the CPU: media prep, two
trainings on the shards (unpacked, packed) and the table, with packing filling more of each row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_vlm_pack_bench_runs_tiny_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "bench/vlm_pack_h200.py"), "--tiny", "--images", "16",
                           "--steps", "1", "--warmup", "0", "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"pack"')]
    assert [r["pack"] for r in rows] == [False, True]
    unpacked, packed = rows
    assert packed["fill"] > unpacked["fill"] and packed["samples_per_s"] > 0
    assert "| media.pack |" in proc.stdout and "packed / unpacked real tokens/s:" in proc.stdout
