"""Knowledge distillation: the loss and its gradients equal a hand computation (full vocabulary and top-k, at a
temperature), through the student's wrapped head and through two models of different shapes; config checks;
a bad teacher is one line through the CLI's error path. The training runs (TP2 / PP2 equal one process, a student
ends closer to its teacher than on hard labels alone) are in tests/distributed/test_distill_runs.py and
tests/unit/test_distill_training.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from mmtrain.config import ConfigError, GPTRunConfig, load_config
from mmtrain.config.schema import ModelConfig
from mmtrain.config.validate import validate_gpt_config
from mmtrain.convert.checkpoint_io import write_weights_checkpoint
from mmtrain.model.head import LossHead
from mmtrain.models.llama.model import GPTModel
from mmtrain.pretrain_gpt import main as pretrain_main
from mmtrain.train.distill_loss import DistillHead, KDSettings, TeacherHead
from tests.data_helpers import write_text_dataset

V = 11


def _hand_losses(student, teacher, labels, T, alpha, top_k):
    """The loss per token written out, in fp64, one token at a time."""
    out = []
    for s, t, y in zip(student.double().reshape(-1, V), teacher.double().reshape(-1, V), labels.reshape(-1)):
        keep = sorted(range(V), key=lambda v: -float(t[v]))[:top_k] if top_k else list(range(V))
        z_t = sum(math.exp(float(t[v]) / T) for v in keep)
        log_q = torch.log_softmax(s / T, dim=0)  # the student's softmax over the whole vocabulary
        kl = sum(math.exp(float(t[v]) / T) / z_t * (float(t[v]) / T - math.log(z_t) - log_q[v]) for v in keep)
        ce = -torch.log_softmax(s, dim=0)[y]
        out.append(alpha * T * T * kl + (1 - alpha) * ce)
    return torch.stack(out).view(labels.shape)


@pytest.mark.parametrize("top_k", [0, 3])
@pytest.mark.parametrize("T, alpha", [(1.0, 1.0), (2.0, 0.3)])
def test_head_loss_and_gradients_equal_the_hand_computation(top_k, T, alpha):
    g = torch.Generator().manual_seed(0)
    student = (2 * torch.randn(2, 3, V, generator=g)).requires_grad_()
    teacher = 2 * torch.randn(2, 3, V, generator=g)
    labels = torch.randint(0, V, (2, 3), generator=g)
    head = DistillHead(LossHead(), KDSettings(T, alpha, top_k))
    with head.teaching(teacher):
        ours = head.loss(student, labels)
    assert head.loss(student, labels).allclose(F.cross_entropy(student.flatten(0, 1), labels.flatten(),
                                                               reduction="none").view(2, 3))  # outside: plain CE
    weights = torch.rand(2, 3, generator=g)  # a loss mask's weights: gradients of every token count
    (ours * weights).sum().backward()
    mine = student.grad.clone()
    student.grad = None
    hand = _hand_losses(student, teacher, labels, T, alpha, top_k)
    (hand * weights.double()).sum().backward()
    torch.testing.assert_close(ours.double(), hand.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine.double(), student.grad.double(), rtol=1e-4, atol=1e-6)
    ce, kl = head.parts
    assert (kl >= -1e-6).all() and ce.shape == kl.shape == (2, 3)


def test_top_k_of_the_whole_vocabulary_is_the_full_kl():
    g = torch.Generator().manual_seed(1)
    student, teacher, labels = torch.randn(1, 4, V, generator=g), torch.randn(1, 4, V, generator=g), torch.zeros(1, 4).long()
    losses = []
    for k in (0, V, V + 5):
        head = DistillHead(LossHead(), KDSettings(1.5, 1.0, k))
        with head.teaching(teacher):
            losses.append(head.loss(student, labels))
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close(losses[2], losses[0])


def test_models_of_two_shapes_through_their_heads():
    """A 1-layer student against a 3-layer teacher of another width: the family's forward computes the loss the
    hand computation gives from the two models' full logits."""
    student_cfg = ModelConfig(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2, vocab_size=V,
                              init_std=0.5)
    teacher_cfg = ModelConfig(num_layers=3, hidden_size=24, ffn_hidden_size=40, num_attention_heads=4,
                              num_query_groups=2, vocab_size=V, init_std=0.5)
    student, teacher = GPTModel(student_cfg), GPTModel(teacher_cfg)
    student.init_weights(1)
    teacher.init_weights(2)
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        full_student, full_teacher = student(inputs), teacher(inputs)
    teacher.swap_head(lambda head, vocab: TeacherHead(head))
    student.swap_head(lambda head, vocab: DistillHead(head, KDSettings(2.0, 0.6, 4)))
    with torch.no_grad():
        teacher_logits = teacher(inputs)
    torch.testing.assert_close(teacher_logits, full_teacher)
    with student.head.teaching(teacher_logits):
        ours = student(inputs, labels)
    torch.testing.assert_close(ours.double(), _hand_losses(full_student, full_teacher, labels, 2.0, 0.6, 4),
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- configuration
def _overrides(*extra):
    return ["data.mock=true", "model.vocab_size=64", "model.num_layers=2", "model.hidden_size=32",
            "model.ffn_hidden_size=64", "model.num_attention_heads=4", "train.precision=fp32", "train.device=cpu",
            *extra]


def test_config_checks():
    def refused(*extra):
        with pytest.raises(ConfigError) as err:
            validate_gpt_config(load_config(GPTRunConfig, None, _overrides(*extra)))
        return str(err.value)

    assert "needs distill.teacher" in refused("train.objective=distill")
    assert "train.objective=lm" in refused("distill.teacher=t")
    assert "fp8" in refused("train.objective=distill", "distill.teacher=t", "train.precision=fp8",
                            "train.device=cuda")
    assert "distill.alpha" in refused("train.objective=distill", "distill.teacher=t", "distill.alpha=0")
    assert "distill.temperature" in refused("train.objective=distill", "distill.teacher=t", "distill.temperature=0")
    assert "data.type=preference" in refused("train.objective=distill", "distill.teacher=t", "data.type=preference",
                                             "data.mock=false", "data.prefixes=[p]")


# ---------------------------------------------------------------------------- bad teachers through the CLI
TOK_A = {"type": "sentencepiece", "path": "/nowhere/a.model", "sha256": "tok-a", "vocab_size": 64, "max_id": 63,
         "eod_id": 0}


def _teacher(root, vocab=64, tokenizer=TOK_A):
    cfg = ModelConfig(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2, vocab_size=vocab)
    model = GPTModel(cfg)
    model.init_weights(0)
    extra = {"tokenizer": tokenizer} if tokenizer is not None else None
    write_weights_checkpoint(root, {k: v.detach().clone() for k, v in model.state_dict().items()}, cfg,
                             extra_meta=extra)
    return root


@pytest.fixture(scope="module")
def student_data(tmp_path_factory):
    # the manifest names tokenizer "tok-a" (sha256), as mmtrain-prep writes it
    return write_text_dataset(tmp_path_factory.mktemp("data") / "web", num_docs=40, max_len=30, token_range=(1, 64),
                              tokenizer_sha="tok-a", max_id=63)


def _cli(tmp_path, data, teacher, capsys, before_start: bool = True):
    code = pretrain_main(_overrides("data.mock=false", f"data.prefixes=[{data}]", "data.seq_length=16",
                                    "train.objective=distill", f"distill.teacher={teacher}", "train.steps=1",
                                    f"logging.run_dir={tmp_path / 'run'}"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"distill.teacher={teacher}" in err and "Traceback" not in err
    assert (tmp_path / "run").exists() != before_start  # refused before anything was made (or when loading)
    return err


def test_missing_teacher_is_one_line(tmp_path, student_data, capsys):
    err = _cli(tmp_path, student_data, tmp_path / "nothing", capsys)
    assert "no such checkpoint" in err


def test_teacher_with_another_tokenizer_is_one_line(tmp_path, student_data, capsys):
    other = {**TOK_A, "path": "/nowhere/b.model", "sha256": "tok-b"}
    err = _cli(tmp_path, student_data, _teacher(tmp_path / "t", tokenizer=other), capsys)
    assert "another tokenizer" in err and "tok-b" in err and "tok-a" in err


def test_teacher_with_another_vocabulary_is_one_line(tmp_path, student_data, capsys):
    err = _cli(tmp_path, student_data, _teacher(tmp_path / "t", vocab=128), capsys)
    assert "vocabulary of 128 ids" in err and "64" in err


def test_teacher_naming_no_tokenizer_is_one_line(tmp_path, student_data, capsys):
    err = _cli(tmp_path, student_data, _teacher(tmp_path / "t", tokenizer=None), capsys)
    assert "names no tokenizer" in err


def test_broken_or_foreign_teacher_folders_are_one_line(tmp_path, student_data, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert "hf-to-mmtrain" in _cli(tmp_path, student_data, hf, capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "not a complete mmtrain checkpoint" in _cli(tmp_path, student_data, empty, capsys)
    teacher = _teacher(tmp_path / "t")
    step = next(teacher.glob("step_*"))
    meta = json.loads((step / "complete.json").read_text())
    meta["step"] = 7  # an edit its seal catches
    (step / "complete.json").write_text(json.dumps(meta))
    assert "complete.json" in _cli(tmp_path, student_data, teacher, capsys)
    damaged = _teacher(tmp_path / "t2")
    data_file = next(next(damaged.glob("step_*")).glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:-8] + b"\0" * 8)  # its bytes, not its size: read when loading
    assert "does not match its checksum" in _cli(tmp_path, student_data, damaged, capsys, before_start=False)


def test_the_same_tokenizer_passes_the_checks(tmp_path, student_data):
    from mmtrain.train.distill_teacher import check_teacher

    cfg = load_config(GPTRunConfig, None, _overrides("data.mock=false", f"data.prefixes=[{student_data}]",
                                                     "train.objective=distill",
                                                     f"distill.teacher={_teacher(tmp_path / 't')}"))
    validate_gpt_config(cfg)
    assert check_teacher(cfg).model.num_layers == 1


# ------------------------------------------------------------------- the step: masks, the frozen teacher
@pytest.fixture
def one_process():
    from mmtrain.parallel import ParallelDims, init_distributed, shutdown_distributed

    init_distributed()
    try:
        yield ParallelDims(1).build()
    finally:
        shutdown_distributed()


def _hand_sums(student, teacher, micro, T):
    """[KL sum, CE sum, tokens] over the loss-mask tokens, from both models' full logits in fp64."""
    inputs, labels = micro.tokens[:, :-1], micro.tokens[:, 1:]
    with torch.no_grad():
        s = student(inputs, None, micro.position_ids, micro.document_ids).double()
        t = teacher(inputs, None, micro.position_ids, micro.document_ids).double()
    p = torch.softmax(t / T, -1)
    kl = (p * (torch.log_softmax(t / T, -1) - torch.log_softmax(s / T, -1))).sum(-1)
    ce = F.cross_entropy(s.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    mask = micro.loss_mask.double()
    return torch.stack([(kl * mask).sum(), (ce * mask).sum(), mask.sum()])


@pytest.mark.parametrize("data", ["packed documents", "sft"])
def test_the_kl_counts_only_where_the_cross_entropy_counts(data, one_process, tmp_path):
    from mmtrain.data.documents import DocumentRule
    from mmtrain.data.sft_dataset import SFTSamples, sft_micro_batch
    from mmtrain.train.distill import kd_settings, run_distill_micro_batches, student_head
    from mmtrain.train.loop import schedule_micro_batches
    from tests.sft_helpers import VOCAB, build_chat_tokenizer, toy_conversations, write_sft_dataset

    g = torch.Generator().manual_seed(5)
    if data == "sft":  # the loss on the assistant turns only, conversations packed with their own positions
        prefix = write_sft_dataset(tmp_path, build_chat_tokenizer(tmp_path / "tok"), toy_conversations(6))
        samples = SFTSamples(str(prefix), 96, seed=0, num_samples=2)
        raw = torch.stack([torch.as_tensor(samples[i]) for i in range(2)]).long()
        micro, vocab = sft_micro_batch(raw), VOCAB + 40
    else:  # end-of-document tokens (id 0) every few tokens: positions restart, no loss on predicting across
        tokens = torch.randint(1, 40, (2, 33), generator=g)
        tokens[:, ::7] = 0
        micro, vocab = DocumentRule(0, True, True, True).apply(tokens), 40
        raw = micro  # as the loop's loader hands packed documents
    cfg = load_config(GPTRunConfig, None, _overrides(f"model.vocab_size={vocab}", "train.objective=distill",
                                                     "distill.teacher=t", "distill.temperature=1.5",
                                                     "distill.alpha=0.25"))
    student = GPTModel(cfg.model)
    teacher = GPTModel(ModelConfig(num_layers=2, hidden_size=48, ffn_hidden_size=64, num_attention_heads=4,
                                   vocab_size=vocab, init_std=0.4))
    student.init_weights(1)
    teacher.init_weights(2)
    expected = _hand_sums(student, teacher, micro, 1.5)
    assert 0 < expected[2] < micro.loss_mask.numel()  # some tokens carry no loss
    teacher.swap_head(lambda head, v: TeacherHead(head))
    head = student_head(student, kd_settings(cfg, one_process))
    stats = run_distill_micro_batches(student, teacher, head, [raw], one_process, cfg, torch.device("cpu"), None,
                                      schedule_micro_batches)
    objective, tokens, ce, kl = stats.tolist()
    torch.testing.assert_close(torch.tensor([kl, ce, tokens], dtype=torch.float64), expected, rtol=1e-5, atol=1e-5)
    assert objective == pytest.approx(0.25 * 1.5 ** 2 * kl + 0.75 * ce, rel=1e-5)


def _teacher_run(teacher_ckpt, *extra):
    return load_config(GPTRunConfig, None, _overrides("train.objective=distill", f"distill.teacher={teacher_ckpt}",
                                                      *extra))


def test_the_teacher_is_frozen_in_the_runs_weight_dtype(one_process, tmp_path):
    from mmtrain.train.distill_teacher import build_teacher, read_teacher

    cfg = _teacher_run(_teacher(tmp_path / "t"), "train.precision=bf16")
    teacher = build_teacher(cfg, read_teacher(cfg), one_process, torch.device("cpu"), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in teacher.parameters())
    assert all(b.dtype == torch.float32 for b in teacher.buffers())  # the RoPE frequencies keep theirs
    assert not teacher.training and isinstance(teacher.head, TeacherHead)


def test_a_lora_runs_checkpoint_teaches_with_its_adapters_merged(one_process, tmp_path):
    """The teacher of a LoRA run's checkpoint computes what generation and evaluation load from it."""
    from mmtrain.inference.loading import load_checkpoint_model
    from mmtrain.train.distill_teacher import build_teacher, read_teacher
    from mmtrain.train.loop import train_gpt

    lora_run = load_config(GPTRunConfig, None, _overrides("train.steps=2", "optim.lr=5e-2", "optim.warmup_steps=0",
                                                          "peft.lora.rank=4", f"logging.run_dir={tmp_path / 'lora'}"))
    train_gpt(lora_run, one_process, torch.device("cpu"))
    ckpt = tmp_path / "lora" / "checkpoints"
    cfg = _teacher_run(ckpt)
    teacher = build_teacher(cfg, read_teacher(cfg), one_process, torch.device("cpu"), torch.float32)
    merged, _ = load_checkpoint_model(ckpt, one_process, "cpu", torch.float32)
    base = GPTModel(lora_run.model)
    base.init_weights(lora_run.train.seed)  # the run's base weights: the adapters moved the model away from them
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs, plain = teacher(tokens), merged(tokens), base(tokens)
    torch.testing.assert_close(ours, theirs)
    assert not torch.allclose(ours, plain, atol=1e-4)


def test_a_distillation_run_resumes_as_if_never_stopped(one_process, tmp_path):
    """The student's checkpoints are a plain run's (the wrapped head holds no state); the teacher is built again."""
    from mmtrain.train.loop import train_gpt

    teacher = _teacher(tmp_path / "t")
    common = _overrides("train.objective=distill", f"distill.teacher={teacher}", "train.steps=4",
                        "optim.warmup_steps=0", "optim.lr=1e-2", "data.seq_length=16")

    def run(name, *extra):
        cfg = load_config(GPTRunConfig, None, common + [f"logging.run_dir={tmp_path / name}", *extra])
        return train_gpt(cfg, one_process, torch.device("cpu")).losses

    whole = run("whole")
    assert run("cut", "train.exit_at_step=2") + run("cut") == pytest.approx(whole, rel=1e-6)
