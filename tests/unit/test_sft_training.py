"""data.type=sft: packing layout, packed SFT equals one conversation per sample (loss and gradients), config
checks (the run through the loop, one process against DP2: tests/distributed/test_post_training_runs.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmtrain.config import ConfigError, GPTRunConfig, load_config
from mmtrain.config.validate import validate_gpt_config
from mmtrain.core.indexed import IndexedDataset
from mmtrain.data.sft_dataset import SFTSamples, sft_step_inputs
from mmtrain.models.llama.model import GPTModel
from tests.sft_helpers import build_chat_tokenizer, toy_conversations, write_sft_dataset

SEQ = 160


@pytest.fixture(scope="module")
def sft_prefix(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft_data")
    tok = build_chat_tokenizer(folder / "tok")
    return write_sft_dataset(folder, tok, toy_conversations(24))


def _overrides(prefix, *extra):
    return ["data.type=sft", f"data.prefixes=[{prefix}]", f"data.seq_length={SEQ}", "data.split=1,0,0",
            "model.vocab_size=640", "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64",
            "model.num_attention_heads=4", "train.precision=fp32", "train.device=cpu", *extra]


def test_packing_keeps_conversations_whole(sft_prefix):
    tokens, masks = IndexedDataset(sft_prefix), IndexedDataset(f"{sft_prefix}_loss_mask")
    packed = SFTSamples(sft_prefix, SEQ, seed=3, num_samples=1)
    single = SFTSamples(sft_prefix, SEQ, seed=3, num_samples=1, pack=False)
    assert len(single) == len(tokens) > len(packed)
    seen = []
    for i in range(len(packed)):
        sample = packed[i]
        for doc in range(int(packed.sample_count[i])):  # the document after these is the padding
            where = sample[2] == doc
            d = int(packed.order[int(packed.sample_start[i]) + doc])
            assert np.array_equal(sample[0, where], tokens[d][:SEQ + 1])
            assert np.array_equal(sample[1, where], masks[d][:SEQ + 1])
            assert np.array_equal(sample[3, where], np.arange(where.sum()))
            seen.append(d)
        assert not sample[1, sample[2] == packed.sample_count[i]].any()  # padding carries no loss
    assert sorted(seen) == list(range(len(tokens)))  # one epoch: every conversation exactly once


def test_step_inputs_never_predict_across_conversations():
    batch = torch.zeros(1, 4, 7, dtype=torch.int64)
    batch[0, 0] = torch.arange(7)
    batch[0, 1] = torch.tensor([0, 1, 1, 1, 1, 0, 0])  # token 3 starts conversation 1 and has mask 1
    batch[0, 2] = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    _, labels, _, _, loss_mask = sft_step_inputs(batch)
    assert labels.tolist() == [[1, 2, 3, 4, 5, 6]]
    assert loss_mask.tolist() == [[1, 1, 0, 1, 0, 0]]


def test_packed_equals_unpacked_loss_and_grads(sft_prefix):
    cfg = load_config(GPTRunConfig, None, _overrides(sft_prefix)).model
    torch.manual_seed(0)
    model = GPTModel(cfg)
    model.init_weights(1)

    def loss_and_grads(pack: bool):
        samples = SFTSamples(sft_prefix, SEQ, seed=5, num_samples=1, documents=(0, 12), pack=pack)
        model.zero_grad()
        batch = torch.stack([torch.as_tensor(samples[i]) for i in range(len(samples))])
        inputs, labels, positions, doc_ids, mask = sft_step_inputs(batch)
        loss = (model(inputs, labels, positions, doc_ids) * mask).sum() / mask.sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    packed_loss, packed_grads = loss_and_grads(True)
    single_loss, single_grads = loss_and_grads(False)
    torch.testing.assert_close(packed_loss, single_loss, rtol=1e-6, atol=1e-6)
    for name in packed_grads:
        torch.testing.assert_close(packed_grads[name], single_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_sft_config_checks(sft_prefix):
    for extra, message in [(["data.mock=true"], "data.type=sft reads data.prefixes"),
                           (["data.reset_attention_mask=true"], "data.reset_attention_mask is for data.type=gpt")]:
        with pytest.raises(ConfigError, match=message):
            validate_gpt_config(load_config(GPTRunConfig, None, _overrides(sft_prefix, *extra)))
    with pytest.raises(ConfigError, match="data.sft_pack=false applies to data.type=sft only"):
        validate_gpt_config(load_config(GPTRunConfig, None, ["data.mock=true", "data.sft_pack=false"]))


def test_preference_data_is_refused_for_sft(tmp_path):
    from dataprep.cli import main as prep
    from mmtrain.data.blend_spec import BlendSpecError
    from mmtrain.data.sft_dataset import build_sft_samples_from_config

    tok = build_chat_tokenizer(tmp_path / "tok")
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "hi", "chosen": "hello", "rejected": "go"}\n')
    assert prep(["sft", "--preference", "--input", str(src), "--output-prefix", str(tmp_path / "p"), "--tokenizer",
                 str(tok), "--chat-template", "chatml", "--workers", "0"]) == 0
    cfg = load_config(GPTRunConfig, None, _overrides(tmp_path / "p_chosen"))
    with pytest.raises(BlendSpecError, match="no manifest|not mmtrain-prep sft"):
        build_sft_samples_from_config(cfg, "train", 1)
