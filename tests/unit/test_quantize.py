"""Post-training quantization (docs/quantization.md) on a tiny model trained on prepared text: the folders
transformers loads with logits equal to mmtrain's quantized forward, GPTQ no worse than round-to-nearest on held-out
text, generate / serve / evaluate running the folder, and one-line errors for bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmtrain.core.indexed import IndexedDataset
from mmtrain.inference.quantized_loading import load_quantized_model
from mmtrain.quantize.__main__ import main as quantize_main
from mmtrain.quantize.run import QuantizeSettings, quantize_checkpoint
from tests.quantize_helpers import SEQ, prepared_corpus, trained_checkpoint

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

FOLDERS = {"fp8": QuantizeSettings("fp8"), "w4a16_rtn": QuantizeSettings("w4a16", "rtn"),
           "w4a16_gptq": QuantizeSettings("w4a16", "gptq", samples=48, seq_len=SEQ, batch_size=16)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(root, checkpoint, held-out prefix, tokenizer) and the three quantized folders in root/<name>."""
    root = tmp_path_factory.mktemp("quantize")
    prefix, tok = prepared_corpus(root / "train", docs=500, seed=5)
    held, _ = prepared_corpus(root / "held", docs=80, seed=6, tokenizer=tok)
    ckpt = trained_checkpoint(root / "ckpt", prefix, tok, steps=200)
    for name, settings in FOLDERS.items():
        settings.calib = str(prefix) if settings.method == "gptq" else None
        quantize_checkpoint(ckpt, root / name, settings, log=lambda line: None)
    return root, ckpt, held, tok


def _held_out_loss(model, held) -> float:
    """Mean next-token loss over consecutive windows of the held-out prepared text."""
    ds = IndexedDataset(str(held))
    tokens = torch.from_numpy(np.concatenate([ds[i] for i in range(len(ds))]).astype(np.int64))
    windows = tokens[: (len(tokens) - 1) // SEQ * SEQ + 1]
    x = windows[:-1].view(-1, SEQ)
    y = windows[1:].view(-1, SEQ)
    with torch.no_grad():
        return F.cross_entropy(model(x).flatten(0, 1).double(), y.flatten()).item()


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_transformers_loads_the_folder_and_its_logits_equal_mmtrains_quantized_forward(trained, name):
    """transformers 5 loads a compressed-tensors folder on the CPU by decompressing it to dense weights on the
    first forward (and fake-quantizing FP8 inputs per token, as the scheme says); mmtrain's QuantizedLinear
    dequantizes the same stored values with the same scales on the CPU. Both compute in fp32 with the same
    rounding of the activations, so the logits agree to fp32 round-off of differently shaped GEMMs (fused
    q|k|v and gate|up here, separate there): 1e-4 on logits of magnitude ~10 (they are equal bit for bit on this
    machine)."""
    root, _, _, tok = trained
    folder = root / name
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head"]
    assert config["format"] == ("float-quantized" if name == "fp8" else "pack-quantized")
    assert config["config_groups"]["group_0"]["targets"] == ["Linear"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours, _ = load_quantized_model(folder)
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(folder)("Numbers 1234 and code: def f(x)")
                        ["input_ids"]])
    with torch.no_grad():
        expected, got = hf(ids).logits, ours.eval()(ids)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert not torch.equal(got, _dense_logits(trained, ids))  # the quantization did change the model


def _dense_logits(trained, ids):
    from mmtrain.convert.checkpoint_io import read_full_state
    from mmtrain.models.llama.model import GPTModel

    full, cfg, _ = read_full_state(trained[1])
    model = GPTModel(cfg)
    model.load_state_dict(full, strict=False)
    with torch.no_grad():
        return model.eval()(ids)


def test_gptq_is_no_worse_than_round_to_nearest_on_held_out_text(trained):
    """The CPU-sized accuracy table (bench/quant_accuracy.py is the GPU one): held-out loss of the dense model,
    FP8, W4A16 round-to-nearest and W4A16 GPTQ (calibrated on the training text); fixed seeds throughout."""
    root, _, held, _ = trained
    from mmtrain.convert.checkpoint_io import read_full_state
    from mmtrain.models.llama.model import GPTModel

    full, cfg, _ = read_full_state(trained[1])
    dense = GPTModel(cfg)
    dense.load_state_dict(full, strict=False)
    losses = {"dense": _held_out_loss(dense.eval(), held)}
    for name in FOLDERS:
        losses[name] = _held_out_loss(load_quantized_model(root / name)[0].eval(), held)
    assert losses["w4a16_gptq"] <= losses["w4a16_rtn"], losses
    assert abs(math.exp(losses["fp8"]) / math.exp(losses["dense"]) - 1) < 0.01, losses  # the FP8 goal
    assert losses["w4a16_rtn"] > losses["dense"], losses  # 4-bit rounding does cost something


def test_generate_and_evaluate_run_the_quantized_folder(trained, capsys):
    """``mmtrain.generate --ckpt FOLDER`` decodes with the quantized linears: its greedy tokens are transformers'
    greedy tokens on the same folder; ``mmtrain.evaluate`` scores the folder (the loss its own loop gives)."""
    from mmtrain.evaluate import main as evaluate_main
    from mmtrain.generate import main as generate_main

    root, _, held, _ = trained
    folder = root / "w4a16_gptq"
    prompt = "Numbers 1234 and code"
    assert generate_main(["--ckpt", str(folder), "--tokenizer", str(folder), "--prompt", prompt,
                          "--max-new-tokens", "12", "--no-eod-stop", "--device", "cpu"]) == 0
    completion = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completion"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = hf_tok(prompt, return_tensors="pt")["input_ids"]
    out = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert prompt + completion == hf_tok.decode(out[0], skip_special_tokens=True)
    report = root / "eval.json"
    assert evaluate_main(["--ckpt", str(folder), "--data", str(held), "--data-split", "1,0,0", "--split", "train",
                          "--seq-length", str(SEQ), "--device", "cpu", "--output", str(report)]) == 0
    assert 0 < json.loads(report.read_text())["loss"] < 2.0


def test_serve_answers_from_the_quantized_folder(trained):
    """``mmtrain.serve`` builds its engine from the folder as generate does: the served greedy completion is the
    engine's own on the quantized model."""
    from starlette.testclient import TestClient

    from mmtrain.serve import build_server_app

    root, _, _, _ = trained
    folder = root / "fp8"
    app, engine = build_server_app(folder, folder, model_name="q", slots=2, context=64, device="cpu")
    try:
        client = TestClient(app)
        r = client.post("/v1/completions", json={"model": "q", "prompt": "Hello world", "max_tokens": 8,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
        assert type(engine.engine.model.layers["0"].attn.qkv).__name__ == "QuantizedLinear"
    finally:
        engine.close()


def test_quantized_linear_cpu_paths_equal_the_kernels_formulas():
    """FP8: the CPU path is ``_scaled_mm``'s product with row-wise scales (token scales x channel scales).
    INT4: torch's CPU int4 kernel, given the layout the CUDA one gets (unsigned nibbles q + 8, zero 0, scales per
    (group, row)), computes the CPU path's dequantized product."""
    from mmtrain.model.quantized_linear import QuantizedLinear, quantize_tokens_fp8

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g)
    x = torch.randn(5, 256, generator=g)
    scale = w.abs().amax(1, keepdim=True) / 448
    fp8 = QuantizedLinear.from_values("fp8", (w / scale).to(torch.float8_e4m3fn), scale)
    x_q, x_s = quantize_tokens_fp8(x)
    expected = (x_q.float() * x_s) @ (fp8.weight.float() * scale).t()
    torch.testing.assert_close(fp8(x), expected, atol=1e-5, rtol=1e-5)

    values = torch.randint(-8, 8, (48, 256), generator=g, dtype=torch.int8)
    scales = torch.rand(48, 2, generator=g) * 0.1
    int4 = QuantizedLinear.from_values("w4a16", values, scales, group_size=128)
    assert torch.equal(int4.values(), values)
    unsigned = (values.to(torch.int32) + 8)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 2)
    scales_and_zeros = torch.stack([scales, torch.zeros_like(scales)], -1).transpose(0, 1).contiguous()
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 128, scales_and_zeros)
    torch.testing.assert_close(int4(x), kernel, atol=1e-4, rtol=1e-4)


def test_an_earlier_output_stays_until_the_new_one_is_complete(trained, monkeypatch):
    root, ckpt, _, _ = trained
    out = root / "again"
    quantize_checkpoint(ckpt, out, QuantizeSettings("fp8"), log=lambda line: None)
    before = (out / "model.safetensors").read_bytes()
    import mmtrain.quantize.export as export

    def broken(folder, *args, **kwargs):
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")
    monkeypatch.setattr(export, "write_hf_folder", broken)
    with pytest.raises(OSError, match="disk full"):
        quantize_checkpoint(ckpt, out, QuantizeSettings("w4a16"), log=lambda line: None)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".again")) == []
    monkeypatch.undo()
    quantize_checkpoint(ckpt, out, QuantizeSettings("w4a16"), log=lambda line: None)
    assert json.loads((out / "mmtrain-quantization.json").read_text())["scheme"] == "w4a16"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".again")) == []


def _bad_corpus(root):
    (root / "junk.idx").write_bytes(b"not an index")
    (root / "junk.bin").write_bytes(b"\0" * 16)
    return str(root / "junk")


@pytest.mark.parametrize("args, message", [
    (["--scheme", "int3"], "--scheme int3: choose one of fp8, w4a16"),
    (["--scheme", "fp8", "--method", "gptq", "--calib", "{prefix}"], "--method gptq is for --scheme w4a16"),
    (["--scheme", "w4a16", "--method", "gptq"], "--method gptq needs --calib PREFIX"),
    (["--scheme", "w4a16", "--method", "awq"], "--method awq: choose one of rtn, gptq"),
    (["--scheme", "w4a16", "--method", "gptq", "--calib", "nowhere"], "--calib nowhere: not prepared data"),
    (["--scheme", "w4a16", "--method", "gptq", "--calib", "{junk}"], "junk.idx"),
    (["--scheme", "w4a16", "--group-size", "96"], "--group-size 96"),
    (["--scheme", "w4a16", "--group-size", "256"], "is not a multiple of --group-size 256"),
    (["--scheme", "fp8", "--out", "{taken}"], "exists and is not a folder python -m mmtrain.quantize wrote"),
])
def test_bad_input_is_one_line(trained, capsys, args, message):
    root, ckpt, _, _ = trained
    taken = root / "taken"
    taken.mkdir(exist_ok=True)
    (taken / "notes.txt").write_text("mine")
    subs = {"{prefix}": str(root / "train" / "corpus"), "{junk}": _bad_corpus(root), "{taken}": str(taken)}
    argv = ["--ckpt", str(ckpt), "--out", str(root / "bad_out"), *[subs.get(a, a) for a in args]]
    assert quantize_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (root / "bad_out").exists() and (taken / "notes.txt").read_text() == "mine"


def test_a_checkpoint_without_a_tokenizer_or_of_another_family_is_refused(tmp_path, capsys):
    from tests.inference_helpers import tiny_checkpoint, tiny_config
    from mmtrain.config.schema import ModelConfig
    from mmtrain.models.gemma3.config import Gemma3Config

    plain = tiny_checkpoint(tmp_path / "plain", tiny_config(hidden_size=128, ffn_hidden_size=256))
    assert quantize_main(["--ckpt", str(plain), "--scheme", "fp8", "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "names no tokenizer" in err and "pass --tokenizer" in err, err
    from tests.inference_helpers import tiny_tokenizer

    tok = tiny_tokenizer(tmp_path / "tok")
    gemma = tiny_checkpoint(tmp_path / "gemma", ModelConfig(family="gemma3", gemma3=Gemma3Config(vocab_size=512)))
    assert quantize_main(["--ckpt", str(gemma), "--scheme", "fp8", "--tokenizer", str(tok),
                          "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.family=gemma3" in err and "model.family=llama" in err, err


def test_a_folder_of_another_scheme_is_refused_by_generate_in_one_line(trained, tmp_path, capsys):
    import shutil

    from mmtrain.generate import main as generate_main

    root, _, _, _ = trained
    folder = shutil.copytree(root / "w4a16_rtn", tmp_path / "asym")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "mmtrain-checksums.json").unlink()  # edited on purpose
    assert generate_main(["--ckpt", str(folder), "--tokenizer", str(folder), "--prompt", "hi", "--device",
                          "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "weights=" in err and "W4A16" in err, err


@pytest.mark.parametrize("shape", [{"qkv_bias": True}, {"qk_norm": True, "head_dim": 32}, {"tie_embeddings": True}])
def test_qwen2_qwen3_and_tied_shapes_load_in_transformers_with_equal_logits(tmp_path, shape):
    """The other Llama-family shapes the export writes (Qwen2's q/k/v biases stay dense beside the quantized
    weights, Qwen3's q/k norms, a tied output layer: no lm_head tensor), FP8 and W4A16 on a random model."""
    from mmtrain.convert.checkpoint_io import write_weights_checkpoint
    from mmtrain.core.tokenizer import load_tokenizer
    from tests.inference_helpers import tiny_config, tiny_model, tiny_tokenizer

    cfg = tiny_config(hidden_size=128, ffn_hidden_size=256, init_std=0.05, **shape)
    tok = tiny_tokenizer(tmp_path / "tok")
    write_weights_checkpoint(tmp_path / "ckpt", {k: v.clone() for k, v in tiny_model(cfg).state_dict().items()},
                             cfg, extra_meta={"tokenizer": load_tokenizer(tok).describe()})
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7]])
    for scheme in ("fp8", "w4a16"):
        folder = quantize_checkpoint(tmp_path / "ckpt", tmp_path / scheme, QuantizeSettings(scheme),
                                     log=lambda line: None)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            torch.testing.assert_close(load_quantized_model(folder)[0].eval()(ids), hf(ids).logits, atol=1e-4, rtol=0)
