"""Sizes that killed the process (issue #29 item 6) are one line and exit code 2 before anything is allocated:
a context or slot count whose KV cache exceeds the device's free memory (serve, generate), a --max-new-tokens
beyond the limit; and a port in use is reported before the model loads (issue #30 item 11). The commands run in
subprocesses under an address-space limit, so that a version that does allocate fails instead of exhausting the
machine."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.inference_helpers import tiny_checkpoint, tiny_config, tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
ADDRESS_SPACE = 6 << 30  # torch, the tiny model and a refusal fit; a cache of many GB does not


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sizes")
    return str(tiny_checkpoint(root / "ckpt")), str(tiny_tokenizer(root / "tok"))


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _run(module: str, args: list[str]) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=300, preexec_fn=_limited, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return r.returncode, r.stderr


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    return errors[0]


def test_serve_refuses_a_context_larger_than_the_device(files):
    ckpt, tok = files
    code, err = _run("mmtrain.serve", ["--ckpt", ckpt, "--tokenizer", tok, "--device", "cpu", "--port", "0",
                                       "--context", str(10**8)])
    line = _one_error_line(err)
    assert code == 2, err
    assert "KV cache of 32 slots x 100000000 positions needs" in line and "lower --context or --slots" in line


@pytest.mark.parametrize("new_tokens", [10**8])
def test_generate_refuses_max_new_tokens_beyond_the_limit_before_loading(files, new_tokens):
    ckpt, tok = files
    code, err = _run("mmtrain.generate", ["--ckpt", ckpt, "--tokenizer", tok, "--device", "cpu", "--prompt", "Hi",
                                          "--max-new-tokens", str(new_tokens)])
    line = _one_error_line(err)
    assert code == 2 and f"max_new_tokens must be an integer in 1..1048576, got {new_tokens}" in line, err


def test_a_cache_over_the_free_memory_is_refused_before_it_is_allocated(monkeypatch, tmp_path, capsys):
    from mmtrain.generate import main as generate_main
    from mmtrain.inference import memory
    from mmtrain.inference.engine import DecodeEngine
    from mmtrain.inference.memory import CacheSizeError

    model = tiny_model()
    per_position = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x fp32
    monkeypatch.setattr(memory, "free_bytes", lambda device: 100 * per_position)
    DecodeEngine(model, 2, 45)  # 90 positions: within 90% of the free memory
    with pytest.raises(CacheSizeError, match=r"2 slots x 46 positions needs 47104 bytes \(512 bytes a position\), "
                                             r"more than 90% of the 51200 bytes free"):
        DecodeEngine(model, 2, 46)
    code = generate_main(["--ckpt", str(tiny_checkpoint(tmp_path / "ckpt", tiny_config())), "--tokenizer",
                          str(tiny_tokenizer(tmp_path / "tok")), "--prompt", "Hello", "--max-new-tokens", "200",
                          "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "lower --max-new-tokens or --batch-size" in err, err


def test_a_port_in_use_is_reported_before_the_model_loads(tmp_path, capsys):
    from mmtrain.serve import main

    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:  # no checkpoint there: loading it would be the error
        code = main(["--ckpt", str(tmp_path / "missing"), "--tokenizer", str(tmp_path / "missing.json"),
                     "--port", str(port), "--device", "cpu"])
    finally:
        taken.close()
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and f"cannot listen on 127.0.0.1:{port}" in err, err
