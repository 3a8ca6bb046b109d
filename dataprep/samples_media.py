"""A small, deterministic media sample set generated on the spot (no download): images with captions, a few
audio clips, one tiny video and a ``manifest.jsonl`` for `mmtrain-prep media` (the VLM demo's data; the
benchmark's too, at a larger count).

Images are simple scenes (a coloured shape on a coloured background) whose caption says what they show,
so a tiny VLM can learn a real image -> text mapping. Same arguments -> the same files.
"""

from __future__ import annotations

import io
import json
import math
import random
import wave
from pathlib import Path

from mmtrain.utils.atomic import atomic_open, atomic_write_bytes

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 210, 40),
           "purple": (140, 60, 180), "orange": (245, 140, 30), "white": (245, 245, 245), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")
TONES = {"low": 220.0, "middle": 440.0, "high": 880.0}


def _scene(rng: random.Random, size: tuple[int, int], noise: int = 0):
    from PIL import Image, ImageDraw

    names = list(COLOURS)
    bg, fg = rng.sample(names, 2)
    shape = rng.choice(SHAPES)
    w, h = size
    img = Image.new("RGB", size, COLOURS[bg])
    draw = ImageDraw.Draw(img)
    r = int(min(w, h) * rng.uniform(0.2, 0.4))
    cx, cy = rng.randint(r, w - r), rng.randint(r, h - r)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=COLOURS[fg])
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=COLOURS[fg])
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[fg])
    if noise:  # texture, so files have photo-like sizes (flat colours compress to almost nothing)
        import numpy as np

        grain = np.random.default_rng(rng.getrandbits(32)).integers(-noise, noise + 1, (h, w, 3))
        img = Image.fromarray(np.clip(np.asarray(img, np.int16) + grain, 0, 255).astype(np.uint8))
    where = ("on the left" if cx < w / 3 else "on the right" if cx > 2 * w / 3 else "in the middle")
    article = "an" if bg[0] in "aeiou" else "a"
    caption = f"A {fg} {shape} on {article} {bg} background, {where}."
    return img, caption


def _tone_wav(freq: float, seconds: float, rate: int = 16000) -> bytes:
    n = int(seconds * rate)
    frames = bytearray()
    for i in range(n):
        v = int(12000 * math.sin(2 * math.pi * freq * i / rate) * min(1.0, i / 400, (n - i) / 400))
        frames += v.to_bytes(2, "little", signed=True)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(frames))
    return buf.getvalue()


def _encode_audio(wav: bytes, fmt: str) -> bytes:
    """WAV bytes -> flac/mp3/ogg(opus) bytes through PyAV."""
    import av
    import numpy as np

    with wave.open(io.BytesIO(wav)) as w:
        rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")
    codec, container, out_rate = {"flac": ("flac", "flac", rate), "mp3": ("libmp3lame", "mp3", rate),
                                  "ogg": ("libopus", "ogg", 48000)}[fmt]
    if out_rate != rate:
        pcm = np.repeat(pcm, out_rate // rate)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as c:
        s = c.add_stream(codec, rate=out_rate)
        s.layout = "mono"
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = out_rate
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


def _tiny_video(frames: int = 16, fps: int = 8, size: tuple[int, int] = (64, 48)) -> bytes:
    """A square sliding left to right, H.264 in MP4."""
    import av
    import numpy as np

    w, h = size
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        s.options = {"preset": "ultrafast", "tune": "zerolatency", "threads": "1"}
        for i in range(frames):
            img = np.full((h, w, 3), 30, np.uint8)
            x = int(i * (w - 12) / max(frames - 1, 1))
            img[h // 2 - 6:h // 2 + 6, x:x + 12] = (230, 60, 60)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


def write_media_samples(folder: str | Path, num_images: int = 36, num_audio: int = 6, video: bool = True,
                        seed: int = 0, sizes: tuple[tuple[int, int], ...] = ((64, 48), (96, 96), (128, 80)),
                        conversations: int = 2, noise: int = 0) -> Path:
    """Write media files under ``folder`` and ``folder/manifest.jsonl``; return the manifest path.

    Images alternate JPEG/PNG over ``sizes``; audio cycles WAV/FLAC/MP3/OGG (tones: low/middle/high);
    the last ``conversations`` image rows carry a two-turn conversation instead of a caption; ``noise`` adds
    per-pixel grain of that amplitude (the benchmark uses it for realistic file sizes)."""
    from PIL import Image  # noqa: F401 - fail early with a clear ImportError

    folder = Path(folder)
    rng = random.Random(seed)
    rows = []
    for i in range(num_images):
        img, caption = _scene(rng, sizes[i % len(sizes)], noise)
        ext = "jpg" if i % 2 == 0 else "png"
        buf = io.BytesIO()
        img.save(buf, format="JPEG" if ext == "jpg" else "PNG", **({"quality": 90} if ext == "jpg" else {}))
        rel = f"images/img-{i:05d}.{ext}"
        atomic_write_bytes(folder / rel, buf.getvalue())
        row = {"id": f"img-{i:05d}", "image": rel}
        if i >= num_images - conversations:
            row["conversation"] = [{"role": "user", "content": "What is in the picture?"},
                                   {"role": "assistant", "content": caption}]
        else:
            row["caption"] = caption
        rows.append(row)
    formats = ("wav", "flac", "mp3", "ogg")
    for i in range(num_audio):
        tone = list(TONES)[i % len(TONES)]
        wav = _tone_wav(TONES[tone], 0.5 + 0.25 * (i % 3))
        fmt = formats[i % len(formats)]
        data = wav if fmt == "wav" else _encode_audio(wav, fmt)
        rel = f"audio/clip-{i:03d}.{fmt}"
        atomic_write_bytes(folder / rel, data)
        rows.append({"id": f"clip-{i:03d}", "audio": rel, "text": f"A steady {tone} tone."})
    if video:
        atomic_write_bytes(folder / "video/slide-000.mp4", _tiny_video())
        rows.append({"id": "slide-000", "video": "video/slide-000.mp4",
                     "caption": "A red square slides from left to right."})
    manifest = folder / "manifest.jsonl"
    with atomic_open(manifest, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return manifest
