"""The tiny model the server tests share: one engine behind `build_app` on a loopback port, the
offline API on the same checkpoint as its reference, and the `openai` client that talks to it.

tests/conftest.py loads this module as a plugin, so any test may ask for these fixtures by name;
module scope, so each module that does builds one server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# Loaded by every test session (a conftest plugin): the engine, torch and the client are imported
# by the fixtures, when a test asks for them.
if TYPE_CHECKING:
    import openai

    from chunkcache.llm import LLM
    from tests.support.server_util import ServerThread

API_KEY = "test-key"
MODEL = "tiny-served"
# Small caches keep the "every block is free again" checks meaningful; max_model_len 256 makes a
# too-long prompt cheap to send.
ENGINE_OPTIONS: dict[str, Any] = {
    "kv_cache_tokens": 8192,
    "max_model_len": 256,
    "chunk_cache_size_gb": 0.01,
    "max_num_seqs": 64,
    "device": "cpu",
    "dtype": "float32",  # auto is bfloat16 on CPUs with native bf16; the oracles are float32
    # The server tests' chunk assertions (cached tokens, blend, separator-free spans) are offset's,
    # pinned since the engine's default became fusion (issue 58); fusion's served form has its
    # own tests (tests/test_fusion.py).
    "chunk_layout": "offset",
}
PROMPTS = [
    "Zorvath sells apples in Ashford.",
    "Where does Mirela live?",
    "The famous town of Port Kellam has 12 lanterns.",
    "Every morning Bexley counts blue stones, and",
]


@pytest.fixture(scope="module")
def model_dir(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Iterator[LLM]:
    """The offline API on the same checkpoint, as a separate engine: the server's answers must be its."""
    from chunkcache.llm import LLM

    llm = LLM(str(model_dir), **ENGINE_OPTIONS)
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerThread]:
    from chunkcache.config import EngineConfig
    from chunkcache.engine.engine import LLMEngine
    from chunkcache.server.app import build_app
    from tests.support.server_util import ServerThread

    engine = LLMEngine(EngineConfig.from_options(str(model_dir), use_env=False, **ENGINE_OPTIONS))
    app = build_app(engine, api_key=API_KEY, max_queue=64, served_model_name=MODEL)
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    import openai

    # No retries: an error status must reach the test as it was sent.
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
