"""A LoRA run's checkpoint is used with its adapters: generate/serve (``load_checkpoint_model``: adapters read
with the base and merged, per TP shard), ``mmtrain.evaluate`` and the lm-eval adapter give the adapted model's
outputs -- the merged HF export's greedy tokens, the unmerged adapted model's losses -- and not the base's."""

from __future__ import annotations

import json

import pytest
import torch

from mmtrain.config import GPTRunConfig, load_config, validate_gpt_config
from mmtrain.convert.checkpoint_io import read_full_state
from mmtrain.inference.engine import DecodeEngine, generate
from mmtrain.inference.loading import load_checkpoint_model
from mmtrain.inference.sampling import SamplingParams
from mmtrain.models.llama.model import GPTModel
from mmtrain.parallel import ParallelDims
from mmtrain.testing import run_distributed
from mmtrain.train.loop import train_gpt

RUN = ["data.mock=true", "data.seq_length=16", "train.precision=fp32", "train.device=cpu", "train.steps=4",
       "train.micro_batch_size=2", "train.global_batch_size=4", "optim.warmup_steps=0", "optim.lr=5e-2",
       "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=96", "model.num_attention_heads=4",
       "model.num_query_groups=2", "model.vocab_size=512", "model.init_std=0.25", "peft.lora.rank=4",
       "peft.lora.alpha=8", "train.eval_every=0", "parallel.tp=2"]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], list(range(40, 57))]
NEW = 32


def _train(rank: int, world_size: int, run_dir: str) -> None:
    cfg = load_config(GPTRunConfig, None, [*RUN, f"logging.run_dir={run_dir}"])
    validate_gpt_config(cfg, world_size)
    train_gpt(cfg, ParallelDims.from_config(cfg.parallel, world_size).build(), torch.device("cpu"))


def _generate(rank: int, world_size: int, ckpt: str) -> list[list[int]]:
    model, _ = load_checkpoint_model(ckpt, ParallelDims(world_size, tp=world_size).build(), "cpu", torch.float32)
    assert not any(".adapter." in n for n in model.state_dict())  # merged: decoded at the base model's cost
    return [s.token_ids for s in generate(DecodeEngine(model, 3, 64), PROMPTS, SamplingParams(max_new_tokens=NEW))]


def _greedy(model, prompt):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(checkpoints root of a TP2 LoRA run, the adapted model unmerged, the base model without the adapters)."""
    root = tmp_path_factory.mktemp("lora_run")
    run_distributed(_train, 2, str(root))
    ckpt = root / "checkpoints"
    full, cfg, meta = read_full_state(ckpt)
    assert meta["config"]["peft"]["lora"]["rank"] == 4 and any(".adapter." in n for n in full)
    lora = load_config(GPTRunConfig, None, RUN).peft.lora
    adapted = GPTModel(cfg, lora=lora)
    adapted.load_state_dict(full, strict=True)
    base = GPTModel(cfg)
    base.load_state_dict({n: t for n, t in full.items() if ".adapter." not in n}, strict=True)
    return ckpt, adapted.eval(), base.eval()


def test_generation_decodes_the_adapted_model_at_tp1_and_tp2(lora_run, tmp_path):
    ckpt, adapted, base = lora_run
    want = [_greedy(adapted, p) for p in PROMPTS]
    assert want != [_greedy(base, p) for p in PROMPTS]  # the adapters change the greedy tokens
    assert run_distributed(_generate, 1, str(ckpt))[0] == want
    two = run_distributed(_generate, 2, str(ckpt))
    assert two[0] == two[1] == want
    transformers = pytest.importorskip("transformers")
    from mmtrain.convert.__main__ import main as convert_main

    assert convert_main(["mmtrain-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    for p, tokens in zip(PROMPTS, want):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assert out[0, len(p):].tolist() == tokens


def test_evaluate_and_lm_eval_score_the_adapted_model(lora_run, tmp_path):
    from mmtrain.evaluate import main as evaluate_main
    from tests.data_helpers import write_text_dataset
    from tests.eval_helpers import plain_loss
    from tests.unit.test_evaluate import _valid_samples

    ckpt, adapted, base = lora_run
    prefix = write_text_dataset(tmp_path / "data", num_docs=30, max_len=30, token_range=(1, 512), max_id=511)
    out = tmp_path / "eval.json"
    assert evaluate_main(["--ckpt", str(ckpt), "--data", str(prefix), "--data-split", "80,20,0", "--seq-length",
                          "16", "--batch-size", "2", "--max-samples", "4", "--output", str(out)]) == 0
    samples, _ = _valid_samples(prefix, 16)
    got = json.loads(out.read_text())["loss"]
    assert got == pytest.approx(plain_loss(adapted, samples, range(4))[0], rel=1e-5)
    assert abs(got - plain_loss(base, samples, range(4))[0]) > 1e-3
    pytest.importorskip("lm_eval")
    from mmtrain.lm_eval_model import load_model

    model, _, _ = load_model(ckpt, torch.device("cpu"), torch.float32)
    ids = torch.tensor([list(range(3, 30))])
    with torch.no_grad():
        # merged W + (alpha/r) B A against the unmerged adapter path: equal up to fp32 rounding of the merge
        torch.testing.assert_close(model(ids), adapted(ids), rtol=1e-4, atol=1e-4)
