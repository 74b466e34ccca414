"""bench_serve's sides: the servers it starts, one process each, on free loopback ports.

- `chunkcache`: `python -m chunkcache.server.cli --model M --threads T` with the model's defaults
  (its default reuse);
- `chunkcache-off`: the same with `--no-enable-chunk-cache` (its prefix cache stays on);
- `llama.cpp`: `llama-server -m <the same GGUF> -t T -tb T --parallel S -c <ctx x S>
  --cache-reuse 256`, continuous batching and its prompt cache (on by default, with its RAM cache
  of slots' prompts) on; S = the run's concurrency.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SIDES = ("chunkcache", "chunkcache-off", "llama.cpp")
SHORT = {"chunkcache": "cc", "chunkcache-off": "off", "llama.cpp": "llamacpp"}  # SUMMARY keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m chunkcache.server.cli` on a free loopback port, its log in a temp file."""

    health_path = "/health"  # answers 200 once the server can take requests

    def __init__(self, model: Path, chunk_cache: bool, extra: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flag = "--enable-chunk-cache" if chunk_cache else "--no-enable-chunk-cache"
        self.cmd = [
            sys.executable, "-m", "chunkcache.server.cli", "--model", str(model), "--port", str(self.port),
            "--max-queue", "100000", "--log-level", "warning", flag, *extra,
        ]  # fmt: skip
        self.log_path = log_dir / f"server-chunk-cache-{'on' if chunk_cache else 'off'}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300.0) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        # The environment must not flip the mode under test.
        env.pop("CHUNKCACHE_ENABLE_CHUNK_CACHE", None)
        env.pop("VLLM_ENABLE_CHUNK_CACHE", None)
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}{self.health_path}", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not come up in {timeout}s:\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class LlamaServer(ServerProcess):
    """llama.cpp's `llama-server` with `slots` parallel slots of `ctx` tokens each."""

    def __init__(self, binary: Path, gguf: Path, threads: int, slots: int, ctx: int, log_dir: Path) -> None:
        super().__init__(gguf, True, [], log_dir)
        self.cmd = [
            str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
            "-t", str(threads), "-tb", str(threads), "--parallel", str(slots), "-c", str(ctx * slots),
            "--cont-batching", "--cache-reuse", "256",
        ]  # fmt: skip
        self.log_path = log_dir / f"llama-server-np{slots}.log"


def memory(pid: int) -> dict[str, int]:
    """Resident bytes now (VmRSS) and at the peak (VmHWM) of a process."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found


@dataclass
class Side:
    """A side's server, (re)started by `restart(slots)` through `make(slots)` (slots: llama.cpp's
    parallel slots; the chunkcache sides ignore them)."""

    name: str
    make: Callable[[int], ServerProcess]
    is_llama: bool = False
    server: ServerProcess | None = None

    def restart(self, slots: int) -> None:
        self.stop()
        self.server = self.make(slots)
        self.server.start(timeout=1800)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def memory(self) -> dict[str, int]:
        assert self.server is not None and self.server.proc is not None
        return memory(self.server.proc.pid)


def make_sides(
    names: list[str], model: str, gguf: Path | None, llama_binary: Callable[[], Path],
    threads: int, ctx: int, extra: list[str], log_dir: Path,
) -> list[Side]:  # fmt: skip
    """The sides named, in that order; `extra` goes to both chunkcache servers."""
    ours = ["--threads", str(threads), *extra]
    sides = []
    for name in names:
        if name == "llama.cpp":
            if gguf is None:
                raise SystemExit("the llama.cpp side serves a GGUF file: pass --model NAME or a .gguf")
            binary = llama_binary()
            sides.append(
                Side(name, lambda s, b=binary: LlamaServer(b, gguf, threads, s, ctx, log_dir), is_llama=True)
            )
        else:
            on = name == "chunkcache"
            sides.append(Side(name, lambda _s, on=on: ServerProcess(Path(model), on, ours, log_dir)))
    return sides
