"""init.* parts from a Hugging Face folder at TP2: each rank's shards equal the ones cut from the full tensors,
and a rank reads only its rows of the split tensors (``safe_open(...).get_slice``), including the fused q|k|v
and gate|up ones."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mmtrain.convert import lazy_tensors  # noqa: E402
from mmtrain.convert.hf_files import read_hf_config, read_hf_tensors  # noqa: E402
from mmtrain.convert.lazy_tensors import LazyTensor, materialize  # noqa: E402
from mmtrain.convert.vlm_convert import vlm_from_hf  # noqa: E402
from mmtrain.convert.vlm_parts import read_part  # noqa: E402
from mmtrain.models.vlm import VLMModel  # noqa: E402
from mmtrain.parallel.tensor import tp_partition, tp_shard_of  # noqa: E402
from tests.unit.test_llava_hf import make_llava  # noqa: E402


def test_tp2_shards_from_a_folder_equal_the_full_tensors_cut_and_read_only_their_rows(tmp_path, monkeypatch):
    make_llava("siglip", "llama").save_pretrained(tmp_path / "hf")
    cfg, full, _, _ = vlm_from_hf(read_hf_config(tmp_path / "hf"), read_hf_tensors(tmp_path / "hf"))
    with torch.device("meta"):
        spec = VLMModel(cfg).sharding_spec()
    reads: list[tuple[str, int | None, int, int]] = []
    real_read = LazyTensor.read

    def recording_read(self):
        dim = self.range_dim
        reads.append((self.key, dim, self.start, self.shape[dim] if dim is not None else self.shape.numel()))
        return real_read(self)

    monkeypatch.setattr(lazy_tensors.LazyTensor, "read", recording_read)
    split = 0
    for part in ("vision", "language"):
        _, tensors, _ = read_part(tmp_path / "hf", part)
        for name in (n for n in spec if n.startswith(part + ".") and not spec[n].buffer):
            key = spec.stored_name(name).removeprefix(part + ".")
            for rank in (0, 1):
                reads.clear()
                got = materialize(tp_shard_of(name, tensors[key], spec, rank, 2))
                want = tp_shard_of(name, full[spec.stored_name(name)], spec, rank, 2)
                assert torch.equal(got, want), name
                if tp_partition(name, spec) is not None:  # a split tensor: only ranges of this rank's rows
                    split += 1
                    assert reads and all(dim is not None for _, dim, _, _ in reads), (name, reads)
                    assert sum(n for *_, n in reads) == want.shape[tp_partition(name, spec)[0]], (name, reads)
    assert split > 10  # q|k|v, o, gate|up, down of both towers, the vocabulary rows
