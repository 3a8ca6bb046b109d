"""Benchmark `mmtrain-prep media` against a hand-written pipeline on the same input.

    python bench/prep_media.py [--images 2000] [--audio 40] [--workers 1 2] [--repeats 3]
                               [--workdir runs/bench-prep-media]

Input: ``--images`` generated images (JPEG and PNG over four sizes, with grain so files have photo-like
sizes) plus ``--audio`` clips (WAV/FLAC/MP3/OGG), written once and reused. For each worker count the
pipelines run back to back (interleaved, so they see the same machine load), each as a fresh process:

- ``ours``: ``mmtrain-prep media`` (validates every file by decoding it, writes shards + .nv-meta).
- ``wds+prepare``: a plain loop that decodes each file the same way (Pillow / PyAV) to validate it and
  writes it with ``webdataset.ShardWriter``, then ``energon prepare --non-interactive`` with
  ``--num-workers N``: the pipeline a team writes by hand for the same guarantee.
- ``wds-copy+prepare``: the same loop without validation (bytes copied blind), for reference.

Reported per run: wall seconds (end to end, process start to exit), samples/s, input MB/s, the peak RSS
of the largest process of the run (os.wait4's ru_maxrss covers the process and its reaped children) and
the CPU seconds of all its processes (a figure that other load on the machine does not change much).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = ((320, 240), (512, 384), (640, 480), (800, 600))


def _generate(workdir: Path, images: int, audio: int) -> Path:
    inp = workdir / "input"
    stamp = inp / "params.json"
    params = {"images": images, "audio": audio, "sizes": SIZES, "noise": 24}
    if stamp.exists() and json.loads(stamp.read_text()) == json.loads(json.dumps(params)):
        return inp / "manifest.jsonl"
    shutil.rmtree(inp, ignore_errors=True)
    sys.path.insert(0, str(ROOT))
    from dataprep.samples_media import write_media_samples

    t = time.monotonic()
    manifest = write_media_samples(inp, num_images=images, num_audio=audio, video=False, sizes=SIZES,
                                   conversations=0, noise=24)
    stamp.write_text(json.dumps(params))
    print(f"generated {images} images + {audio} audio clips in {time.monotonic() - t:.1f}s", flush=True)
    return manifest


def _baseline_child(manifest: Path, out: Path, workers: int, validate: bool) -> None:
    """The hand-written pipeline (runs in its own process)."""
    import io

    import webdataset as wds

    base = manifest.parent
    out.mkdir(parents=True)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxsize=512 * 10**6, verbose=0) as sink:
        for line in manifest.open():
            row = json.loads(line)
            path = base / (row.get("image") or row.get("audio"))
            data = path.read_bytes()
            if validate:
                if "image" in row:
                    from PIL import Image

                    with Image.open(io.BytesIO(data)) as im:
                        im.load()
                else:
                    import av

                    with av.open(io.BytesIO(data)) as c:
                        for _ in c.decode(audio=0):
                            pass
            text = row.get("caption") or row.get("text")
            sink.write({"__key__": row["id"], path.suffix[1:].lower(): data, "txt": text,
                        "json": json.dumps(row).encode()})
    # energon's console script, run through this interpreter (works where only the package is on PYTHONPATH)
    energon = [sys.executable, "-c", "import sys; from megatron.energon.cli.main import main; sys.exit(main())"]
    subprocess.run([*energon, "prepare", str(out), "--non-interactive", "--split-ratio", "99,1,0",
                    "--sample-type", "CrudeWebdataset", "--num-workers", str(workers), "--no-progress"],
                   check=True, stdout=subprocess.DEVNULL)


def _run(cmd: list[str], env: dict) -> tuple[float, float, float]:
    t = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.monotonic() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    return seconds, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime  # MiB; CPU seconds, all processes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--audio", type=int, default=40)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-prep-media"))
    ap.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported (default 3)")
    ap.add_argument("--no-copy-baseline", action="store_true", help="skip the no-validation reference run")
    ap.add_argument("--no-validating-baseline", action="store_true",
                    help="skip the hand-written pipeline that fully decodes every file")
    ap.add_argument("--pin-cores", action="store_true",
                    help="run every pipeline under taskset on as many cores as its worker count")
    ap.add_argument("--json-out", default=None, help="also write the runs and medians as JSON here")
    ap.add_argument("--ours-args", default="", help="extra flags for mmtrain-prep media (e.g. --full-decode)")
    ap.add_argument("--_child", choices=["validate", "copy"], help=argparse.SUPPRESS)
    ap.add_argument("--_manifest", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    ap.add_argument("--_n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        _baseline_child(Path(args._manifest), Path(args._out), args._n, args._child == "validate")
        return

    workdir = Path(args.workdir)
    manifest = _generate(workdir, args.images, args.audio)
    rows = [json.loads(line) for line in manifest.open()]
    in_mb = sum((manifest.parent / (r.get("image") or r.get("audio"))).stat().st_size for r in rows) / 1e6
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    py = sys.executable
    samples: dict[tuple[str, int], list[dict]] = {}
    for rep in range(args.repeats):  # rounds: every pipeline once per round, so all see the same load
        for n in args.workers:
            runs = [("ours", [py, "-m", "dataprep", "media", "--input", str(manifest), "--no-progress",
                              "--workers", str(n), *args.ours_args.split(), "--output"])]
            if not args.no_validating_baseline:
                runs.append(("wds+prepare", [py, __file__, "--_child", "validate", "--_manifest", str(manifest),
                                             "--_n", str(n), "--_out"]))
            if not args.no_copy_baseline:
                runs.append(("wds-copy+prepare", [py, __file__, "--_child", "copy", "--_manifest", str(manifest),
                                                  "--_n", str(n), "--_out"]))
            for name, cmd in runs:
                out = workdir / f"out-{name}-{n}"
                shutil.rmtree(out, ignore_errors=True)
                if args.pin_cores:
                    cmd = ["taskset", "-c", ",".join(map(str, sorted(os.sched_getaffinity(0))[:n]))] + cmd
                seconds, rss, cpu = _run(cmd + [str(out)], env)
                samples.setdefault((name, n), []).append({"seconds": seconds, "rss": rss, "cpu": cpu})
                load1 = os.getloadavg()[0]
                print(f"  round {rep + 1} {name:17s} workers={n}: {seconds:6.2f}s  peak RSS {rss:6.0f} MiB  "
                      f"CPU {cpu:6.2f}s  (load {load1:.2f})", flush=True)
                shutil.rmtree(out, ignore_errors=True)
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"\ninput: {len(rows)} samples ({args.images} images, {args.audio} audio), {in_mb:.1f} MB; "
          f"{len(os.sched_getaffinity(0))} CPUs" + (" (each run pinned to as many as its workers)" if args.pin_cores
                                                     else "") + f"; {args.repeats} round(s), median and best "
          f"wall time; {load}")
    print(f"{'pipeline':18s} {'workers':>7s} {'median s':>9s} {'best s':>7s} {'samples/s':>10s} {'MB/s':>7s} "
          f"{'peak RSS MiB':>13s} {'CPU s':>7s}")
    med = {}
    for (name, n), runs_ in samples.items():
        secs = sorted(r["seconds"] for r in runs_)
        m = secs[len(secs) // 2] if len(secs) % 2 else (secs[len(secs) // 2 - 1] + secs[len(secs) // 2]) / 2
        cpu = sorted(r["cpu"] for r in runs_)[len(runs_) // 2]
        med[(name, n)] = m
        print(f"{name:18s} {n:7d} {m:9.2f} {secs[0]:7.2f} {len(rows) / m:10.1f} {in_mb / m:7.1f} "
              f"{max(r['rss'] for r in runs_):13.0f} {cpu:7.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "samples": len(rows), "input_mb": in_mb, "pinned": args.pin_cores, "rounds": args.repeats,
            "median_s": {f"{name}@{n}": m for (name, n), m in med.items()},
            "runs": {f"{name}@{n}": r for (name, n), r in samples.items()}}, indent=1))
    for n in args.workers:
        ratios = ", ".join(f"{med[(b, n)] / med[('ours', n)]:.2f}x {b}'s speed"
                           for b in ("wds+prepare", "wds-copy+prepare") if (b, n) in med) or "(no baseline run)"
        print(f"workers={n} (median wall time): ours runs at {ratios}")

if __name__ == "__main__":
    main()
