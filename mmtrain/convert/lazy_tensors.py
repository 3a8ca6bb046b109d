"""Tensors of safetensors files read on demand, so that a tensor-parallel rank loading a pretrained part reads only
its shard (``safe_open(...).get_slice``), not every full tensor.

``LazyTensor`` is one tensor of a file, or a range of it along one dimension; ``torch.cat`` of lazy tensors (the
HF adapters' fused ``q|k|v`` and ``gate|up``) stays lazy (``LazyCat``). ``split``/``chunk``/``narrow`` along the
range's dimension give lazy tensors again, which is all ``tp_shard_of`` does before its final ``torch.cat``. Any
other operation (a transpose, a stack, arithmetic, ``copy_``) reads what it needs first and runs on real tensors:
results never change, only how much is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def materialize(value: Any) -> Any:
    """``value`` with every lazy tensor in it (also inside lists, tuples and dicts) read."""
    if isinstance(value, (LazyTensor, LazyCat)):
        return value.read()
    if isinstance(value, (list, tuple)):
        return type(value)(materialize(v) for v in value)
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    return value


class _Lazy:
    """What LazyTensor and LazyCat share: the torch function protocol and the fallback to a real tensor."""

    shape: torch.Size
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, d: int | None = None):
        return self.shape if d is None else self.shape[d]

    def numel(self) -> int:
        return self.shape.numel()

    def chunk(self, n: int, dim: int = 0) -> list:
        step = -(-self.shape[dim] // n)
        return [self.narrow(dim, s, min(step, self.shape[dim] - s)) for s in range(0, self.shape[dim], step)]

    def split(self, sizes, dim: int = 0) -> list:
        if isinstance(sizes, int):
            sizes = [min(sizes, self.shape[dim] - s) for s in range(0, self.shape[dim], sizes)]
        out, start = [], 0
        for size in sizes:
            out.append(self.narrow(dim, start, size))
            start += size
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat:
            tensors = args[0] if args else kwargs["tensors"]
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if all(isinstance(t, _Lazy) for t in tensors):
                return LazyCat(list(tensors), dim)
        return func(*materialize(list(args)), **materialize(kwargs))

    def __getattr__(self, name: str):  # every other Tensor attribute or method: on the real tensor
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.read(), name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"


class LazyTensor(_Lazy):
    """Tensor ``key`` of safetensors file ``path``, rows ``start .. start + length`` along ``dim`` (all of it when
    ``dim`` is None)."""

    def __init__(self, path: Path, key: str, shape: tuple[int, ...], dtype: torch.dtype,
                 dim: int | None = None, start: int = 0) -> None:
        self.path, self.key, self.full_shape, self.dtype = Path(path), key, tuple(shape), dtype
        self.range_dim, self.start = dim, start
        self.shape = torch.Size(shape)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        dim = dim % len(self.shape)
        if self.range_dim not in (None, dim):
            return self.read().narrow(dim, start, length)
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(f"{self.key}: rows {start}..{start + length} of {self.shape[dim]} along dim {dim}")
        out = LazyTensor(self.path, self.key, self.full_shape, self.dtype, dim, self.start + start)
        out.shape = torch.Size(length if d == dim else s for d, s in enumerate(self.shape))
        return out

    def read(self) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            if self.range_dim is None:
                return f.get_tensor(self.key)
            index = [slice(None)] * len(self.full_shape)
            index[self.range_dim] = slice(self.start, self.start + self.shape[self.range_dim])
            return f.get_slice(self.key)[tuple(index)]


class LazyCat(_Lazy):
    """``torch.cat(parts, dim)`` of lazy tensors, not read yet."""

    def __init__(self, parts: list[_Lazy], dim: int) -> None:
        dim = dim % len(parts[0].shape)
        self.parts, self.cat_dim, self.dtype = parts, dim, parts[0].dtype
        size = sum(p.shape[dim] for p in parts)
        self.shape = torch.Size(size if d == dim else s for d, s in enumerate(parts[0].shape))

    def narrow(self, dim: int, start: int, length: int):
        dim = dim % len(self.shape)
        if dim != self.cat_dim:
            return LazyCat([p.narrow(dim, start, length) for p in self.parts], self.cat_dim)
        pieces, offset = [], 0
        for p in self.parts:  # the parts' ranges that fall inside [start, start + length)
            lo, hi = max(start, offset), min(start + length, offset + p.shape[dim])
            if lo < hi:
                pieces.append(p.narrow(dim, lo - offset, hi - lo))
            offset += p.shape[dim]
        return pieces[0] if len(pieces) == 1 else LazyCat(pieces, dim)

    def read(self) -> torch.Tensor:
        return torch.cat([p.read() for p in self.parts], self.cat_dim)


def lazy_safetensors(path: Path) -> dict[str, LazyTensor]:
    """Every tensor of one safetensors file as a ``LazyTensor`` (only the header is read)."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            s = f.get_slice(key)
            dtype = _DTYPES.get(s.get_dtype())
            if dtype is None:
                raise ValueError(f"{path}: tensor {key} has dtype {s.get_dtype()}, which mmtrain does not read")
            out[key] = LazyTensor(path, key, tuple(s.get_shape()), dtype)
    return out
