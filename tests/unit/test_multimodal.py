"""Multimodal loading with the real megatron-energon on shards written by `mmtrain-prep media`: shapes, captions
back from tokens, cooked audio/video, exact resume, determinism, blend weights, packing."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.energon")
pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument:UserWarning",
                                        "ignore:Video container unit is seconds:RuntimeWarning")

from dataprep.cli import main as prep  # noqa: E402
from dataprep.samples_media import write_media_samples  # noqa: E402
from mmtrain.data.blend_spec import BlendSpecError  # noqa: E402
from mmtrain.data.multimodal import IGNORE_INDEX, MultimodalSettings  # noqa: E402
from mmtrain.data.multimodal_loader import LoaderOptions, MultimodalLoader, energon_source  # noqa: E402

VOCAB = 300
IMAGE_ID, AUDIO_ID = VOCAB, VOCAB + 1  # ids the tokenizer never produces


def _write_captions(rows, path: Path, prefix: str) -> None:
    with open(path, "w") as f:
        for row in rows:
            if "image" in row and "caption" in row:
                f.write(json.dumps({**row, "id": prefix + row["id"]}) + "\n")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("mm")
    manifest = write_media_samples(root / "in", num_images=24, num_audio=4, video=True)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    _write_captions(rows, root / "in" / "a.jsonl", "a-")
    _write_captions(rows, root / "in" / "b.jsonl", "b-")
    common = ["--no-progress", "--val-ratio", "0", "--workers", "1"]
    assert prep(["media", "--input", str(manifest), "--output", str(root / "mixed"), "--video-frames", "3",
                 *common]) == 0
    assert prep(["media", "--input", str(root / "in" / "a.jsonl"), "--output", str(root / "a"), "--shard-size", "20KB",
                 *common]) == 0
    assert prep(["media", "--input", str(root / "in" / "b.jsonl"), "--output", str(root / "b"), *common]) == 0
    texts = [r.get("caption") or r.get("text") or r["conversation"][-1]["content"] for r in rows]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts * 4), model_prefix=str(root / "sp"), vocab_size=VOCAB, model_type="bpe",
        byte_fallback=True, hard_vocab_limit=False, minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1)
    captions = {r["id"]: r.get("caption") for r in rows}
    return {"root": root, "captions": captions, "tokenizer": str(root / "sp.model")}


def settings(data, **kw) -> MultimodalSettings:
    base = dict(tokenizer=data["tokenizer"], seq_length=96, image_token_id=IMAGE_ID, num_image_tokens=8,
                image_size=32, audio_token_id=AUDIO_ID, num_audio_tokens=4, video_frames=4)
    return MultimodalSettings(**{**base, **kw})


def opts(**kw) -> LoaderOptions:
    """Loader options for these tiny sets: 4 slices (the default 16 would spend the tests' time filling buffers)."""
    return LoaderOptions(**{"num_slices": 4, **kw})


def mesh(rank: int, size: int):
    return SimpleNamespace(coord=SimpleNamespace(dp=rank), dims=SimpleNamespace(dp=size), dp_group=None)


def take(loader, n):
    return [next(loader) for _ in range(n)]


def same(a, b) -> bool:
    return a.__key__ == b.__key__ and all(torch.equal(getattr(a, f), getattr(b, f)) for f in (
        "tokens", "labels", "position_ids", "document_ids", "images", "frame_index", "audio"))


def test_batches_have_fixed_shapes_and_captions_decode_back(data):
    from mmtrain.core.tokenizer import load_tokenizer

    tok = load_tokenizer(data["tokenizer"])
    loader = MultimodalLoader(data["root"] / "a", settings(data), opts(micro_batch_size=3))
    for batch in take(loader, 4):
        assert batch.tokens.shape == batch.labels.shape == batch.position_ids.shape == (3, 96)
        assert batch.images.shape == (3, 3, 32, 32) and batch.images.dtype == torch.float32
        assert batch.image_counts.tolist() == [1, 1, 1]
        assert -1.01 <= float(batch.images.min()) and float(batch.images.max()) <= 1.01  # (x - 0.5) / 0.5
        for row, key in enumerate(batch.__key__):
            tokens, labels = batch.tokens[row], batch.labels[row]
            assert tokens[:8].tolist() == [IMAGE_ID] * 8 and IMAGE_ID not in tokens[8:].tolist()
            assert (labels[:7] == IGNORE_INDEX).all()  # targets inside the image placeholders are masked
            target = labels[labels != IGNORE_INDEX].tolist()
            assert target[-1] == tok.eod_id
            assert tok.decode(target[:-1]) == data["captions"][key.removeprefix("a-")]
            assert torch.equal(batch.loss_mask[row], (labels != IGNORE_INDEX).float())


def test_crude_audio_and_video_are_cooked(data):
    loader = MultimodalLoader(data["root"] / "mixed", settings(data), opts(micro_batch_size=4, shuffle_buffer_size=0,
                                                                           num_slices=1))
    seen, frames = {}, {}
    for batch in take(loader, 8):  # 29 samples in order: one pass
        audio_at, image_at = 0, 0
        for row, key in enumerate(batch.__key__):
            n_img, n_audio = int(batch.image_counts[row]), int(batch.audio_counts[row])
            assert batch.tokens[row].tolist().count(IMAGE_ID) == 8 * n_img
            assert batch.tokens[row].tolist().count(AUDIO_ID) == 4 * n_audio
            seen[key] = (n_img, n_audio, batch.audio_lengths[audio_at:audio_at + n_audio].tolist())
            frames[key] = batch.frame_index[image_at:image_at + n_img].tolist()
            audio_at, image_at = audio_at + n_audio, image_at + n_img
        assert batch.images.shape[0] == image_at and batch.audio.shape[0] == audio_at
        assert batch.frame_index.shape == (image_at,) and batch.frame_index.dtype == torch.int64
    assert seen["slide-000"][:2] == (3, 0)  # the 3 frames prep stored
    assert frames["slide-000"] == [0, 1, 2] and frames["img-00000"] == [0]  # temporal rows: frames count up
    for key in ("clip-000", "clip-001", "clip-002", "clip-003"):  # wav, flac, mp3, ogg (PyAV fallback)
        n_img, n_audio, lengths = seen[key]
        assert (n_img, n_audio) == (0, 1) and lengths[0] > 0.45 * 16000, key
    assert seen["img-00023"] == (1, 0, [])  # a conversation row


def test_conversation_prompt_is_masked(data):
    from mmtrain.core.tokenizer import load_tokenizer

    tok = load_tokenizer(data["tokenizer"])
    loader = MultimodalLoader(data["root"] / "mixed", settings(data), opts(micro_batch_size=1, shuffle_buffer_size=0,
                                                                           num_slices=1))
    for batch in take(loader, 29):
        if batch.__key__[0] == "img-00023":
            break
    labels = batch.labels[0]
    target = labels[labels != IGNORE_INDEX].tolist()
    answer = tok.decode(target[:-1])
    assert "What is in the picture" not in answer and answer.startswith("A ") and answer.endswith(".")


@pytest.mark.parametrize("pack", [False, True])
def test_resume_mid_epoch_continues_identically(data, pack):
    options = opts(micro_batch_size=2, packing_buffer_size=8)
    first = MultimodalLoader(data["root"] / "a", settings(data, pack=pack), options)
    take(first, 3)
    state = first.state_dict()
    expected = take(first, 5)
    resumed = MultimodalLoader(data["root"] / "a", settings(data, pack=pack), options)
    resumed.load_state_dict(state)
    got = take(resumed, 5)
    assert all(same(a, b) for a, b in zip(expected, got))
    assert resumed.batches_yielded == 8


def test_same_batches_across_runs(data):
    runs = [take(MultimodalLoader(data["root"] / "mixed", settings(data, pack=True), opts()), 4)
            for _ in range(2)]
    assert all(same(a, b) for a, b in zip(*runs))


def test_blend_spec_weights_are_respected(data, tmp_path):
    spec = tmp_path / "blend.yaml"
    spec.write_text(f"train:\n  - {{path: {data['root'] / 'a'}, weight: 0.8, type: energon}}\n"
                    f"  - {{path: {data['root'] / 'b'}, weight: 0.2, type: energon}}\n")
    loader = MultimodalLoader(spec, settings(data), opts(micro_batch_size=20))
    counts = Counter(key[0] for batch in take(loader, 20) for key in batch.__key__)
    share = counts["a"] / (counts["a"] + counts["b"])
    assert abs(share - 0.8) < 0.07, counts  # 400 draws: standard deviation 0.02


def test_energon_metadataset_yaml_is_accepted(data, tmp_path):
    mds = tmp_path / "mds.yaml"
    mds.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
                   f"      - {{path: {data['root'] / 'a'}, weight: 1}}\n"
                   f"      - {{path: {data['root'] / 'b'}, weight: 1}}\n")
    assert energon_source(mds) == str(mds.resolve())
    keys = {k[0] for batch in take(MultimodalLoader(mds, settings(data), opts(micro_batch_size=8)), 5)
            for k in batch.__key__}
    assert keys == {"a", "b"}


def test_packing_keeps_images_whole_and_within_budget(data):
    loader = MultimodalLoader(data["root"] / "mixed", settings(data, pack=True, seq_length=128),
                              opts(micro_batch_size=2, packing_buffer_size=16))
    packed_rows = 0
    for batch in take(loader, 10):
        image_at = 0
        for row in range(2):
            docs = batch.document_ids[row]
            used = int((docs >= 0).sum())
            assert used <= 128 and (docs[used:] == -1).all() and (batch.labels[row][used:] == IGNORE_INDEX).all()
            ids = docs[:used]
            assert (ids[1:] - ids[:-1] >= 0).all() and (ids[1:] - ids[:-1] <= 1).all()  # contiguous documents
            n_docs = int(ids.max()) + 1
            packed_rows += n_docs > 1
            for d in range(n_docs):
                where = (ids == d).nonzero().view(-1)
                assert batch.position_ids[row][where].tolist() == list(range(len(where)))
                doc_tokens = batch.tokens[row][where].tolist()
                n_img = doc_tokens.count(IMAGE_ID)
                assert n_img % 8 == 0 and doc_tokens[:n_img] == [IMAGE_ID] * n_img  # whole runs, at the start
                # frame indices stay with their images: a still is [0], the video's 3 frames [0, 1, 2]
                assert batch.frame_index[image_at:image_at + n_img // 8].tolist() == list(range(n_img // 8))
                image_at += n_img // 8
            assert int(batch.image_counts[row]) * 8 == batch.tokens[row][:used].tolist().count(IMAGE_ID)
        assert batch.images.shape[0] == batch.frame_index.shape[0] == image_at
    assert packed_rows > 5


def test_bad_sources_name_the_problem(data, tmp_path):
    with pytest.raises(BlendSpecError, match="no .nv-meta"):
        energon_source(tmp_path)
    (tmp_path / "text.bin").write_bytes(b"")
    (tmp_path / "text.idx").write_bytes(b"")
    spec = tmp_path / "blend.yaml"
    spec.write_text("train:\n  - {path: text, weight: 1}\n"
                    f"  - {{path: {data['root'] / 'a'}, weight: 1, type: energon}}\n")
    with pytest.raises(BlendSpecError, match="indexed text dataset"):
        energon_source(spec)
    with pytest.raises(ValueError, match="leaves no room"):
        settings(data, num_image_tokens=96)


def test_resume_with_worker_processes(data):
    """Each worker sends its slice's state with every batch, so the state is exact however far workers read ahead."""
    options = opts(micro_batch_size=2, num_workers=2)
    first = MultimodalLoader(data["root"] / "a", settings(data, pack=True), options)
    take(first, 3)
    state = first.state_dict()
    expected = take(first, 4)
    first.close()
    resumed = MultimodalLoader(data["root"] / "a", settings(data, pack=True), opts(micro_batch_size=2))
    resumed.load_state_dict(json.loads(json.dumps(state)))  # the state is plain JSON-compatible data
    assert all(same(a, b) for a, b in zip(expected, take(resumed, 4)))


def test_loader_from_run_config(data):
    """The loader from a VLM run's sections: media settings from media:, placeholders from the model."""
    from mmtrain.config import load_config
    from mmtrain.config.vlm_run_schema import VLMRunConfig
    from mmtrain.data.multimodal_loader import build_multimodal_loader

    cfg = load_config(VLMRunConfig, None, [
        f"data.blend={data['root'] / 'a'}", f"media.tokenizer={data['tokenizer']}", f"model.image_token_id={IMAGE_ID}",
        "model.vision.image_size=32", "model.vision.patch_size=8", "model.projector.pixel_shuffle=1",
        "data.seq_length=128", "media.pack=true", "media.slices=4"])
    assert cfg.model.tokens_per_image == 16
    batch = next(build_multimodal_loader(cfg.data, cfg.media, cfg.model, micro_batch_size=2))
    assert batch.tokens.shape == (2, 128) and batch.images.shape[1:] == (3, 32, 32)
    assert int(batch.document_ids.max()) >= 1  # packed
    assert int((batch.tokens == IMAGE_ID).sum()) == 16 * batch.images.shape[0]  # the model's tokens per image


def test_data_parallel_ranks_read_disjoint_samples(data):
    options = opts(micro_batch_size=2, shuffle_buffer_size=0, num_slices=2)
    keys = [{k for batch in take(MultimodalLoader(data["root"] / "a", settings(data), options, mesh=mesh(r, 2)), 5)
             for k in batch.__key__} for r in (0, 1)]
    assert len(keys[0]) == len(keys[1]) == 10 and not keys[0] & keys[1]


def _global_order(data, n, **kw):
    """The first ``n`` global micro-batches: one rank, no workers."""
    return take(MultimodalLoader(data["root"] / "a", settings(data, pack=True), opts(**kw)), n)


def _dp_steps(data, state, dp, steps, workers=0):
    """``steps`` micro-batches on each of ``dp`` ranks from ``state``, in global order; and the merged state after."""
    from mmtrain.data.multimodal_loader import merge_loader_states

    ranks = [MultimodalLoader(data["root"] / "a", settings(data, pack=True), opts(num_workers=workers),
                              mesh=mesh(r, dp)) for r in range(dp)]
    for r in ranks:
        if state is not None:
            r.load_state_dict(state)
    got = [next(r) for _ in range(steps) for r in ranks]  # one micro-batch per rank: consecutive global ones
    state = json.loads(json.dumps(merge_loader_states([r.state_dict() for r in ranks])))  # plain data
    for r in ranks:
        r.close()
    return got, state


def test_resume_at_another_data_parallel_size_continues_the_global_order(data):
    """dp 2 -> 1 (one worker) -> 2: the union of the ranks' batches is the single-rank order, batch for batch."""
    reference = _global_order(data, 18)
    first, state = _dp_steps(data, None, 2, 3)
    second, state = _dp_steps(data, state, 1, 6, workers=1)
    third, state = _dp_steps(data, state, 2, 3)
    assert state["consumed_micro_batches"] == 18
    assert all(same(a, b) for a, b in zip(reference, first + second + third, strict=True))


def test_loader_state_errors_name_the_fix(data):
    src, s = data["root"] / "a", settings(data)
    ranks = [MultimodalLoader(src, s, opts(), mesh=mesh(r, 2)) for r in range(2)]
    for _ in range(2):
        for r in ranks:
            next(r)
    one_rank = ranks[0].state_dict()
    assert set(one_rank["slices"]) == {"0", "2"}  # rank 0 of 2 reads slices 0 and 2 of 4
    single = MultimodalLoader(src, s, opts())
    with pytest.raises(ValueError, match="global_state_dict"):
        single.load_state_dict(one_rank)
    with pytest.raises(ValueError, match="train.micro_batch_size = 2"):
        MultimodalLoader(src, s, opts(micro_batch_size=3)).load_state_dict(one_rank)
    with pytest.raises(ValueError, match="version 1"):
        single.load_state_dict({"version": 1, "energon": None})
    with pytest.raises(ValueError, match=r"media.slices \(4\) must be a positive multiple of the data-parallel size "
                                         r"\(3\)"):
        MultimodalLoader(src, s, opts(), mesh=mesh(0, 3))
    with pytest.raises(ValueError, match="too few samples for 64 slices"):
        MultimodalLoader(src, s, opts(num_slices=64))


def test_list_images_and_undecoded_video(data, tmp_path):
    """An ``images`` row (img000, img001 parts) and a video without stored frames (decoded, 4 of 16 frames)."""
    src = data["root"] / "in"
    rows = [{"id": "pair", "images": ["images/img-00000.jpg", "images/img-00001.png"], "caption": "Two shapes."},
            {"id": "slide", "video": "video/slide-000.mp4", "caption": "A red square slides."}]
    (src / "extra.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert prep(["media", "--input", str(src / "extra.jsonl"), "--output", str(tmp_path / "x"), "--no-progress",
                 "--val-ratio", "0", "--workers", "1"]) == 0
    loader = MultimodalLoader(tmp_path / "x", settings(data),
                              opts(micro_batch_size=2, shuffle_buffer_size=0, num_slices=1))
    batch = next(loader)
    counts = dict(zip(batch.__key__, batch.image_counts.tolist()))
    assert counts == {"pair": 2, "slide": 4} and batch.images.shape == (6, 3, 32, 32)
    at = batch.__key__.index("slide") * 2  # rows in order: pair (2 images), slide (4 frames)
    assert batch.frame_index[at:at + 4].tolist() == [0, 1, 2, 3]
    assert batch.frame_index.tolist().count(0) == 3  # the pair's two stills and the first frame


@pytest.mark.parametrize("workers", [0, 1])
def test_sample_errors_are_raised_not_skipped(data, workers):
    from mmtrain.data.multimodal_media import MediaSampleError

    loader = MultimodalLoader(data["root"] / "mixed", settings(data, audio_token_id=None),
                              opts(micro_batch_size=1, shuffle_buffer_size=0, num_slices=1, num_workers=workers))
    with pytest.raises(MediaSampleError, match="clip-000.*no audio_token_id"):  # from a worker: the same error
        take(loader, 29)
    loader.close()


def test_validation_loader_is_one_ordered_pass(data, tmp_path):
    assert prep(["media", "--input", str(data["root"] / "in" / "a.jsonl"), "--output", str(tmp_path / "v"),
                 "--no-progress", "--val-ratio", "0.5", "--workers", "1"]) == 0
    n_val = json.loads((tmp_path / "v" / "manifest.json").read_text())["counts"]["splits"]["val"]
    loader = MultimodalLoader(tmp_path / "v", settings(data), opts(micro_batch_size=4), split="valid")
    passes = [[k for batch in loader for k in batch.__key__] for _ in range(2)]
    assert passes[0] == passes[1] and len(passes[0]) == len(set(passes[0])) == n_val > 0


def test_worker_count_does_not_change_the_batches(data):
    """Workers own some of the rank's slices each and the rank takes their batches in the fixed order."""
    reference = _global_order(data, 6)
    for workers in (2, 3):
        loader = MultimodalLoader(data["root"] / "a", settings(data, pack=True), opts(num_workers=workers))
        assert all(same(a, b) for a, b in zip(reference, take(loader, 6))), workers
        loader.close()


def test_workers_start_after_the_rank_used_openmp(data):
    """A worker forked after the rank ran a parallel torch op must not wait on the parent's OpenMP pool
    (it would hang in its first image resize)."""
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a rank with an OpenMP pool, also where the suite runs one thread a process (conftest.py)
    try:
        F.interpolate(torch.rand(1, 3, 512, 512), size=(224, 224), mode="bilinear", antialias=True)
        loader = MultimodalLoader(data["root"] / "a", settings(data, image_size=224),
                                  opts(num_workers=2, shuffle_buffer_size=2))
        assert take(loader, 2)[1].images.shape[-1] == 224
        loader.close()
    finally:
        torch.set_num_threads(threads)


def test_same_batches_in_another_process(data):
    import hashlib
    import subprocess
    import sys

    code = ("import sys, hashlib, json; from mmtrain.data.multimodal_loader import MultimodalLoader, LoaderOptions;"
            "from mmtrain.data.multimodal import MultimodalSettings;"
            "s = MultimodalSettings(**json.loads(sys.argv[2]));"
            "it = MultimodalLoader(sys.argv[1], s, LoaderOptions(micro_batch_size=2, num_slices=4, num_workers=2));"
            "h = hashlib.sha256();"
            "[h.update(next(it).tokens.numpy().tobytes()) for _ in range(4)]; it.close(); print(h.hexdigest())")
    base = {"tokenizer": data["tokenizer"], "seq_length": 96, "image_token_id": IMAGE_ID, "num_image_tokens": 8,
            "image_size": 32, "audio_token_id": AUDIO_ID, "num_audio_tokens": 4, "video_frames": 4}
    here = hashlib.sha256()
    for batch in take(MultimodalLoader(data["root"] / "a", settings(data), opts(micro_batch_size=2)), 4):
        here.update(batch.tokens.numpy().tobytes())
    there = subprocess.run([sys.executable, "-c", code, str(data["root"] / "a"), json.dumps(base)],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert there == here.hexdigest()


def test_vlm_energon_rows_state_is_plain_json(data):
    """The VLM batches keep this rank's loader state in the checkpoint's JSON as it is."""
    from mmtrain.data.vlm_batches import EnergonRows

    def rows():
        return EnergonRows(MultimodalLoader(data["root"] / "a", settings(data), opts(micro_batch_size=1)))

    first = rows()
    for _ in range(3):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))
    expected = [first.next() for _ in range(2)]
    again = rows()
    again.load_state_dict(state)
    assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.images, b.images)
               for a, b in zip(expected, [again.next() for _ in range(2)], strict=True))


def test_cooked_video_frames_count_up_in_time_and_stills_are_zero():
    """A still image and a video of 3 stored frames (2 sampled: the first and the last) in one sample."""
    from mmtrain.data.multimodal_media import cook_media_sample

    frame = [torch.full((3, 4, 4), v) for v in (0.1, 0.2, 0.3)]
    sample = {"__key__": "v", "__restore_key__": (), "jpg": torch.full((3, 4, 4), 0.9), "mp4": None,
              **{f"frame{i:03d}.jpg": f for i, f in enumerate(frame)}, "txt": "a clip"}
    cooked = cook_media_sample(sample, video_frames=2)
    assert cooked.frame_index == [0, 0, 1]
    assert [float(im[0, 0, 0]) for im in cooked.images] == pytest.approx([0.9, 0.1, 0.3])  # time order kept


def test_packing_and_batching_keep_frame_indices_aligned_with_images(data):
    from mmtrain.data.multimodal import EncodedMultimodalSample, MultimodalTaskEncoder

    enc = MultimodalTaskEncoder(settings(data))

    def sample(key: str, frames: list[int]) -> EncodedMultimodalSample:
        n = 8 * len(frames) + 2
        images = [torch.full((3, 32, 32), float(len(key) + f)) for f in frames]
        return EncodedMultimodalSample(__key__=key, __restore_key__=(), tokens=torch.full((n,), IMAGE_ID),
                                       labels=torch.full((n,), IGNORE_INDEX), position_ids=torch.arange(n),
                                       document_ids=torch.zeros(n, dtype=torch.int64), images=images,
                                       frame_index=torch.tensor(frames), audio=[])

    video, still, pair = sample("video", [0, 1, 2]), sample("s", [0]), sample("pp", [0, 0])
    packed = enc.pack_selected_samples([still, video])
    assert packed.frame_index.tolist() == [0, 0, 1, 2]
    assert all(torch.equal(a, b) for a, b in zip(packed.images, still.images + video.images))
    batch = enc.batch([packed, pair])
    assert batch.frame_index.tolist() == [0, 0, 1, 2, 0, 0] and batch.images.shape[0] == 6
    assert batch.image_counts.tolist() == [4, 2]
