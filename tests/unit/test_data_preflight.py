"""The entry points' data preflight (mmtrain.data.preflight) looks for the files each data.type reads: a
preference prefix is the --output-prefix of `mmtrain-prep sft --preference` (PREFIX_chosen*, PREFIX_rejected*), an
SFT prefix needs its loss mask; a wrong one is one line naming the key, the files and the fix."""

from __future__ import annotations

import shutil

import pytest

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.data.blend_spec import BlendSpecError
from mmtrain.data.preflight import check_gpt_data_paths
from tests.sft_helpers import write_preference_dataset


@pytest.fixture(scope="module")
def pref_prefix(tmp_path_factory):
    return write_preference_dataset(tmp_path_factory.mktemp("pref"), pairs=4)


def _cfg(data_type, *prefixes):
    return load_config(GPTRunConfig, None, [f"data.type={data_type}", f"data.prefixes=[{','.join(map(str, prefixes))}]"])


def test_preference_prefix_is_the_prep_output_prefix(pref_prefix, tmp_path):
    check_gpt_data_paths(_cfg("preference", pref_prefix))  # was: indexed dataset .../p not found (p.bin)
    with pytest.raises(BlendSpecError) as missing:
        check_gpt_data_paths(_cfg("preference", tmp_path / "nope"))
    text = str(missing.value)
    assert text.startswith(f"data.prefixes[0]={tmp_path / 'nope'}: preference pairs not found (missing ")
    assert f"{tmp_path / 'nope'}_chosen.idx" in text and "mmtrain-prep sft --preference" in text
    assert "\n" not in text
    for suffix in (".bin", ".idx"):  # an SFT/text output under that name: the likely mistake is named
        shutil.copy(f"{pref_prefix}_chosen{suffix}", tmp_path / f"sft{suffix}")
    with pytest.raises(BlendSpecError, match="prepared without --preference"):
        check_gpt_data_paths(_cfg("preference", tmp_path / "sft"))
    with pytest.raises(BlendSpecError, match="reads one prepared prefix .* got 2"):
        check_gpt_data_paths(_cfg("preference", pref_prefix, pref_prefix))


def test_sft_prefix_needs_its_loss_mask(pref_prefix, tmp_path):
    chosen = f"{pref_prefix}_chosen"
    check_gpt_data_paths(_cfg("sft", chosen))  # PREFIX_chosen_loss_mask is beside it
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{chosen}{suffix}", tmp_path / f"bare{suffix}")
    check_gpt_data_paths(_cfg("gpt", tmp_path / "bare"))  # plain text needs no mask
    with pytest.raises(BlendSpecError, match=r"data.prefixes\[0\]: .*bare has no loss mask \(missing .*bare_loss_mask"):
        check_gpt_data_paths(_cfg("sft", tmp_path / "bare"))
