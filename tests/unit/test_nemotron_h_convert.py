"""The nemotron_h family's HF bridge (``mmtrain/models/nemotron_h/hf_adapter.py``, ``lora_export.py``):
``python -m mmtrain.convert`` HF -> TP2 x PP2 checkpoint -> HF is bit-exact and ``compare`` gives HF's fp32 logits
on a prompt of many chunks; a packed batch of two documents gives HF's logits of each document alone; the Hub's
older config form (``hybrid_override_pattern``, ``mamba_*`` aliases) reads as transformers reads it; the dt clamp
exported so that transformers 5.24 and 5.25 apply the same one, and a config whose clamp differs between them
refused; tied embeddings; refusals in one line naming the key; LoRA exports (merged, peft) give the adapted model's
logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "NemotronHForCausalLM"):
    pytest.skip("this transformers has no NemotronHForCausalLM", allow_module_level=True)

from mmtrain.config.schema import LoraConfig  # noqa: E402
from mmtrain.convert.__main__ import main as convert_main  # noqa: E402
from mmtrain.convert.checkpoint_io import read_full_state  # noqa: E402
from mmtrain.convert.hf_files import read_hf_tensors  # noqa: E402
from mmtrain.model.attention import CausalAttention  # noqa: E402
from mmtrain.models.nemotron_h import hf_adapter  # noqa: E402
from mmtrain.models.nemotron_h.hf_adapter import HFAdapterError, config_from_hf  # noqa: E402
from mmtrain.models.nemotron_h.lora_export import merge_lora, peft_adapter  # noqa: E402
from mmtrain.models.nemotron_h.model import NemotronHModel  # noqa: E402
from tests.inference_helpers import NEMOTRON_H_SHAPE, tiny_hf_nemotron_h  # noqa: E402

pytestmark = pytest.mark.unit
BIASES = dict(use_bias=True, mlp_bias=True)
TEXT = "a prompt of many four-token chunks through every layer kind"
INF = {"__float__": "Infinity"}  # transformers' config.json form of inf


def _clamps(config: dict) -> tuple[tuple, tuple]:
    """The dt clamp each transformers version builds from a config.json mapping, as their sources read it: 5.24's
    mixer (time_step_min, inf), 5.25's time_step_limit (default [0.0, inf]); a mamba_dt_* alias wins."""
    def number(value):
        return math.inf if value == INF else value

    low = config.get("mamba_dt_min", config.get("time_step_min", 0.001))
    limit = config.get("mamba_dt_limit", config.get("time_step_limit", [0.0, math.inf]))
    return (number(low), math.inf), tuple(number(end) for end in limit)


def _ours(hf_model, **model_args) -> NemotronHModel:
    """Our model of an HF model's config and weights, through the adapter."""
    cfg = config_from_hf(hf_model.config.to_dict())
    model = NemotronHModel(cfg, **model_args)
    model.load_state_dict(hf_adapter.state_dict_from_hf(hf_model.state_dict(), cfg), strict=True)
    return model.eval()


def _in_memory_names(saved: dict) -> dict:
    """Saved names (``backbone.*``) as transformers names the loaded model's tensors (``model.*``)."""
    return {("model." + k.removeprefix("backbone.") if k.startswith("backbone.") else k): v for k, v in saved.items()}


def test_cli_round_trip_is_exact_and_compare_gives_hf_logits(tmp_path, capsys):
    tiny_hf_nemotron_h(**BIASES).save_pretrained(tmp_path / "hf")
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c"),
                         "--tp", "2", "--pp", "2"]) == 0
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "c"), "--out", str(tmp_path / "o")]) == 0
    original, back = read_hf_tensors(tmp_path / "hf"), read_hf_tensors(tmp_path / "o")
    assert sorted(back) == sorted(original) and all(torch.equal(back[n], t) for n, t in original.items())
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    exported = json.loads((tmp_path / "o" / "config.json").read_text())
    assert exported["layers_block_type"] == source["layers_block_type"]
    assert exported["hybrid_override_pattern"] == NEMOTRON_H_SHAPE["hybrid_override_pattern"]
    assert config_from_hf(exported) == config_from_hf(source)
    text = (tmp_path / "o" / "config.json").read_text()  # strict JSON: inf as transformers writes it
    json.loads(text, parse_constant=lambda name: pytest.fail(f"config.json holds {name}"))
    assert _clamps(exported) == ((0.001, math.inf), (0.001, math.inf)) and exported["time_step_limit"][1] == INF

    capsys.readouterr()
    assert len(TEXT.encode()) > 10 * NEMOTRON_H_SHAPE["chunk_size"]  # the prompt (its bytes) spans many chunks
    assert convert_main(["compare", "--hf", str(tmp_path / "hf"), "--ckpt", str(tmp_path / "c"), "--text", TEXT]) == 0
    out = capsys.readouterr().out
    assert "logits: max |diff|" in out and out.strip().splitlines()[-1].startswith("OK")
    _, cfg, _ = read_full_state(tmp_path / "c")
    assert cfg.family == "nemotron_h" and cfg.nemotron_h.time_step_limit == [0.001, None]


def test_a_packed_batch_of_two_documents_gives_hf_logits_of_each_alone():
    hf = tiny_hf_nemotron_h()
    ours = _ours(hf, attention=CausalAttention(documents="dense"))
    ids = torch.randint(0, 128, (1, 23), generator=torch.Generator().manual_seed(1))
    doc_ids = torch.tensor([[0] * 10 + [1] * 13])  # the second document starts inside a chunk
    with torch.no_grad():
        packed = ours(ids, doc_ids_BS=doc_ids)
        alone = torch.cat([hf(ids[:, :10]).logits, hf(ids[:, 10:]).logits], dim=1)
    assert alone.abs().max() > 1.0
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-4)


def test_the_older_config_form_reads_as_transformers_reads_it():
    """The Hub's configs: ``hybrid_override_pattern`` + ``num_hidden_layers``, the ``mamba_*`` aliases (which win
    over the plain keys, as in transformers), legacy layer type names."""
    older = {"model_type": "nemotron_h", "hybrid_override_pattern": "M*M-MM", "num_hidden_layers": 6,
             **{k: v for k, v in NEMOTRON_H_SHAPE.items() if k != "hybrid_override_pattern"},
             "mamba_n_groups": 4, "n_groups": 2, "mamba_d_conv": 3, "mamba_chunk_size": 8, "mamba_dt_min": 0.002,
             "mamba_dt_limit": [0.002, math.inf], "time_step_limit": [0.0, math.inf], "mamba_conv_bias": False}
    ours = config_from_hf(older)
    theirs = transformers.NemotronHConfig(**{k: v for k, v in older.items() if k != "model_type"})
    assert ours == config_from_hf(theirs.to_dict())
    assert (ours.n_groups, ours.conv_kernel, ours.chunk_size, ours.use_conv_bias) == (4, 3, 8, False)
    assert ours.time_step_limit == [0.002, None] and ours.time_step_min == 0.002
    legacy = {**theirs.to_dict(), "layers_block_type": ["mamba", "attention", "mamba", "mlp", "mamba", "mamba"]}
    assert config_from_hf(legacy) == ours


@pytest.mark.parametrize("low", [0.003, 0.0])
def test_the_export_clamps_dt_alike_in_transformers_5_24_and_5_25(low):
    """The export writes the clamp where both versions read it, over a Hub-like base whose own keys disagree; the
    installed transformers builds its mixers with that clamp."""
    cfg = config_from_hf(tiny_hf_nemotron_h().config.to_dict())
    cfg = type(cfg)(**{**vars(cfg), "time_step_limit": [low, None]})
    base = {"model_type": "nemotron_h", "time_step_limit": [0.0, INF], "mamba_dt_limit": [0.0, INF],
            "time_step_min": 0.001, "mamba_dt_min": 0.001}
    exported = hf_adapter.config_to_hf(cfg, base)
    assert _clamps(exported) == ((low, math.inf), (low, math.inf))
    assert config_from_hf(exported).time_step_limit == [low, None]
    if low == 0.0:
        return  # transformers cannot initialize a model of time_step_min 0 (it takes its log); loading one works
    fields = dict(exported)
    model = transformers.NemotronHForCausalLM(transformers.AutoConfig.for_model(fields.pop("model_type"), **fields))
    assert tuple(model.model.layers[0].mixer.time_step_limit) == (low, math.inf)


@pytest.mark.parametrize("changes, message", [
    ({"time_step_limit": [0.001, None]}, r"time_step_limit\[1\]=None must be a number \(Infinity, or"),
    ({"time_step_limit": [0.001]}, r"time_step_limit=\[0\.001\] must be \[low, high\]"),
    ({"time_step_limit": [0.5, 0.1]}, r"time_step_limit=\[0\.5, 0\.1\] must be \[low, high\] with 0 <= low < high"),
    ({"time_step_limit": [-0.1, INF]}, r"time_step_limit=\[-0\.1, inf\] must be \[low, high\] with 0 <= low"),
], ids=["null", "short", "reversed", "negative"])
def test_a_misshapen_dt_clamp_is_refused(changes, message):
    with pytest.raises(HFAdapterError, match=message) as info:
        config_from_hf(_config(**changes))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("changes, limit, init_low", [
    ({"time_step_limit": [0.0, INF], "time_step_min": 0.001}, [0.0, None], 0.001),  # the Hub's: Mamba-2's reading
    ({"mamba_dt_limit": [0.0, INF], "time_step_min": 0.002}, [0.0, None], 0.002),
    ({"time_step_limit": [0.001, 0.5]}, [0.001, 0.5], None),
    ({"time_step_limit": [0.002, INF], "time_step_min": 0.002}, [0.002, None], 0.002),
    ({"time_step_limit": [0.002, math.inf], "mamba_dt_min": 0.002}, [0.002, None], 0.002),
    ({"time_step_limit": None, "time_step_min": 0.002}, [0.002, None], 0.002),  # written for 5.24: its clamp
    ({"time_step_limit": None, "time_step_min": 0.0}, [0.0, None], None),
], ids=["hub", "hub_alias", "upper", "tagged", "bare_inf_alias", "no_limit", "no_limit_no_clamp"])
def test_the_dt_clamp_is_imported_as_mamba2_applies_it(changes, limit, init_low):
    """``time_step_limit`` is the clamp (Mamba-2's and transformers >= 5.25's meaning); without it, 5.24's
    [time_step_min, inf]. ``time_step_min`` stays the init range's low end."""
    cfg = config_from_hf(_config(**changes))
    assert cfg.time_step_limit == limit
    if init_low is not None:
        assert cfg.time_step_min == init_low


def test_tied_embeddings_export_the_lm_head_transformers_reads():
    """transformers' NemotronH never ties: it saves and reads its own lm_head. A tied HF model (lm_head equal to
    the embedding) maps to our tied model, whose export writes lm_head back."""
    hf = tiny_hf_nemotron_h(tie_word_embeddings=True)
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.model.embeddings.weight)
    state = hf.state_dict()
    cfg = config_from_hf(hf.config.to_dict())
    ours = hf_adapter.state_dict_from_hf(state, cfg)
    assert cfg.tie_word_embeddings and "output.weight" not in ours
    back = _in_memory_names(hf_adapter.state_dict_to_hf(ours, cfg))
    assert sorted(back) == sorted(state) and all(torch.equal(back[n], t) for n, t in state.items())
    with torch.no_grad():
        hf.lm_head.weight.add_(1.0)
    with pytest.raises(HFAdapterError, match="lm_head.weight differs from model.embeddings.weight but "
                                             "tie_word_embeddings is true"):
        hf_adapter.state_dict_from_hf(hf.state_dict(), cfg)


def _config(**changes):
    hf = tiny_hf_nemotron_h().config.to_dict()
    for key, value in changes.items():
        if value is None:
            hf.pop(key)
        else:
            hf[key] = value
    return hf


@pytest.mark.parametrize("changes, message", [
    ({"layers_block_type": ["linear_attention", "moe"]}, r"^config\.json: layers_block_type layer 1 is a "
                                                         r"mixture-of-experts layer \('moe' / 'E'\)"),
    ({"layers_block_type": None, "hybrid_override_pattern": "M*X"}, r"hybrid_override_pattern layer 2 is 'X'"),
    ({"layers_block_type": None}, r"lacks layers_block_type \(or hybrid_override_pattern\)"),
    ({"num_nextn_predict_layers": 1}, r"num_nextn_predict_layers=1 is not supported: multi-token-prediction"),
    ({"residual_in_fp32": True}, r"residual_in_fp32=True is not supported"),
    ({"sliding_window": 16}, r"sliding_window=16 is not supported"),
    ({"mlp_hidden_act": "silu"}, r"mlp_hidden_act='silu' is not supported; supported: 'relu2'"),
    ({"num_hidden_layers": 5}, r"num_hidden_layers=5, but layers_block_type has 6 layers"),
    ({"ssm_state_size": None}, r"lacks 'ssm_state_size'"),
    ({"n_groups": 3}, r"n_groups=3: must divide mamba_num_heads"),
    ({"time_step_min": -1.0}, r"time_step_min=-1.0 must be a non-negative number"),
], ids=["moe", "letter", "no_layers", "mtp", "fp32_residual", "window", "act", "layers", "missing", "groups", "dt"])
def test_unsupported_configs_are_one_line(changes, message):
    with pytest.raises(HFAdapterError, match=message) as info:
        config_from_hf(_config(**changes))
    assert "\n" not in str(info.value)


def test_weights_that_disagree_are_one_line_and_the_cli_exits_2(tmp_path, capsys):
    hf = tiny_hf_nemotron_h()
    state = hf.state_dict()
    cfg = config_from_hf(hf.config.to_dict())
    with pytest.raises(HFAdapterError, match=r"^config\.json: mamba_num_heads\*mamba_head_dim \+ 2\*n_groups\*"
                                             r"ssm_state_size=80, but the weights hold 68: model\.layers\.0\.mixer\."
                                             r"conv1d\.weight has shape \(68, 1, 4\)"):
        hf_adapter.state_dict_from_hf(state, config_from_hf({**hf.config.to_dict(), "ssm_state_size": 8}))
    with pytest.raises(HFAdapterError, match=r"HF state dict has 'mtp\.layers\.0\.norm\.weight' \(1 unused"):
        hf_adapter.state_dict_from_hf({**state, "mtp.layers.0.norm.weight": torch.ones(32)}, cfg)
    with pytest.raises(HFAdapterError, match=r"time_step_limit=\[0\.0, 0\.5\]: transformers 5\.24's "
                                             r"NemotronHForCausalLM clamps dt only from below"):
        hf_adapter.config_to_hf(type(cfg)(**{**vars(cfg), "time_step_limit": [0.0, 0.5]}))
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    capsys.readouterr()
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "num_nextn_predict_layers=2 is not supported" in err and err.count("\n") == 1
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_lora_exports_give_the_adapted_logits(tmp_path, dora):
    """Adapters on every target (Mamba in/out projections, fused qkv, attention output, MLP): the merged export in
    transformers computes the adapted model's logits; so does the peft adapter through ``PeftModel`` on the HF base
    for every target but the Mamba out_proj, which peft refuses on a Mamba model (and the export with it)."""
    peft = pytest.importorskip("peft")
    from mmtrain.convert.hf_files import write_peft_adapter

    base_hf = tiny_hf_nemotron_h()
    cfg = config_from_hf(base_hf.config.to_dict())
    lora = LoraConfig(rank=2, alpha=4.0, dora=dora, targets=list(cfg.lora_targets()))
    adapted = NemotronHModel(cfg, lora=lora)
    adapted.load_state_dict(hf_adapter.state_dict_from_hf(base_hf.state_dict(), cfg), strict=False)
    with torch.no_grad():  # trained-looking adapters: B nonzero, magnitudes off the row norms
        g = torch.Generator().manual_seed(5)
        for name, p in adapted.named_parameters():
            if ".adapter." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    full = {k: v.detach().clone() for k, v in adapted.state_dict().items()}
    ids = torch.randint(0, 128, (2, 11), generator=g)
    with torch.no_grad():
        expected = adapted.eval()(ids)

    merged = transformers.NemotronHForCausalLM(base_hf.config).eval()
    merged.load_state_dict(_in_memory_names(hf_adapter.state_dict_to_hf(merge_lora(full, cfg, lora), cfg)))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-4)
    with pytest.raises(HFAdapterError, match=r"^peft\.lora\.targets out_proj: peft refuses LoRA on a Mamba layer's"):
        peft_adapter(full, cfg, lora)

    peft_targets = [t for t in lora.targets if t != "out_proj"]
    lora = LoraConfig(rank=2, alpha=4.0, dora=dora, targets=peft_targets)
    adapted = NemotronHModel(cfg, lora=lora)
    adapted.load_state_dict({k: v for k, v in full.items() if "out_proj.adapter" not in k}, strict=True)
    with torch.no_grad():
        expected = adapted.eval()(ids)
    base_hf.save_pretrained(tmp_path / "hf")
    config, tensors = peft_adapter(adapted.state_dict(), cfg, lora, str(tmp_path / "hf"))
    assert set(config["target_modules"]) == {"in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                             "down_proj"}
    write_peft_adapter(tmp_path / "adapter", config, tensors)
    with_adapter = peft.PeftModel.from_pretrained(base_hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(ids).logits, expected, rtol=0, atol=1e-4)
