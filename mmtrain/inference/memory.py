"""What fits before the decoder allocates: the device's free memory (a GPU's, or on the host what the system and
the process's memory cgroup leave) and the KV cache checked against it, so a context or slot count too large
for the machine is a one-line error, not an out-of-memory kill after minutes of loading."""

from __future__ import annotations

import torch

CACHE_SHARE = 0.9  # of the free memory, what the cache may take: the rest is for the steps' activations


class CacheSizeError(ValueError):
    """A KV cache larger than the device's free memory; the message gives both sizes."""


def check_cache_fits(need: int, slots: int, max_len: int, device: torch.device) -> None:
    """Raise ``CacheSizeError`` when a cache of ``need`` bytes (``slots`` x ``max_len`` positions) would take more
    than ``CACHE_SHARE`` of ``device``'s free memory (nothing is checked where the free memory is unknown)."""
    free = free_bytes(device)
    if free is not None and need > CACHE_SHARE * free:
        raise CacheSizeError(f"a KV cache of {slots} slots x {max_len} positions needs {_size(need)} "
                             f"({need // max(1, slots * max_len)} bytes a position), more than "
                             f"{CACHE_SHARE:.0%} of the {_size(free)} free on {device}")


def free_bytes(device: torch.device) -> int | None:
    """Bytes that ``device`` can still allocate, or None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        return _host_available()
    return None


def _host_available() -> int | None:
    """The system's available memory (/proc/meminfo), lowered to what the memory cgroup's limit leaves (v2 or
    v1; reclaimable file pages count as free, as the kernel reclaims them before it kills)."""
    meminfo = _fields(_read("/proc/meminfo"))
    available = meminfo["MemAvailable:"] * 1024 if "MemAvailable:" in meminfo else None
    for folder, limit_file, usage_file, reclaimable_key in (
            ("/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
        limit, usage = _read_int(f"{folder}/{limit_file}"), _read_int(f"{folder}/{usage_file}")
        if limit is None or usage is None or limit >= 1 << 60:  # v2's "max", v1's "no limit" (about 2**63)
            continue
        reclaimable = _fields(_read(f"{folder}/memory.stat")).get(reclaimable_key, 0)
        left = max(0, limit - usage + reclaimable)
        available = left if available is None else min(available, left)
    return available


def _fields(text: str | None) -> dict[str, int]:
    """``name value ...`` lines (meminfo, memory.stat) as name -> the first number."""
    fields = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            fields[parts[0]] = int(parts[1])
    return fields


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    text = (_read(path) or "").strip()
    return int(text) if text.isdigit() else None


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"
