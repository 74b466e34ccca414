"""Running a real uvicorn server inside a test process, and waiting for the engine to go idle."""

from __future__ import annotations

import asyncio
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn
from fastapi import FastAPI

from chunkcache.server.engine_loop import EngineLoop

if TYPE_CHECKING:
    import openai

T = TypeVar("T")


def free_port() -> int:
    """A loopback port free right now (for servers in another process, which must bind it themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on a random loopback port, in a daemon thread.

    The socket is bound here, before the thread starts, so the port is known and reserved without
    any race; uvicorn only listens on it.
    """

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine_loop(self) -> EngineLoop:
        return self.app.state.engine_loop

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def on_engine(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between steps (engine state is not safe to read elsewhere)."""
        return asyncio.run(self.engine_loop.call(fn))

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until no request is in flight and every KV block is free; return the engine stats."""
        deadline = time.monotonic() + timeout
        engine = self.engine_loop.engine
        while True:
            stats = self.on_engine(engine.stats)
            idle = (
                self.engine_loop.num_in_flight == 0
                and stats["num_waiting"] == 0
                and stats["num_running"] == 0
                and stats["kv_blocks_free"] == stats["kv_blocks_total"]
            )
            if idle:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {stats}")
            time.sleep(0.05)


class ServerProcess:
    """`python -m chunkcache.server.cli ARGS` in its own process, on a free loopback port.

    For what only a real process shows: its exit status, signals, a thread that dies for good."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, script: str | None = None) -> None:
        import os
        import subprocess
        import sys
        from pathlib import Path

        self.port = free_port()
        root = str(Path(__file__).resolve().parents[1])
        # `script` replaces `-m chunkcache.server.cli` (tests inject faults through it); it gets
        # the same argv.
        head = ["-c", script] if script is not None else ["-m", "chunkcache.server.cli"]
        # float32 unless a test asks otherwise: auto is bfloat16 on CPUs with native bf16 matmuls.
        dtype = [] if "--dtype" in args else ["--dtype", "float32"]
        cmd = [sys.executable, *head, *args, *dtype, "--host", "127.0.0.1", "--port", str(self.port)]
        full_env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", **(env or {})}
        # A file, not a pipe: a pipe nobody reads would block a chatty server.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        """What the server has printed so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def wait_healthy(self, timeout: float = 90.0) -> ServerProcess:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not come up")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()


@contextmanager
def served_client(
    model: Path | str, options: dict[str, Any], name: str, max_queue: int = 16
) -> Iterator[tuple[openai.OpenAI, ServerThread]]:
    """An engine on `model` with `options` (no env) behind the app, no API key, on a loopback port,
    and the official client talking to it (no retries: an error status reaches the test as sent)."""
    import openai

    from chunkcache.config import EngineConfig
    from chunkcache.engine.engine import LLMEngine
    from chunkcache.server.app import build_app

    engine = LLMEngine(EngineConfig.from_options(str(model), use_env=False, **options))
    srv = ServerThread(build_app(engine, api_key=None, max_queue=max_queue, served_model_name=name)).start()
    try:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60), srv
    finally:
        srv.stop()
