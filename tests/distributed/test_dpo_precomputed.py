"""DPO with precomputed reference log-probs (``dpo.reference_logps: precomputed``): the table written once beside
the shards (``mmtrain.dpo_reference``, here under PP2) gives the same losses and weights as the frozen-reference
run; a missing, stale or damaged table is a one-line error naming the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.config.validate import validate_gpt_config
from mmtrain.data.blend_spec import BlendSpecError
from mmtrain.data.preference_dataset import build_preference_pairs_from_config
from mmtrain.data.reference_logps import read_reference_logps, reference_logps_paths, write_reference_logps
from mmtrain.testing import run_distributed
from tests.sft_helpers import write_preference_dataset
from tests.unit.test_dpo import SEQ
from tests.unit.test_dpo import _overrides as _dpo_overrides


@pytest.fixture(scope="module")
def pref_prefix(tmp_path_factory):
    return write_preference_dataset(tmp_path_factory.mktemp("pref"))


def _run(rank, world_size, overrides, what):
    from mmtrain.parallel import ParallelDims
    from mmtrain.train.dpo_reference import compute_reference_logps
    from mmtrain.train.loop import train_gpt

    cfg = load_config(GPTRunConfig, None, overrides)
    validate_gpt_config(cfg, world_size)
    mesh = ParallelDims.from_config(cfg.parallel, world_size).build()
    if what == "reference":
        written = compute_reference_logps(cfg, mesh, torch.device("cpu"))
        return None if written is None else str(written)
    result = train_gpt(cfg, mesh, torch.device("cpu"))
    return result.losses, {k: v.detach().clone() for k, v in result.model.named_parameters()}


def test_precomputed_reference_equals_the_frozen_reference_run(pref_prefix, tmp_path):
    common = _dpo_overrides(pref_prefix, "train.steps=3", "train.micro_batch_size=4", "train.eval_every=0",
                            "optim.warmup_steps=0", "optim.lr=5e-3")
    frozen = run_distributed(_run, 1, [*common, f"logging.run_dir={tmp_path}/a"], "train")[0]
    precomputed = load_config(GPTRunConfig, None, [*common, "dpo.reference_logps=precomputed"])
    with pytest.raises(BlendSpecError, match=r"p\.dpo_reference\.json is missing"):  # not computed yet
        build_preference_pairs_from_config(precomputed, "train", 1)
    # computed through the pipeline schedule at another layout, with a ragged last micro-batch (16 pairs / 3)
    records = run_distributed(_run, 2, [*common, "parallel.pp=2", "train.micro_batch_size=3",
                                        f"logging.run_dir={tmp_path}/r"], "reference")
    assert records[0] is None and records[1] == str(reference_logps_paths(pref_prefix)[1])
    record = json.loads(reference_logps_paths(pref_prefix)[1].read_text())
    assert record["pairs"] == 16 and record["seq_length"] == SEQ and record["reference"].startswith("seeded init")
    pre = run_distributed(_run, 1, [*common, "dpo.reference_logps=precomputed", f"logging.run_dir={tmp_path}/b"],
                          "train")[0]
    torch.testing.assert_close(torch.tensor(pre[0]), torch.tensor(frozen[0]), rtol=1e-5, atol=1e-6)
    assert abs(pre[0][0] - np.log(2)) < 1e-5 and pre[0][-1] < pre[0][0]  # the policy starts as the reference
    for name, p in pre[1].items():
        torch.testing.assert_close(p, frozen[1][name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_missing_stale_or_damaged_table_is_refused(pref_prefix, tmp_path):
    prefix = tmp_path / "p"
    with pytest.raises(BlendSpecError, match=r"p\.dpo_reference\.json is missing; run python -m "
                                             r"mmtrain\.dpo_reference"):
        read_reference_logps(prefix, 4, SEQ)
    write_reference_logps(prefix, np.arange(8.0).reshape(4, 2) - 10, SEQ, "ckpt")
    np.testing.assert_array_equal(read_reference_logps(prefix, 4, SEQ), np.arange(8.0).reshape(4, 2) - 10)
    with pytest.raises(BlendSpecError, match=r"holds 4 pairs, .* has 5 \(the data was re-prepared\?\)"):
        read_reference_logps(prefix, 5, SEQ)
    with pytest.raises(BlendSpecError, match=r"data\.seq_length=48, this run has 32"):
        read_reference_logps(prefix, 4, 32)
    data = reference_logps_paths(prefix)[0]
    raw = bytearray(data.read_bytes())
    raw[3] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(BlendSpecError, match=r"p\.dpo_reference\.bin does not match its checksum"):
        read_reference_logps(prefix, 4, SEQ)


def test_the_command_takes_a_dpo_config_only(capsys, tmp_path):
    from mmtrain.dpo_reference import main

    assert main(["data.mock=true", f"logging.run_dir={tmp_path}"]) == 2
    assert "train.objective=lm: mmtrain.dpo_reference takes a DPO run's config" in capsys.readouterr().err
