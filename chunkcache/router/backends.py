"""The replicas a router sends requests to: specs, load, health.

A backend spec is `[NAME@]URL[=EVENTS[=REPLAY]]`: the OpenAI server URL, optionally its KV event
PUB endpoint and replay endpoint, e.g. `r1@http://10.0.0.5:8000=tcp://10.0.0.5:5557=tcp://10.0.0.5:5558`.
The pod id (what the index calls it) is NAME, or the URL without a trailing slash. A backends file
holds one spec per line (`#` comments) or JSON: a list of `{"url", "name", "events", "replay"}`
objects, or `{"backends": [...]}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendSpec:
    url: str
    name: str | None = None
    events: str | None = None
    replay: str | None = None

    @property
    def pod_id(self) -> str:
        return self.name or self.url


def parse_backend_spec(spec: str) -> BackendSpec:
    spec = spec.strip()
    name = None
    scheme_at = spec.find("://")
    at = spec.find("@")
    if 0 < at < scheme_at:
        name, spec = spec[:at], spec[at + 1 :]
    parts = spec.split("=")
    if len(parts) > 3 or not parts[0]:
        raise ValueError(f"backend spec {spec!r} is not [NAME@]URL[=EVENTS[=REPLAY]]")
    url = parts[0].rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"backend URL {url!r} must start with http:// or https://")
    events = parts[1] if len(parts) > 1 and parts[1] else None
    replay = parts[2] if len(parts) > 2 and parts[2] else None
    return BackendSpec(url, name, events, replay)


def parse_backend_list(specs: Iterable[str]) -> list[BackendSpec]:
    """Comma-separated specs, possibly given several times."""
    return [parse_backend_spec(s) for item in specs for s in item.split(",") if s.strip()]


def load_backends_file(path: str | Path) -> list[BackendSpec]:
    text = Path(path).read_text()
    if text.lstrip().startswith(("[", "{")):
        data: Any = json.loads(text)
        items = data["backends"] if isinstance(data, dict) else data
        out = []
        for item in items:
            if isinstance(item, str):
                out.append(parse_backend_spec(item))
            else:
                url = str(item["url"]).rstrip("/")
                out.append(BackendSpec(url, item.get("name"), item.get("events"), item.get("replay")))
        return out
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [parse_backend_spec(line) for line in lines if line]


@dataclass
class Backend:
    spec: BackendSpec
    in_flight: int = 0
    healthy: bool = True
    consecutive_failures: int = 0
    last_check: float = 0.0

    @property
    def pod_id(self) -> str:
        return self.spec.pod_id

    @property
    def url(self) -> str:
        return self.spec.url


class BackendPool:
    """Backends by pod id, their in-flight load (requests this router has open on them) and health.

    A failed health check (or a refused connection while proxying) ejects a backend; a passing
    check readmits it. Static backends (the constructor's) stay; discovered ones come and go with
    `sync`. Loads and membership are touched only from the event loop, so they need no lock;
    `ids` is an immutable snapshot that other threads (scoring) may read.
    """

    def __init__(self, specs: Iterable[BackendSpec], allow_empty: bool = False) -> None:
        self.backends: dict[str, Backend] = {}
        for spec in specs:
            if spec.pod_id in self.backends:
                raise ValueError(f"backend {spec.pod_id!r} given twice")
            self.backends[spec.pod_id] = Backend(spec)
        if not self.backends and not allow_empty:
            raise ValueError("a router needs at least one backend")
        self.static = frozenset(self.backends)
        self.ids: tuple[str, ...] = tuple(self.backends)

    def __iter__(self) -> Iterator[Backend]:
        return iter(list(self.backends.values()))

    def __len__(self) -> int:
        return len(self.backends)

    def sync(self, discovered: Mapping[str, BackendSpec]) -> tuple[list[BackendSpec], list[str]]:
        """Make the discovered backends `discovered` (pod id -> spec); static ones never change.
        Returns (added, removed); a pod whose spec changed (a new IP) is both, removed first. A new
        backend starts healthy: discovery admits only Ready pods."""
        removed = [
            pod
            for pod, b in self.backends.items()
            if pod not in self.static and discovered.get(pod) != b.spec
        ]
        for pod in removed:
            del self.backends[pod]
        added = []
        for pod, spec in discovered.items():
            if pod in self.static:
                if self.backends[pod].spec != spec:
                    logger.warning("discovered pod %s has the name of a static backend: ignored", pod)
                continue
            if pod not in self.backends:
                self.backends[pod] = Backend(spec)
                added.append(spec)
        self.ids = tuple(self.backends)
        return added, removed

    def candidates(self) -> list[Backend]:
        """Healthy backends; all of them when none is (better a try than a certain 503)."""
        healthy = [b for b in self.backends.values() if b.healthy]
        return healthy or list(self.backends.values())

    def mark(self, backend: Backend, ok: bool, reason: str = "") -> None:
        if ok:
            if not backend.healthy:
                logger.info("backend %s readmitted", backend.pod_id)
            backend.healthy = True
            backend.consecutive_failures = 0
        else:
            if backend.healthy:
                logger.warning("backend %s ejected: %s", backend.pod_id, reason)
            backend.healthy = False
            backend.consecutive_failures += 1

    async def check(self, client: httpx.AsyncClient, backend: Backend, timeout_s: float) -> bool:
        try:
            resp = await client.get(f"{backend.url}/health", timeout=timeout_s)
            ok = resp.status_code == 200
            reason = f"GET /health returned {resp.status_code}"
        except httpx.HTTPError as e:
            ok, reason = False, f"GET /health failed: {type(e).__name__}"
        backend.last_check = time.monotonic()
        self.mark(backend, ok, reason)
        return ok

    async def check_all(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        await asyncio.gather(*(self.check(client, b, timeout_s) for b in list(self.backends.values())))

    async def health_loop(self, client: httpx.AsyncClient, interval_s: float, timeout_s: float) -> None:
        while True:
            await self.check_all(client, timeout_s)
            await asyncio.sleep(interval_s)
