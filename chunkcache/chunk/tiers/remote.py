"""The shared remote tier on Redis (`redis://host:port/db`): every replica loads what any computed.

Layout under the prefix: an entry is split into parts of at most `part_bytes` (Redis strings
stop at 512 MiB and large values stall the server), `<prefix><name>:<i>`, written first; then
`<prefix><name>` = "<parts> <length>", so a reader never sees an entry whose parts are not all
there. A part missing later (Redis evicted it under `maxmemory`) makes the entry a miss, and it
is deleted. Capacity and eviction are Redis's own (`maxmemory`, `maxmemory-policy allkeys-lru`).

Redis down never reaches a client: every call is bounded by short timeouts, a failure is logged
(once per outage) and counted, and the tier is skipped for `retry_s` before it is tried again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from chunkcache.chunk.tiers.provider import TierProvider
from chunkcache.kv_events import MEDIUM_REMOTE

logger = logging.getLogger(__name__)
DEFAULT_PART_BYTES = 4 * 2**20


class RedisTier(TierProvider):
    medium = MEDIUM_REMOTE

    def __init__(
        self,
        url: str,
        prefix: str = "chunkcache:kv:",
        part_bytes: int = DEFAULT_PART_BYTES,
        timeout_s: float = 0.5,
        retry_s: float = 5.0,
    ) -> None:
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"chunk_cache_remote must be a redis:// URL, got {url!r}")
        self.url = url
        self.prefix = prefix
        self.part_bytes = part_bytes
        self.retry_s = retry_s
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=0
        )
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.unavailable = 0  # calls skipped or failed because Redis was down
        self.partial = 0  # entries found with a part missing (deleted)

    def _call(self, what: str, fn: Any, default: Any) -> Any:
        with self._lock:
            if time.monotonic() < self._down_until:
                self.unavailable += 1
                return default
        try:
            result = fn()
        except redis.RedisError as e:
            with self._lock:
                if self._down_until == 0.0:
                    logger.warning(
                        "remote tier %s unavailable (%s during %s): computing instead", self.url, e, what
                    )
                self._down_until = time.monotonic() + self.retry_s
                self.unavailable += 1
            return default
        with self._lock:
            if self._down_until != 0.0:
                logger.info("remote tier %s is back", self.url)
            self._down_until = 0.0
        return result

    def _name(self, key: str) -> str:
        return self.prefix + key

    def store(self, key: str, blob: bytes) -> bool:
        name = self._name(key)
        parts = [blob[i : i + self.part_bytes] for i in range(0, len(blob), self.part_bytes)] or [b""]

        def write() -> bool:
            pipe = self._client.pipeline(transaction=False)
            for i, part in enumerate(parts):
                pipe.set(f"{name}:{i}", part)
            pipe.execute()
            self._client.set(name, f"{len(parts)} {len(blob)}")
            return True

        return bool(self._call("store", write, False))

    def load(self, key: str) -> bytes | None:
        name = self._name(key)

        def read() -> bytes | None:
            head = self._client.get(name)
            if head is None:
                return None
            count, length = (int(x) for x in head.split())
            parts = self._client.mget([f"{name}:{i}" for i in range(count)])
            if any(p is None for p in parts):
                self.partial += 1
                self._delete(name, count)
                return None
            blob = b"".join(parts)
            return blob if len(blob) == length else None

        return self._call("load", read, None)

    def _delete(self, name: str, count: int) -> None:
        self._client.delete(name, *[f"{name}:{i}" for i in range(count)])

    def contains(self, key: str) -> bool:
        return bool(self._call("contains", lambda: self._client.exists(self._name(key)), False))

    def evict(self, key: str) -> None:
        name = self._name(key)

        def delete() -> None:
            head = self._client.get(name)
            count = int(head.split()[0]) if head else 0
            self._delete(name, count)

        self._call("evict", delete, None)

    def stats(self) -> dict[str, Any]:
        # No entries/bytes: they would need a scan of a keyspace other engines share (the stack
        # counts what this engine wrote and read).
        return {
            "unavailable": self.unavailable,
            "partial": self.partial,
            "up": int(self._down_until == 0.0),
        }

    def check_integrity(self) -> None:
        # Nothing is kept here but counters; Redis keeps the entries (and checks them itself).
        assert self.unavailable >= 0 and self.partial >= 0

    def close(self) -> None:
        self._client.close()
