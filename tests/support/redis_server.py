"""A real `redis-server` on a free loopback port in a temp dir, for the Redis index tests.

The `redis_server` fixture is global (tests/conftest.py loads this module as a plugin); tests that
use it are skipped, with the reason, only when `redis-server` is not on PATH (CI installs it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

REDIS_BIN = shutil.which("redis-server")
requires_redis = pytest.mark.skipif(
    REDIS_BIN is None, reason="redis-server is not on PATH (apt-get install redis-server)"
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, port: int | None = None, attempts: int = 3) -> None:
        assert REDIS_BIN is not None
        for _ in range(attempts):
            # A port picked free can be taken before redis binds it: retry with another.
            self.port = port or free_port()
            log = str(self.workdir / "redis.log")
            args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            self.proc = subprocess.Popen(
                [REDIS_BIN, *args, "--dir", str(self.workdir), "--logfile", log],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return
            self.stop()
        raise RuntimeError(f"redis-server did not start; see {self.workdir / 'redis.log'}")

    def _wait_ready(self, timeout: float = 5.0) -> bool:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_BIN is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
