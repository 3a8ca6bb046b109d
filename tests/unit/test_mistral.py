"""Mistral in the Llama family: ``model.sliding_window`` on the Llama shape, every layer's attention restricted to
the window in training (window ∩ packed documents, flex equal to dense) and in KV-cache decoding; a random
``MistralForCausalLM`` converts with HF's logits (``python -m mmtrain.convert compare``, in-process) on inputs
longer than the window, where the same weights without the window do not; greedy decoding equals transformers'
``generate``; ``configs/models/mistral-7b.yaml`` is Mistral-7B-v0.1's shape. The exact HF round trip is a case of
tests/unit/test_convert_hf.py; the parallel layouts and the LoRA export are tests/distributed/test_mistral_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch

from mmtrain.config import ConfigError, GPTRunConfig, load_config, validate_gpt_config
from mmtrain.convert import hf_to_mmtrain
from mmtrain.convert.checkpoint_io import read_full_state
from mmtrain.convert.compare import compare
from mmtrain.inference.engine import DecodeEngine, generate
from mmtrain.inference.sampling import SamplingParams
from mmtrain.model.attention import CausalAttention, DenseDocuments, FlexDocuments
from mmtrain.models.llama.hf_adapter import hf_config_from_model_config, model_config_from_hf
from mmtrain.models.llama.model import GPTModel, count_parameters
from tests.inference_helpers import tiny_checkpoint, tiny_config
from tests.unit.test_document_attention import _cfg, _loss_and_grads, _packed_tokens

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=96, max_position_embeddings=256, sliding_window=5)
LONG_TEXT = "a sliding window of five tokens sees only the end of this sentence"  # 66 byte tokens


@pytest.fixture
def cpu_flex(monkeypatch):
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda q, k, v: None)


def _random_mistral(path):
    """A tiny random MistralForCausalLM saved at ``path``, q/k scaled up (sharp attention: the window shows)."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(25.0)
            elif p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model.eval()


def test_converted_mistral_compares_equal_and_the_window_matters(tmp_path):
    hf = _random_mistral(tmp_path / "hf")
    hf_to_mmtrain(tmp_path / "hf", tmp_path / "ckpt", tp=2, pp=1)
    printed: list[str] = []
    worst = compare(tmp_path / "hf", tmp_path / "ckpt", text=LONG_TEXT, printer=printed.append)
    assert worst < 1e-4, printed
    full, cfg, _ = read_full_state(tmp_path / "ckpt")
    assert cfg.sliding_window == 5 and "sliding_window: 5" in (tmp_path / "ckpt" / "model.yaml").read_text()
    # the same weights with the window left out: not HF's model (so the comparison above saw the window)
    ids = torch.tensor([list(LONG_TEXT.encode())]) % SMALL["vocab_size"]
    no_window = GPTModel(model_config_from_hf({**json.loads((tmp_path / "hf" / "config.json").read_text()),
                                               "sliding_window": None}))
    no_window.load_state_dict(full)
    with torch.no_grad():
        assert (no_window.eval()(ids) - hf(ids).logits).abs().max() > 1e-2


def test_greedy_decoding_equals_transformers_generate_past_the_window(tmp_path):
    from mmtrain.convert.__main__ import main as convert_main
    from mmtrain.inference.loading import load_checkpoint_model
    from mmtrain.parallel import ParallelDims, init_distributed, shutdown_distributed

    ckpt = tiny_checkpoint(tmp_path / "ckpt", tiny_config(num_layers=3, sliding_window=6), tp=2)
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "MistralForCausalLM" and hf.config.sliding_window == 6
    init_distributed()
    try:
        model, _ = load_checkpoint_model(ckpt, ParallelDims(1).build(), "cpu", torch.float32)
    finally:
        shutdown_distributed()
    prompts = [[5, 6, 7, 8, 9], [11, 12], list(range(40, 57)), [300, 301, 7]]
    ours = generate(DecodeEngine(model, slots=4, max_len=64), prompts, SamplingParams(max_new_tokens=24))
    theirs = []
    for p, s in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)
        theirs.append(out[0, len(p):].tolist())
    assert [s.token_ids for s in ours] == theirs
    for layer in model.layers.values():  # the decode core without the window: other tokens
        layer.attn.window = None
    unwindowed = generate(DecodeEngine(model, slots=4, max_len=64), prompts, SamplingParams(max_new_tokens=24))
    assert [s.token_ids for s in unwindowed] != theirs


def test_window_with_packed_documents_flex_equals_dense_and_the_window_matters(cpu_flex):
    tokens = _packed_tokens([[4, 12, 13, 26], [20]], 32)
    results = []
    for kernel in (FlexDocuments(block=8), DenseDocuments()):
        model = GPTModel(_cfg("model.sliding_window=5"), attention=CausalAttention(kernel))
        model.init_weights(5)
        results.append(_loss_and_grads(model, tokens))
    (flex_loss, flex_grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(flex_loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(flex_grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    unwindowed = GPTModel(_cfg(), attention=CausalAttention(DenseDocuments()))
    unwindowed.init_weights(5)
    assert (_loss_and_grads(unwindowed, tokens)[0] - ref_loss).abs() > 1e-4


def test_window_without_documents_is_one_document_and_a_window_past_the_sequence_is_none():
    windowed, wide, plain = (GPTModel(_cfg(*extra)).eval() for extra in
                             (["model.sliding_window=3"], ["model.sliding_window=20"], []))
    windowed.init_weights(1)
    for m in (wide, plain):
        m.load_state_dict(windowed.state_dict())
    tokens = _packed_tokens([[], []], 20)[:, :-1]
    with torch.no_grad():
        one_document = windowed(tokens, doc_ids_BS=torch.zeros(2, 20, dtype=torch.long))
        assert torch.equal(windowed(tokens), one_document)
        assert (windowed(tokens) - plain(tokens)).abs().max() > 1e-3
        assert torch.equal(wide(tokens), plain(tokens))  # 20 tokens fit a 20-token window


def test_mistral_7b_yaml_is_mistral_7b_v01():
    run = load_config(GPTRunConfig, "configs/models/mistral-7b.yaml", ["data.mock=true"])
    validate_gpt_config(run)
    m = run.model
    hf = hf_config_from_model_config(m)
    reference = transformers.MistralConfig(rms_norm_eps=1e-5, max_position_embeddings=32768, rope_theta=10000.0)
    assert hf["model_type"] == "mistral" and hf["architectures"] == ["MistralForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "sliding_window", "tie_word_embeddings"):
        assert hf[key] == getattr(reference, key), key
    assert hf["rope_theta"] == reference.rope_parameters["rope_theta"]
    assert count_parameters(m) == 7_241_732_096  # Mistral-7B-v0.1's parameter count
    assert model_config_from_hf(hf).sliding_window == m.sliding_window == 4096


@pytest.mark.parametrize("comm", ["allgather", "ring"])
def test_context_parallel_with_a_window_is_a_config_error_naming_parallel_cp(comm):
    cfg = load_config(GPTRunConfig, None, ["data.mock=true", "model.sliding_window=4", "parallel.cp=2",
                                           f"parallel.cp_comm={comm}"])
    with pytest.raises(ConfigError, match=r"parallel\.cp=2 is not supported with model\.sliding_window=4"):
        validate_gpt_config(cfg)
    with pytest.raises(ConfigError, match="sliding_window"):
        validate_gpt_config(load_config(GPTRunConfig, None, ["data.mock=true", "model.sliding_window=-1"]))
