"""The family contract (``mmtrain.models.contract``): the shared code builds, compiles, recomputes and shards a
family's stage only through its declared members.

Issue #31: ``train.compile=true`` with the DeepSeek-V3 family crashed in the build (it read ``head_matmul``,
which only the Llama family's model had). The run here goes through the trainer's entry point as
``python -m mmtrain.pretrain_gpt --config configs/gpt/deepseek_v3_tiny_cpu_mock.yaml train.compile=true`` would,
in a fresh process; its compiled blocks use dynamo + AOT autograd (``backend="aot_eager"``, patched in for that
process, as tests/distributed/test_fsdp_compile.py does): Inductor's code generation costs minutes of CPU here
and is not what a family can get wrong (checked by hand: the real CLI run trains).
"""

from __future__ import annotations

import ast
import functools
import json
from pathlib import Path

import pytest
import torch

from mmtrain.models.families import FAMILY_PACKAGES
from mmtrain.testing import run_distributed

REPO = Path(__file__).resolve().parents[2]
DEEPSEEK_RUN = REPO / "configs" / "gpt" / "deepseek_v3_tiny_cpu_mock.yaml"


def _pretrain(rank: int, world_size: int, run_dir: str, overrides: list[str], backend: str | None):
    from torch._dynamo.utils import counters

    from mmtrain.pretrain_gpt import main

    if backend is not None:
        torch.compile = functools.partial(torch.compile, backend=backend)  # this process only
    counters.clear()
    code = main(["--config", str(DEEPSEEK_RUN), "train.steps=2", f"logging.run_dir={run_dir}", *overrides])
    return code, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_deepseek_v3_trains_with_compile(tmp_path):
    code, graphs, breaks = run_distributed(_pretrain, 1, str(tmp_path / "compiled"), ["train.compile=true"],
                                           "aot_eager")[0]
    assert code == 0 and graphs > 0 and breaks == 0  # it trained, through compiled graphs
    assert run_distributed(_pretrain, 1, str(tmp_path / "eager"), [], None)[0][0] == 0
    compiled, eager = _losses(tmp_path / "compiled"), _losses(tmp_path / "eager")
    assert len(compiled) == 2
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------ the contract itself
def _toy_family(stage_class, block_class, build=None):
    import importlib

    from mmtrain.models.families import INLINE_FAMILY
    from mmtrain.models.registry import ModelFamily

    # the inline (Llama) family's record members, as its family.py writes them: only the classes differ
    record = importlib.import_module(f"{FAMILY_PACKAGES[INLINE_FAMILY]}.family").FAMILY
    return ModelFamily(stage_class, (block_class,), record.flops_per_token, record.has_routed_experts,
                       record.architecture, record.hf, record.sharding_spec, build)


def test_registering_a_family_names_the_missing_member():
    from mmtrain.model.layers import TransformerBlock
    from mmtrain.models.contract import FamilyContractError
    from mmtrain.models.llama.model import GPTModel
    from mmtrain.models.registry import FAMILIES, register_family

    class NoHeadSwap(GPTModel):
        swap_head = None  # not callable: as if the family had not written it

    class NoRecompute(TransformerBlock):
        set_recompute = None

    with pytest.raises(FamilyContractError, match=r"^model family 'toy': NoHeadSwap lacks swap_head "
                                                  r"\(mmtrain\.models\.contract\.FamilyStage"):
        register_family("toy", _toy_family(NoHeadSwap, TransformerBlock))
    with pytest.raises(FamilyContractError, match=r"^model family 'toy': NoRecompute lacks set_recompute "
                                                  r"\(mmtrain\.models\.contract\.FamilyBlock"):
        register_family("toy", _toy_family(GPTModel, NoRecompute))
    with pytest.raises(FamilyContractError, match=r"model family 'llama' is registered twice \(the table "):
        register_family("llama", _toy_family(GPTModel, TransformerBlock))
    assert "toy" not in FAMILIES


def test_a_built_stage_is_checked_for_the_contract_attributes():
    from mmtrain.config.schema import ModelConfig
    from mmtrain.model.layers import TransformerBlock
    from mmtrain.models.contract import FamilyContractError
    from mmtrain.models.llama.model import GPTModel
    from mmtrain.models.registry import FAMILIES, register_family

    class Block(TransformerBlock):
        pass

    def without_layers(shape, layer_range, pre_process, post_process, attention, moe_dispatch, lora):
        stage = GPTModel(shape, layer_range, pre_process=pre_process, post_process=post_process)
        del stage.layers
        return stage

    cfg = ModelConfig()
    try:
        register_family("toy_no_layers", _toy_family(GPTModel, TransformerBlock, without_layers))
        register_family("toy_other_block", _toy_family(GPTModel, Block))
        with pytest.raises(FamilyContractError, match=r"'toy_no_layers': the stage GPTModel sets no layers"):
            FAMILIES["toy_no_layers"].build_stage(cfg, (0, 2), True, True)
        with pytest.raises(FamilyContractError, match=r"'toy_other_block': layers\.0 is a TransformerBlock, not "
                                                      r"one of its registered block_classes"):
            FAMILIES["toy_other_block"].build_stage(cfg, (0, 2), True, True)
    finally:
        FAMILIES.pop("toy_no_layers", None)
        FAMILIES.pop("toy_other_block", None)


@pytest.mark.parametrize("family", sorted(FAMILY_PACKAGES))
def test_every_registered_family_keeps_the_contract(family):
    """Each family's default (tiny) shape, through the members the shared code calls: recompute modes give the
    same gradients, bad modes/scopes are one-line errors, the head swap sees the vocabulary size, the layout
    resolves the spec's sequence-parallel entries."""
    from mmtrain.config.schema import ModelConfig
    from mmtrain.models.registry import model_family

    cfg = ModelConfig(family=family)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.shape().vocab_size, (2, 9))

    def grads(mode):
        stage = model_family(cfg).build_stage(cfg, (0, cfg.shape().num_layers), True, True)
        stage.init_weights(1)
        for block in stage.layers.values():
            block.set_recompute(mode)
        stage(tokens[:, :-1], tokens[:, 1:]).sum().backward()
        return stage, {n: p.grad for n, p in stage.named_parameters() if p.grad is not None}

    stage, plain = grads("none")
    for mode in ("selective", "full"):
        for name, g in grads(mode)[1].items():
            torch.testing.assert_close(g, plain[name], rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")
    block = next(iter(stage.layers.values()))
    with pytest.raises(ValueError, match=r"recompute mode 'some'; expected one of none, selective, full"):
        block.set_recompute("some")
    with pytest.raises(ValueError, match=r"compile scope 'all'; expected one of block, inside_call, no_linears"):
        block.compile_parts("all")

    seen = []
    stage.swap_head(lambda head, vocab_size: seen.append(vocab_size) or head)
    assert seen == [cfg.shape().vocab_size]
    partial = [n for n, s in stage.sharding_spec().items() if s.grad_partial_over_tp]
    stage.set_sequence_parallel(True)  # norms and the like: each TP rank sees a slice of the sequence
    assert set(partial) < {n for n, s in stage.sharding_spec().items() if s.grad_partial_over_tp}


def _model_attribute_reads(path: Path) -> list[str]:
    """``hasattr(...)`` anywhere, ``getattr(x, ...)`` where x names a model, stage, block or module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            target = node.args[0]
            if node.func.id == "hasattr" or (isinstance(target, ast.Name) and target.id in _MODEL_NAMES):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


_MODEL_NAMES = {"model", "stage", "chunk", "block", "layer", "module", "lm", "encoder"}


def test_the_build_and_the_parallel_plans_read_no_undeclared_model_attributes():
    """Issue #31: what the build, the TP/SP, PP, FSDP and EP plans and the decoder use of a family is the
    contract's members (``mmtrain.models.contract``), never attributes probed with hasattr/getattr (the decoder
    picked the family by ``hasattr(attn, "kv_down")``)."""
    files = [REPO / "mmtrain/train/build.py", REPO / "mmtrain/train/build_vlm.py",
             REPO / "mmtrain/train/fsdp_setup.py", *sorted((REPO / "mmtrain/parallel").glob("*.py")),
             *sorted((REPO / "mmtrain/inference").glob("*.py"))]
    found = [f for path in files for f in _model_attribute_reads(path)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("family", sorted(FAMILY_PACKAGES))
def test_every_registered_family_decodes_through_its_own_modules(family):
    """The contract's ``decode``: a prompt's prefill, then one token at a time through the cache, gives the logits
    of the family's uncached forward; a pipeline stage is refused in one line."""
    from mmtrain.config.schema import ModelConfig
    from mmtrain.inference.decoder import UnsupportedModelError, check_decodable, decoder_forward, kv_cache_for
    from mmtrain.models.registry import model_family

    cfg = ModelConfig(family=family)
    n = cfg.shape().num_layers
    model = model_family(cfg).build_stage(cfg, (0, n), True, True).eval()
    model.init_weights(2)
    tokens = torch.randint(0, cfg.shape().vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)  # (B, S, V) logits
        cache = kv_cache_for(model, 2, 16, torch.float32, "cpu")
        got = [decoder_forward(model, cache, torch.arange(4).expand(2, 4), tokens_BS=tokens[:, :4])]
        for p in range(4, 7):
            got.append(decoder_forward(model, cache, torch.full((2, 1), p), tokens_BS=tokens[:, p:p + 1]))
    torch.testing.assert_close(torch.stack(got, 1), full[:, 3:], rtol=1e-4, atol=1e-5)
    stage = model_family(cfg).build_stage(cfg, (0, n), True, False)
    with pytest.raises(UnsupportedModelError, match=r"needs a whole model .*no pipeline stages"):
        check_decodable(stage)


def test_a_family_of_the_table_without_its_record_is_one_line(tmp_path, monkeypatch):
    """The registry loads ``<package>.family``'s ``FAMILY`` when the family is first used: a package without the
    module, or a module whose FAMILY is no ModelFamily, is one line naming the family."""
    from mmtrain.models.contract import FamilyContractError
    from mmtrain.models.registry import FAMILIES, family_named

    package = tmp_path / "fake_record_family"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "family.py").write_text("FAMILY = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(FAMILY_PACKAGES, "fake", "fake_record_family")
    with pytest.raises(FamilyContractError, match=r"^model family 'fake': FAMILY is a NoneType, not a "
                                                  r"mmtrain\.models\.family_record\.ModelFamily$"):
        family_named("fake")
    monkeypatch.setitem(FAMILY_PACKAGES, "fake", "fake_record_family.nested")
    with pytest.raises(FamilyContractError, match=r"^model family 'fake': no module "
                                                  r"fake_record_family\.nested\.family "):
        family_named("fake")
    assert "fake" not in FAMILIES
