"""bench_serve's sides: the servers it starts, one process each, on free loopback ports.

- `chunkcache`: `python -m chunkcache.server.cli --model M --threads T` with the model's defaults
  (its default reuse);
- `chunkcache-off`: the same with `--no-enable-chunk-cache` (its prefix cache stays on);
- `llama.cpp`: `llama-server -m <the same GGUF> -t T -tb T --parallel S -c <ctx x S>
  --cache-reuse 256`, continuous batching and its prompt cache (on by default, with its RAM cache
  of slots' prompts) on; S = the run's concurrency;
- `cluster-<policy>` (cache_aware, round_robin, prefix_only, least_loaded): `--replicas` chunkcache
  servers with the default reuse, the threads shared out (T // replicas each), each publishing its KV
  events to `chunkcache route --policy <policy>` in front (issue 57's cluster on the real model).
  Its memory is the replicas' and the router's summed; its chunk stats the replicas' summed.
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
# The replicas' served name: the model name in their chunk keys and KV event topics, the router's.
CLUSTER_MODEL_NAME = "bench-cluster"
CLUSTER_POLICIES = ("cache_aware", "round_robin", "prefix_only", "least_loaded")
SIDES = ("chunkcache", "chunkcache-off", "llama.cpp", *(f"cluster-{p}" for p in CLUSTER_POLICIES))
SHORT = {  # SUMMARY keys
    "chunkcache": "cc",
    "chunkcache-off": "off",
    "llama.cpp": "llamacpp",
    **{f"cluster-{p}": f"cl_{''.join(w[0] for w in p.split('_'))}" for p in CLUSTER_POLICIES},
}


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

    def pids(self) -> list[int]:
        """The processes whose memory is this side's."""
        return [] if self.proc is None else [self.proc.pid]

    def stats_urls(self) -> list[str]:
        """The chunkcache servers whose /v1/chunk_cache/stats are this side's."""
        return [self.url]


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


class RouterProcess(ServerProcess):
    """`chunkcache route --policy P` over `backends` (NAME@URL==REPLAY specs), binding `events`."""

    def __init__(self, model: Path, policy: str, backends: list[str], events: str, log_dir: Path) -> None:
        super().__init__(model, True, [], log_dir)
        self.cmd = [
            sys.executable, "-m", "chunkcache.cli", "route", "--model", str(model), "--policy", policy,
            "--port", str(self.port), "--backends", ",".join(backends), "--events-bind", events,
            "--events-topic-filter", "kv@", "--event-workers", "2", "--health-interval", "2",
            "--model-name", CLUSTER_MODEL_NAME,
        ]  # fmt: skip
        self.log_path = log_dir / f"router-{policy}.log"


class ClusterProcess(ServerProcess):
    """`replicas` chunkcache servers (`extra` their options) behind a router with `policy`; its
    url is the router's. The replicas start one after another (two loading at once on a small
    machine would each take twice as long), then the router."""

    def __init__(self, model: Path, policy: str, replicas: int, extra: list[str], log_dir: Path) -> None:
        events = f"tcp://127.0.0.1:{free_port()}"
        self.replicas, specs = [], []
        for i in range(replicas):
            replay = f"tcp://127.0.0.1:{free_port()}"
            topic = ["--kv-events-endpoint", events, "--kv-events-topic", f"kv@r{i}@{CLUSTER_MODEL_NAME}"]
            server = ServerProcess(
                model, True, [*extra, *topic, "--kv-events-replay-endpoint", replay], log_dir
            )
            server.log_path = log_dir / f"cluster-{policy}-r{i}.log"
            self.replicas.append(server)
            specs.append(f"r{i}@{server.url}=={replay}")
        self.router = RouterProcess(model, policy, specs, events, log_dir)
        self.port, self.url, self.log_path = self.router.port, self.router.url, self.router.log_path
        self.proc = None

    def start(self, timeout: float = 300.0) -> None:
        for server in self.replicas:
            server.start(timeout)
        self.router.start(timeout)
        self.proc = self.router.proc

    def stop(self) -> None:
        for server in [self.router, *self.replicas]:
            server.stop()

    def pids(self) -> list[int]:
        return [pid for server in [self.router, *self.replicas] for pid in server.pids()]

    def stats_urls(self) -> list[str]:
        return [server.url for server in self.replicas]


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
        """Its processes' resident bytes summed (a cluster's peaks summed: an upper bound)."""
        assert self.server is not None
        total: dict[str, int] = {"VmRSS": 0, "VmHWM": 0}
        for pid in self.server.pids():
            for key, value in memory(pid).items():
                total[key] += value
        return total


def make_sides(
    names: list[str], model: str, gguf: Path | None, llama_binary: Callable[[], Path],
    threads: int, ctx: int, extra: list[str], log_dir: Path, replicas: int = 2,
) -> list[Side]:  # fmt: skip
    """The sides named, in that order; `extra` goes to every chunkcache server."""
    ours = ["--threads", str(threads), *extra]
    sides = []
    for name in names:
        if name.startswith("cluster-"):
            policy = name.removeprefix("cluster-")
            share = [
                "--threads",
                str(max(1, threads // replicas)),
                "--served-model-name",
                CLUSTER_MODEL_NAME,
                *extra,
            ]
            sides.append(
                Side(name, lambda _s, p=policy, a=share: ClusterProcess(Path(model), p, replicas, a, log_dir))
            )
        elif name == "llama.cpp":
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
