"""The index in Redis, so that several routers share one view of the cluster's KV.

Layout under `prefix` (one Redis database; Redis Cluster is not supported because the scripts
touch many keys):
- `b:<key hex>`   hash, field `<pod>|<tier>` -> `clock` value at the last store (pods-per-key LRU);
- `c:<key hex>`   hash, field `<pod>` -> num_tokens;
- `pod:<pod>:b` / `pod:<pod>:c`  sets of the pod's `<key hex>|<tier>` / `<key hex>` members, so a
  pod clear finds its entries without scanning the database.
Key capacity is Redis' own business (`maxmemory` with `allkeys-lru`); pods-per-key is enforced
here. Every operation is one round trip (a pipeline, or a script that stops a lookup early).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import redis

from chunkcache.router.index import (
    IndexDump,
    IndexIntegrityError,
    IndexStats,
    IndexUnavailableError,
    KVIndex,
    Tiers,
    _TierNames,
)

P = ParamSpec("P")
R = TypeVar("R")

# KEYS = the store clock, then block hashes; ARGV = field, pods-per-key cap. Returns {added, evicted}.
# The clock is a Redis counter, not wall time: strictly ordered even across routers and within a ms.
_ADD = """
local added, evicted = 0, 0
local cap = tonumber(ARGV[2])
local now = redis.call('INCR', KEYS[1])
for i = 2, #KEYS do
  local k = KEYS[i]
  added = added + redis.call('HSET', k, ARGV[1], now)
  if redis.call('HLEN', k) > cap then
    local all = redis.call('HGETALL', k)
    local oldest, oldest_ts = nil, nil
    for j = 1, #all, 2 do
      local ts = tonumber(all[j + 1])
      if oldest_ts == nil or ts < oldest_ts then oldest, oldest_ts = all[j], ts end
    end
    redis.call('HDEL', k, oldest)
    evicted = evicted + 1
  end
end
return {added, evicted}
"""

# KEYS = block hashes in prompt order. Returns the field lists up to the first key nobody holds.
_LOOKUP = """
local out = {}
for i = 1, #KEYS do
  local fields = redis.call('HKEYS', KEYS[i])
  if #fields == 0 then break end
  out[i] = fields
end
return out
"""

# Redis limits how many arguments one script call should carry; events can be large.
_SCRIPT_BATCH = 2000


def _unavailable(fn: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except redis.RedisError as e:
            raise IndexUnavailableError(f"redis index: {e}") from e

    return wrapper


class RedisIndex(KVIndex):
    def __init__(
        self,
        url: str,
        pods_per_key: int = 10,
        prefix: str = "chunkcache:router:",
        timeout_s: float = 0.5,
        client: redis.Redis | None = None,
    ) -> None:
        # Short timeouts: a request waits on a lookup, and a dead Redis must turn into a quick
        # least-loaded fallback rather than a stalled request.
        self._r: redis.Redis = client or redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.url = url
        self.pods_per_key = pods_per_key
        self.prefix = prefix
        self._add_script = self._r.register_script(_ADD)
        self._lookup_script = self._r.register_script(_LOOKUP)
        self._tiers = _TierNames()
        self._stats = IndexStats()
        self._stats_lock = threading.Lock()
        self._clock = f"{prefix}clock"
        # Present while Redis holds what routers wrote; gone after a restart or a flush.
        self._alive = f"{prefix}alive"
        # Redis down at start: the first lost_state() once it is up says so.
        with contextlib.suppress(redis.RedisError):
            self._r.set(self._alive, "1")

    def _bkey(self, key: int) -> str:
        return f"{self.prefix}b:{key:016x}"

    def _ckey(self, key: int) -> str:
        return f"{self.prefix}c:{key:016x}"

    def _podset(self, pod: str, kind: str) -> str:
        return f"{self.prefix}pod:{pod}:{kind}"

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    @_unavailable
    def add(self, pod: str, keys: Sequence[int], tier: str) -> None:
        if not keys:
            return
        field = f"{pod}|{tier}"
        pipe = self._r.pipeline(transaction=False)
        for start in range(0, len(keys), _SCRIPT_BATCH):
            part = keys[start : start + _SCRIPT_BATCH]
            keys_arg = [self._clock, *(self._bkey(k) for k in part)]
            self._add_script(keys=keys_arg, args=[field, self.pods_per_key], client=pipe)
            pipe.sadd(self._podset(pod, "b"), *(f"{k:016x}|{tier}" for k in part))
        results = pipe.execute()
        added = sum(r[0] for r in results[0::2])
        evicted = sum(r[1] for r in results[0::2])
        self._count(admissions=added, evictions=evicted)

    @_unavailable
    def remove(self, pod: str, keys: Sequence[int], tier: str) -> None:
        if not keys:
            return
        field = f"{pod}|{tier}"
        pipe = self._r.pipeline(transaction=False)
        for k in keys:
            pipe.hdel(self._bkey(k), field)
        pipe.srem(self._podset(pod, "b"), *(f"{k:016x}|{tier}" for k in keys))
        results = pipe.execute()
        self._count(removals=sum(results[:-1]))

    @_unavailable
    def lookup(self, keys: Sequence[int]) -> list[dict[str, Tiers]]:
        out: list[dict[str, Tiers]] = []
        for start in range(0, len(keys), _SCRIPT_BATCH):
            part = keys[start : start + _SCRIPT_BATCH]
            rows = self._lookup_script(keys=[self._bkey(k) for k in part])
            for fields in rows:
                out.append(self._parse_fields(fields))
            if len(rows) < len(part):
                break
        return out

    def _parse_fields(self, fields: Sequence[str]) -> dict[str, Tiers]:
        pods: dict[str, Tiers] = {}
        for f in fields:
            pod, _, tier = f.rpartition("|")  # pod ids may contain '|'; tier names never do
            cur = pods.get(pod)
            pods[pod] = self._tiers.single(tier) if cur is None else self._tiers.plus(cur, tier)
        return pods

    @_unavailable
    def add_chunks(self, pod: str, chunks: Sequence[tuple[int, int]]) -> None:
        if not chunks:
            return
        pipe = self._r.pipeline(transaction=False)
        for key, num_tokens in chunks:
            pipe.hset(self._ckey(key), pod, num_tokens)
        pipe.sadd(self._podset(pod, "c"), *(f"{key:016x}" for key, _ in chunks))
        self._count(chunk_admissions=sum(pipe.execute()[:-1]))

    @_unavailable
    def remove_chunks(self, pod: str, keys: Sequence[int]) -> None:
        if not keys:
            return
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.hdel(self._ckey(key), pod)
        pipe.srem(self._podset(pod, "c"), *(f"{key:016x}" for key in keys))
        self._count(chunk_removals=sum(pipe.execute()[:-1]))

    @_unavailable
    def lookup_chunks(self, keys: Sequence[int]) -> list[dict[str, int]]:
        if not keys:
            return []
        pipe = self._r.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(self._ckey(key))
        return [{pod: int(n) for pod, n in row.items()} for row in pipe.execute()]

    @_unavailable
    def clear_pod(self, pod: str) -> None:
        for kind in ("b", "c"):
            podset = self._podset(pod, kind)
            batch: list[str] = []
            for member in self._r.sscan_iter(podset, count=1000):
                batch.append(member)
                if len(batch) >= 1000:
                    self._clear_batch(pod, kind, batch)
                    batch = []
            self._clear_batch(pod, kind, batch)
            self._r.delete(podset)

    def _clear_batch(self, pod: str, kind: str, members: list[str]) -> None:
        if not members:
            return
        pipe = self._r.pipeline(transaction=False)
        for m in members:
            if kind == "b":
                hexkey, _, tier = m.partition("|")
                pipe.hdel(f"{self.prefix}b:{hexkey}", f"{pod}|{tier}")
            else:
                pipe.hdel(f"{self.prefix}c:{m}", pod)
        removed = sum(pipe.execute())
        self._count(**{"removals" if kind == "b" else "chunk_removals": removed})

    @_unavailable
    def size(self) -> int:
        return int(self._r.dbsize())

    def stats(self) -> IndexStats:
        with self._stats_lock:
            return IndexStats(**vars(self._stats))

    def _scan(self, kind: str) -> dict[str, Any]:
        """Every `kind` hash under the prefix, as {redis key: {field: value}}."""
        out: dict[str, Any] = {}
        for key in self._r.scan_iter(match=f"{self.prefix}{kind}:*", count=1000):
            out[key] = self._r.hgetall(key)
        return out

    @_unavailable
    def dump(self) -> IndexDump:
        plen = len(self.prefix) + 2
        blocks = {int(k[plen:], 16): self._parse_fields(list(v)) for k, v in self._scan("b").items() if v}
        chunks = {
            int(k[plen:], 16): {p: int(n) for p, n in v.items()} for k, v in self._scan("c").items() if v
        }
        return IndexDump(blocks, chunks)

    @_unavailable
    def check_integrity(self) -> None:
        plen = len(self.prefix) + 2
        for key, fields in self._scan("b").items():
            if len(fields) > self.pods_per_key:
                raise IndexIntegrityError(f"{key} has {len(fields)} entries > {self.pods_per_key}")
            for f, ts in fields.items():
                pod, sep, tier = f.rpartition("|")
                if not sep or not pod or not tier or not ts.isdigit():
                    raise IndexIntegrityError(f"{key} has a malformed entry {f!r}={ts!r}")
                if not self._r.sismember(self._podset(pod, "b"), f"{key[plen:]}|{tier}"):
                    raise IndexIntegrityError(f"{key} entry {f!r} is missing from the pod's key set")
        for key, fields in self._scan("c").items():
            for pod, n in fields.items():
                if not n.isdigit() or int(n) <= 0:
                    raise IndexIntegrityError(f"{key} pod {pod!r} has {n!r} tokens")
                if not self._r.sismember(self._podset(pod, "c"), key[plen:]):
                    raise IndexIntegrityError(f"{key} pod {pod!r} is missing from the pod's chunk set")

    @_unavailable
    def lost_state(self) -> bool:
        # NX succeeds only when the marker is gone: one router of several sees it, which is enough
        # (the backends re-publish to every router).
        return bool(self._r.set(self._alive, "1", nx=True))

    def close(self) -> None:
        self._r.close()
