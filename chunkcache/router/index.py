"""Where each KV block and chunk lives: the router's index (docs/design.md §4).

Backends: `MemoryIndex` (default, one router) and `RedisIndex` (`redis_index.py`, several routers
share it); `service.open_index("memory" | "redis://host:port/db")` picks one.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

# The tiers a pod holds a key in: tier names, sorted, joined by "+" ("GPU", "CPU+GPU").
Tiers = str


class IndexUnavailableError(RuntimeError):
    """The index backend cannot be reached (Redis down); callers fall back, nothing is corrupted."""


class IndexIntegrityError(AssertionError):
    """An index invariant does not hold (raised by `check_integrity`)."""


@dataclass
class IndexStats:
    admissions: int = 0  # (key, pod, tier) entries added
    removals: int = 0  # entries removed by events or pod clears
    evictions: int = 0  # entries dropped for capacity (keys LRU, pods per key)
    chunk_admissions: int = 0
    chunk_removals: int = 0
    chunk_evictions: int = 0


@dataclass
class IndexDump:
    """The whole index as plain dicts (tests, debugging)."""

    blocks: dict[int, dict[str, Tiers]] = field(default_factory=dict)
    chunks: dict[int, dict[str, int]] = field(default_factory=dict)


class KVIndex(ABC):
    """The contract every index backend keeps.

    - A block entry is (router key, pod, tier): key = 64-bit router block key (`tokens.BlockKeyer`),
      pod = backend id, tier = upper-case medium name ("GPU", "CPU", ...; no "+"). A pod may hold
      a key in several tiers at once (offloading); each tier is added and removed on its own, and
      lookups report them as one `Tiers` string ("CPU+GPU").
    - A chunk entry is (chunk key, pod) -> num_tokens; chunk keys are the engines' wire chunk hashes.
    - `add`/`remove` are idempotent; removing an absent entry is a no-op.
    - `lookup(keys)` returns one `{pod: tiers}` per key, for the longest prefix of `keys` in which
      every key is held by at least one pod: it stops at the first key nobody holds (nothing after
      it can extend a consecutive prefix). The caller owns the returned dicts.
    - `lookup_chunks(keys)` returns one `{pod: num_tokens}` per key (empty when unknown), any order.
    - `clear_pod(pod)` drops every block and chunk entry of that pod (restart, lost history).
    - Capacity: a bounded number of keys, and of pods per key; the least recently used go first.
    - Thread-safe: event workers write while the scorer reads.
    - A backend that cannot be reached raises `IndexUnavailableError`.
    - `check_integrity()` raises `IndexIntegrityError` naming the first broken invariant.
    """

    @abstractmethod
    def add(self, pod: str, keys: Sequence[int], tier: str) -> None: ...

    @abstractmethod
    def remove(self, pod: str, keys: Sequence[int], tier: str) -> None: ...

    @abstractmethod
    def lookup(self, keys: Sequence[int]) -> list[dict[str, Tiers]]: ...

    @abstractmethod
    def add_chunks(self, pod: str, chunks: Sequence[tuple[int, int]]) -> None:
        """`chunks` = (chunk key, num_tokens) pairs."""

    @abstractmethod
    def remove_chunks(self, pod: str, keys: Sequence[int]) -> None: ...

    @abstractmethod
    def lookup_chunks(self, keys: Sequence[int]) -> list[dict[str, int]]: ...

    @abstractmethod
    def clear_pod(self, pod: str) -> None: ...

    @abstractmethod
    def size(self) -> int:
        """Number of block keys held (Redis: keys in its database)."""

    @abstractmethod
    def stats(self) -> IndexStats: ...

    @abstractmethod
    def dump(self) -> IndexDump: ...

    @abstractmethod
    def check_integrity(self) -> None: ...

    def close(self) -> None:  # noqa: B027 - backends without resources need nothing
        """Release connections."""

    def lost_state(self) -> bool:
        """True (once) when the index lost what it held behind the router's back, e.g. a Redis
        restart: the router then asks every backend to re-publish its state. Raises
        IndexUnavailableError while the index cannot be asked."""
        return False  # an in-process index loses nothing on its own


class _TierNames:
    """Canonical tier-set strings ("GPU", "CPU+GPU"), interned and with cached set operations.

    A string rather than a frozenset because CPython's GC does not track a dict whose values are
    all atomic: the memory index's millions of inner dicts then cost the collector nothing, where
    frozenset values would make every one of them tracked (long full-collection pauses).
    """

    def __init__(self) -> None:
        self._members: dict[str, frozenset[str]] = {}
        self._plus: dict[tuple[str, str], str] = {}
        self._minus: dict[tuple[str, str], str] = {}

    def members(self, tiers: Tiers) -> frozenset[str]:
        m = self._members.get(tiers)
        if m is None:
            m = self._members[tiers] = frozenset(tiers.split("+"))
        return m

    def single(self, tier: str) -> Tiers:
        if "+" in tier or not tier:
            raise ValueError(f"tier name {tier!r} must be non-empty and without '+'")
        return tier

    def has(self, tiers: Tiers, tier: str) -> bool:
        return tiers == tier or tier in self.members(tiers)

    def plus(self, tiers: Tiers, tier: str) -> Tiers:
        out = self._plus.get((tiers, tier))
        if out is None:
            out = self._plus[(tiers, tier)] = "+".join(sorted(self.members(tiers) | {tier}))
        return out

    def minus(self, tiers: Tiers, tier: str) -> Tiers:
        """The remaining tiers; "" when none is left."""
        out = self._minus.get((tiers, tier))
        if out is None:
            out = self._minus[(tiers, tier)] = "+".join(sorted(self.members(tiers) - {tier}))
        return out


class MemoryIndex(KVIndex):
    """Two-level LRU: key -> {pod: tiers} with at most `capacity` keys and `pods_per_key` pods per
    key. Inner dicts keep insertion order, and a pod is re-inserted when it stores a key again, so
    the first pod of an inner dict is the least recently stored one."""

    # Pod clears scan the keys in slices so that scoring is never blocked for long.
    _CLEAR_SLICE = 20_000

    def __init__(self, capacity: int = 10_000_000, pods_per_key: int = 10, chunk_capacity: int = 1_000_000):
        if capacity <= 0 or pods_per_key <= 0 or chunk_capacity <= 0:
            raise ValueError("index capacities must be > 0")
        self.capacity = capacity
        self.pods_per_key = pods_per_key
        self.chunk_capacity = chunk_capacity
        self._lock = threading.Lock()
        self._blocks: OrderedDict[int, dict[str, Tiers]] = OrderedDict()
        self._chunks: OrderedDict[int, dict[str, int]] = OrderedDict()
        self._tiers = _TierNames()
        self._stats = IndexStats()

    def add(self, pod: str, keys: Sequence[int], tier: str) -> None:
        single = self._tiers.single(tier)
        cap = self.pods_per_key
        admitted = evicted = 0
        with self._lock:
            blocks = self._blocks
            for k in keys:
                inner = blocks.get(k)
                if inner is None:
                    blocks[k] = {pod: single}
                    admitted += 1
                    continue
                blocks.move_to_end(k)
                cur = inner.pop(pod, None)
                if cur is None:
                    inner[pod] = single
                    admitted += 1
                    if len(inner) > cap:
                        del inner[next(iter(inner))]
                        evicted += 1
                elif self._tiers.has(cur, tier):
                    inner[pod] = cur
                else:
                    inner[pod] = self._tiers.plus(cur, tier)
                    admitted += 1
            while len(blocks) > self.capacity:
                _, dropped = blocks.popitem(last=False)
                evicted += len(dropped)
            self._stats.admissions += admitted
            self._stats.evictions += evicted

    def remove(self, pod: str, keys: Sequence[int], tier: str) -> None:
        with self._lock:
            blocks = self._blocks
            for k in keys:
                inner = blocks.get(k)
                cur = None if inner is None else inner.get(pod)
                if cur is None or not self._tiers.has(cur, tier):
                    continue
                self._stats.removals += 1
                rest = "" if cur == tier else self._tiers.minus(cur, tier)
                if rest:
                    inner[pod] = rest  # type: ignore[index]
                    continue
                del inner[pod]  # type: ignore[union-attr]
                if not inner:
                    del blocks[k]

    def lookup(self, keys: Sequence[int]) -> list[dict[str, Tiers]]:
        out: list[dict[str, Tiers]] = []
        with self._lock:
            blocks = self._blocks
            for k in keys:
                inner = blocks.get(k)
                if not inner:
                    break
                blocks.move_to_end(k)  # a looked-up key is in use: keep it
                out.append(dict(inner))  # a copy: writers mutate inner dicts in place
        return out

    def add_chunks(self, pod: str, chunks: Sequence[tuple[int, int]]) -> None:
        st = self._stats
        with self._lock:
            table = self._chunks
            for key, num_tokens in chunks:
                inner = table.get(key)
                if inner is None:
                    inner = table[key] = {}
                else:
                    table.move_to_end(key)
                if inner.pop(pod, None) is None:
                    st.chunk_admissions += 1
                inner[pod] = num_tokens
                if len(inner) > self.pods_per_key:
                    del inner[next(iter(inner))]
                    st.chunk_evictions += 1
            while len(table) > self.chunk_capacity:
                _, dropped = table.popitem(last=False)
                st.chunk_evictions += len(dropped)

    def remove_chunks(self, pod: str, keys: Sequence[int]) -> None:
        with self._lock:
            for key in keys:
                inner = self._chunks.get(key)
                if inner is None or inner.pop(pod, None) is None:
                    continue
                self._stats.chunk_removals += 1
                if not inner:
                    del self._chunks[key]

    def lookup_chunks(self, keys: Sequence[int]) -> list[dict[str, int]]:
        with self._lock:
            return [dict(self._chunks.get(k) or {}) for k in keys]

    def clear_pod(self, pod: str) -> None:
        for table, is_chunk in ((self._blocks, False), (self._chunks, True)):
            with self._lock:
                snapshot = list(table)
            for start in range(0, len(snapshot), self._CLEAR_SLICE):
                with self._lock:
                    for k in snapshot[start : start + self._CLEAR_SLICE]:
                        inner = table.get(k)
                        if inner is None or pod not in inner:
                            continue
                        removed = inner.pop(pod)
                        if is_chunk:
                            self._stats.chunk_removals += 1
                        else:
                            self._stats.removals += len(self._tiers.members(removed))  # type: ignore[arg-type]
                        if not inner:
                            del table[k]

    def size(self) -> int:
        return len(self._blocks)

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(**vars(self._stats))

    def dump(self) -> IndexDump:
        with self._lock:
            return IndexDump(
                {k: dict(v) for k, v in self._blocks.items()}, {k: dict(v) for k, v in self._chunks.items()}
            )

    def check_integrity(self) -> None:
        with self._lock:
            if len(self._blocks) > self.capacity:
                raise IndexIntegrityError(f"{len(self._blocks)} keys exceed capacity {self.capacity}")
            for k, inner in self._blocks.items():
                if not inner:
                    raise IndexIntegrityError(f"block key {k:#x} has no pods but is still indexed")
                if len(inner) > self.pods_per_key:
                    raise IndexIntegrityError(f"block key {k:#x} has {len(inner)} pods > {self.pods_per_key}")
                for pod, tiers in inner.items():
                    if (
                        not isinstance(tiers, str)
                        or not tiers
                        or tiers != self._tiers.plus(tiers, tiers.split("+")[0])
                    ):
                        raise IndexIntegrityError(f"block key {k:#x} pod {pod!r} has tiers {tiers!r}")
            if len(self._chunks) > self.chunk_capacity:
                raise IndexIntegrityError(f"{len(self._chunks)} chunks exceed capacity {self.chunk_capacity}")
            for k, inner in self._chunks.items():
                if not inner:
                    raise IndexIntegrityError(f"chunk key {k:#x} has no pods but is still indexed")
                for pod, n in inner.items():
                    if not isinstance(n, int) or n <= 0:
                        raise IndexIntegrityError(f"chunk key {k:#x} pod {pod!r} has {n!r} tokens")
