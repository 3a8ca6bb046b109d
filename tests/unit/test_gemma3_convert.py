"""The gemma3 family through the shared tools: ``python -m mmtrain.convert`` (HF folder -> TP2 x PP2 checkpoint
-> HF folder is exact; ``compare`` gives HF's logits on a prompt longer than the window), greedy KV-cache
generation (``mmtrain.inference``, the family's ``decode``) equal to transformers' ``generate`` token for token and
to the model's own uncached forward, and ``configs/models/gemma3-1b.yaml`` (google/gemma-3-1b-pt's shape)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma3ForCausalLM"):
    pytest.skip("this transformers has no Gemma3ForCausalLM", allow_module_level=True)

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config  # noqa: E402
from mmtrain.convert.__main__ import main as convert_main  # noqa: E402
from mmtrain.convert.checkpoint_io import read_full_state  # noqa: E402
from mmtrain.convert.hf_files import read_hf_tensors  # noqa: E402
from mmtrain.inference.engine import DecodeEngine, generate  # noqa: E402
from mmtrain.inference.sampling import SamplingParams  # noqa: E402
from mmtrain.models.gemma3.flops import count_parameters  # noqa: E402
from mmtrain.models.gemma3.hf_adapter import config_from_hf  # noqa: E402
from mmtrain.models.registry import model_family  # noqa: E402

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
L, G = "sliding_attention", "full_attention"
# windows of 5 tokens on three of four layers; the prompts and completions below run far past them
SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, sliding_window=5, query_pre_attn_scalar=8, layer_types=[L, L, G, L],
             rope_theta=10_000.0, rope_local_base_freq=100.0, final_logit_softcapping=30.0,
             max_position_embeddings=128, pad_token_id=0, eos_token_id=None)  # HF generate masks an EOS under min_new_tokens; ours does not
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], list(range(40, 57)), [100, 101, 7]]
TEXT = "a prompt longer than every sliding window of the model"


def _hf_folder(path: Path):
    """A random tiny Gemma3ForCausalLM saved to ``path``, weights scaled up (sharp logits: greedy is far from ties;
    its greedy completions vary, and change when the window is ignored)."""
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**SMALL))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn_like(p)) if p.ndim == 1 else p.mul_(2.0)
    model.save_pretrained(path)
    return model.eval()


def test_cli_round_trip_is_exact_and_compare_gives_hf_logits(tmp_path, capsys):
    _hf_folder(tmp_path / "hf")
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c"),
                         "--tp", "2", "--pp", "2"]) == 0
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "c"), "--out", str(tmp_path / "o")]) == 0
    original, back = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(tmp_path / "o")
    assert sorted(back) == sorted(original) and all(torch.equal(back[n], t) for n, t in original.items())
    exported = json.loads((tmp_path / "o" / "config.json").read_text())
    assert exported["model_type"] == "gemma3_text" and exported["layer_types"] == SMALL["layer_types"]

    capsys.readouterr()
    assert len(TEXT.encode()) > 4 * SMALL["sliding_window"]  # the prompt (its bytes: no tokenizer) passes the window
    assert convert_main(["compare", "--hf", str(tmp_path / "hf"), "--ckpt", str(tmp_path / "c"), "--text", TEXT]) == 0
    out = capsys.readouterr().out
    assert "logits: max |diff|" in out and out.strip().splitlines()[-1].startswith("OK")

    full, cfg, _ = read_full_state(tmp_path / "c")
    assert cfg.family == "gemma3" and cfg.gemma3.layer_types == SMALL["layer_types"]
    run = load_config(GPTRunConfig, tmp_path / "c" / "model.yaml", ["data.mock=true"])  # include-able as is
    validate_gpt_config(run)
    assert run.model.family == "gemma3" and run.model.gemma3 == cfg.gemma3


def test_an_unsupported_config_is_one_line_exit_2(tmp_path, capsys):
    _hf_folder(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 50.0}))
    capsys.readouterr()
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "attn_logit_softcapping=50.0 is not supported" in err and err.count("\n") == 1
    assert not (tmp_path / "c").exists()


def _uncached_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_decoding_equals_transformers_generate_and_the_uncached_forward(tmp_path):
    from mmtrain.inference.loading import load_checkpoint_model
    from mmtrain.parallel import ParallelDims, init_distributed, shutdown_distributed

    hf = _hf_folder(tmp_path / "hf")
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c"),
                         "--tp", "2"]) == 0
    init_distributed()
    try:
        model, _ = load_checkpoint_model(tmp_path / "c", ParallelDims(1).build(), "cpu", torch.float32)
    finally:
        shutdown_distributed()
    new = 24
    ours = generate(DecodeEngine(model, slots=4, max_len=64), PROMPTS, SamplingParams(max_new_tokens=new))
    one = generate(DecodeEngine(model, slots=1, max_len=64), PROMPTS[:2], SamplingParams(max_new_tokens=new))
    for p, s in zip(PROMPTS, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        assert s.token_ids == out[0, len(p):].tolist()
    assert [s.token_ids for s in one] == [s.token_ids for s in ours[:2]]
    assert min(len(set(s.token_ids)) for s in ours) > 3  # not one token repeated: the comparison has teeth
    assert ours[2].token_ids == _uncached_greedy(model, PROMPTS[2], new)


def test_gemma3_1b_yaml_is_the_hub_shape():
    """configs/models/gemma3-1b.yaml: google/gemma-3-1b-pt's config.json values (those transformers'
    Gemma3TextConfig does not default: the rest are its defaults), validated, ~1.0B parameters."""
    run = load_config(GPTRunConfig, REPO / "configs/models/gemma3-1b.yaml", ["data.mock=true"])
    validate_gpt_config(run, 1)
    ours = run.model.gemma3
    hub = transformers.Gemma3TextConfig(vocab_size=262_144, hidden_size=1152, intermediate_size=6912,
                                        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                        sliding_window=512, max_position_embeddings=32_768)
    expected = config_from_hf(hub.to_dict())
    assert ours.layer_kinds() == expected.layer_kinds() and ours.layer_kinds().count(G) == 4
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "query_pre_attn_scalar", "sliding_window", "rope_theta",
                "rope_local_base_freq", "rope_scaling", "final_logit_softcapping", "attn_logit_softcapping",
                "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"):
        assert getattr(ours, key) == getattr(expected, key), key
    with torch.device("meta"):
        hf_params = sum(p.numel() for p in transformers.Gemma3ForCausalLM(hub).parameters())
        built = model_family(run.model).build_stage(run.model, (0, 26), True, True)
    assert count_parameters(ours) == hf_params == sum(p.numel() for p in built.parameters())
    assert 0.99e9 < hf_params < 1.01e9
