"""The lower tiers under the device pool, nearest first (disk, then remote), and their writer.

Contract:
- `load(key, token_ids)` (the loader thread, synchronous) asks each tier in turn; the first entry
  that decodes, passes its checksum, belongs to this model, holds exactly `token_ids` and has
  this engine's KV layout (`kv_layout`) is returned.
  A corrupt entry, or a sound one under another entry's name, is evicted from its tier and
  counted; the lookup goes on to the next tier. A hit
  in a farther tier is written (asynchronously) into the nearer ones that missed (promotion).
- `store(kv)` (engine thread) hands a computed entry to the writer thread, which encodes it once
  and writes it to every tier that lacks it (write-through: a restart or another replica finds it
  without waiting for an eviction). Writes beyond `max_pending_bytes` in flight are dropped and
  counted: the engine never waits for a disk or the network.
- `holds(key)`: whether the entry was handed to every tier (stored or queued) or loaded from one, so
  a pool eviction need not write it down again; a failed or dropped write clears it.
- `flush()` waits until every queued write is done; `close()` flushes, stops the writer and
  closes the tiers. Engines call it on shutdown.
- Tier changes become ChunkStored / ChunkRemoved events with the tier's `medium`, collected here
  from any thread and drained by the engine thread.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from chunkcache.chunk.tiers.provider import (
    CorruptEntry,
    StoredKV,
    TierProvider,
    decode,
    encode,
    parse_tier_key,
    tier_key,
)
from chunkcache.hashing import to_wire
from chunkcache.kv_events import ChunkRemoved, ChunkStored

logger = logging.getLogger(__name__)
# Seconds; a disk hit of a few MiB takes milliseconds, a remote one a little more.
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DEFAULT_MAX_PENDING_BYTES = 1 << 30


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    stores: int = 0
    store_failures: int = 0
    misnamed: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds_sum: float = 0.0
    # load_seconds_buckets[i] = loads that took <= LOAD_BUCKETS[i] (not cumulative; +Inf last).
    load_seconds_buckets: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))

    def observe_load(self, seconds: float) -> None:
        self.load_seconds_sum += seconds
        self.load_seconds_buckets[bisect.bisect_left(LOAD_BUCKETS, seconds)] += 1


class TierStack:
    def __init__(
        self,
        tiers: list[TierProvider],
        model: str,
        kv_layout: tuple[int, int, int, torch.dtype] | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        self.tiers = tiers
        self.model = model
        # (layers, kv_heads, head_dim, dtype) an entry must have to be loaded; None: any.
        self.kv_layout = kv_layout
        self.max_pending_bytes = max_pending_bytes
        self.counters = {t.medium: TierCounters() for t in tiers}
        self.dropped_writes = 0
        self._held: set[bytes] = set()
        self._lock = threading.Lock()
        self._events: list[ChunkStored | ChunkRemoved] = []
        self._pending_bytes = 0
        self._queue: queue.Queue[tuple[StoredKV, list[TierProvider], bool] | None] = queue.Queue()
        self._closed = False
        for tier in tiers:
            tier.on_evict = self._make_on_evict(tier.medium)
        self._writer = threading.Thread(target=self._write_loop, name="chunk-tier-writer", daemon=True)
        self._writer.start()
        # A program that never closes its engine still gets its computed entries written: the
        # writer is a daemon thread (it must not keep a process alive), so finish it at exit.
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---- loader thread (load) and engine thread ----------------------------------------------

    def load(self, key: bytes, token_ids: tuple[tuple[int, ...], ...]) -> tuple[StoredKV, str] | None:
        """The entry and the medium it came from, or None when no tier holds it."""
        name = tier_key(self.model, key, len(token_ids[-1]))
        for i, tier in enumerate(self.tiers):
            counters = self.counters[tier.medium]
            start = time.perf_counter()
            blob = tier.load(name)
            kv = None
            if blob is not None:
                try:
                    kv = decode(blob)
                except CorruptEntry as e:
                    counters.corrupt += 1
                    logger.warning("%s tier: entry %s is corrupt (%s); deleted", tier.medium, name, e)
                    tier.evict(name)
                if kv is not None and tier_key(kv.model, kv.key, kv.num_tokens) != name:
                    # A sound entry under another entry's name (copied or renamed by hand) would
                    # be a miss for ever, and never rewritten: deleted, the next fill writes it.
                    counters.misnamed += 1
                    logger.warning("%s tier: entry %s holds another entry; deleted", tier.medium, name)
                    tier.evict(name)
                    kv = None
            if kv is None or not self._belongs(kv, key, token_ids):
                counters.misses += 1
                continue
            counters.hits += 1
            counters.bytes_loaded += len(blob or b"")
            counters.observe_load(time.perf_counter() - start)
            with self._lock:
                self._held.add(key)
            if i > 0:
                self._enqueue(kv, self.tiers[:i])
            return kv, tier.medium
        return None

    def _belongs(self, kv: StoredKV, key: bytes, token_ids: tuple[tuple[int, ...], ...]) -> bool:
        """This model's entry for exactly these tokens, in this engine's KV layout."""
        if kv.model != self.model or kv.key != key or kv.token_ids != token_ids:
            return False
        if self.kv_layout is None:
            return True
        layers, heads, dim, dtype = self.kv_layout
        shape = (layers, len(token_ids[-1]), heads, dim)
        if kv.sensitivity is not None and tuple(kv.sensitivity.shape) != shape[1:2]:
            return False
        return tuple(kv.k.shape) == shape == tuple(kv.v.shape) and kv.k.dtype == dtype == kv.v.dtype

    def store(self, kv: StoredKV, replace: bool = False) -> None:
        """Write a computed entry down to every tier, in the background; with `replace`, also
        over the copies the tiers hold (the entry has learned something: its sensitivity)."""
        self._enqueue(kv, self.tiers, replace)

    def holds(self, key: bytes) -> bool:
        with self._lock:
            return key in self._held

    def drain_events(self) -> list[ChunkStored | ChunkRemoved]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def state_events(self) -> list[ChunkStored]:
        """A ChunkStored per tier that can list its entries of this model (the disk tier), for a
        subscriber that lost its state."""
        events = []
        for tier in self.tiers:
            names = tier.names()
            if names is None:
                continue
            parsed = [p for p in map(parse_tier_key, names) if p is not None and p[0] == self.model[:16]]
            if parsed:
                events.append(
                    ChunkStored([to_wire(k) for _, _, k in parsed], [n for _, n, _ in parsed], tier.medium)
                )
        return events

    def stats(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for tier in self.tiers:
            c = self.counters[tier.medium]
            out[tier.medium.lower()] = {
                **tier.stats(),
                "hits": c.hits,
                "misses": c.misses,
                "corrupt": c.corrupt,
                "stores": c.stores,
                "store_failures": c.store_failures,
                "misnamed": c.misnamed,
                "bytes_loaded": c.bytes_loaded,
                "bytes_stored": c.bytes_stored,
                "load_seconds_sum": c.load_seconds_sum,
                "load_seconds_buckets": list(c.load_seconds_buckets),
            }
        return out

    def check_integrity(self) -> None:
        with self._lock:
            assert 0 <= self._pending_bytes <= self.max_pending_bytes, "pending write bytes drifted"
        for tier in self.tiers:
            tier.check_integrity()

    # ---- any thread --------------------------------------------------------------------------

    def flush(self) -> None:
        """Return once every write queued so far is done."""
        self._queue.join()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join()
        for tier in self.tiers:
            tier.close()

    # ---- writer thread -----------------------------------------------------------------------

    def _enqueue(self, kv: StoredKV, tiers: list[TierProvider], replace: bool = False) -> None:
        with self._lock:
            if self._closed or self._pending_bytes + kv.nbytes > self.max_pending_bytes:
                self.dropped_writes += 1
                return
            self._pending_bytes += kv.nbytes
            self._held.add(kv.key)
        self._queue.put((kv, tiers, replace))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # a bug in one write must not stop every later one
                logger.exception("chunk tier writer: a write failed")
            finally:
                if item is not None:
                    with self._lock:
                        self._pending_bytes -= item[0].nbytes
                self._queue.task_done()

    def _write(self, kv: StoredKV, tiers: list[TierProvider], replace: bool) -> None:
        name = tier_key(self.model, kv.key, kv.num_tokens)
        blob: bytes | None = None
        complete = True
        for tier in tiers:
            counters = self.counters[tier.medium]
            if not replace and tier.contains(name):
                continue
            blob = blob if blob is not None else encode(kv)
            if tier.store(name, blob):
                counters.stores += 1
                counters.bytes_stored += len(blob)
                event = ChunkStored([to_wire(kv.key)], [kv.num_tokens], tier.medium)
                with self._lock:
                    self._events.append(event)
            else:
                counters.store_failures += 1
                complete = False
        if not complete:  # a later pool eviction tries again
            with self._lock:
                self._held.discard(kv.key)

    def _make_on_evict(self, medium: str) -> Callable[[str], None]:
        def on_evict(name: str) -> None:
            parsed = parse_tier_key(name)
            if parsed is None or parsed[0] != self.model[:16]:
                return
            with self._lock:
                self._held.discard(parsed[2])
                self._events.append(ChunkRemoved([to_wire(parsed[2])], medium))

        return on_evict


def _close_at_exit(ref: weakref.ref[TierStack]) -> None:
    stack = ref()
    if stack is not None:
        stack.close()
