"""The chunk cache pool: content-keyed KV entries in their own byte budget, LRU-evicted.

Contract:
- The pool owns pages [first_page, first_page + num_pages) of the runner's KV tensors, each
  `page_size` token slots of `page_bytes`. Every page is free or belongs to exactly one entry.
- An entry is found by its key only if the token ids stored with it equal the caller's (a hash
  collision can never serve wrong KV).
- An entry is *ready* once its KV is computed. Only ready entries with no pins are evicted, least
  recently used first; eviction starts when usage passes `lru_threshold` of the budget, and to
  make room for a new entry. An entry larger than the whole budget is never admitted.
- `on_evict`, when set, sees each evicted entry while its pages still hold its KV (the manager
  demotes it to the lower tiers there).
- Storing and evicting entries are reported as ChunkStored / ChunkRemoved events, system parts
  too (their keys live in another hash domain), so a router can credit a replica for both.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from chunkcache.core.plan import Entry
from chunkcache.hashing import to_wire
from chunkcache.kv_events import ChunkRemoved, ChunkStored


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    evictions: int = 0
    uncacheable: int = 0

    def count(self, hit: bool, num_tokens: int) -> None:
        """One chunk entry looked up for a request: a hit or a miss, with its tokens."""
        if hit:
            self.hits += 1
            self.hit_tokens += num_tokens
        else:
            self.misses += 1
            self.miss_tokens += num_tokens


class ChunkPool:
    def __init__(
        self,
        first_page: int,
        num_pages: int,
        page_size: int,
        page_bytes: int,
        lru_threshold: float,
        medium: str,
    ) -> None:
        self.first_page = first_page
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.lru_threshold = lru_threshold
        self.medium = medium
        self._free: list[int] = list(range(first_page + num_pages - 1, first_page - 1, -1))
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # front = least recently used
        self.stats = PoolStats()
        self.events: list[ChunkStored | ChunkRemoved] = []
        self.on_evict: Callable[[Entry], None] | None = None

    @property
    def budget_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return (self.num_pages - len(self._free)) * self.page_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def get(self, key: bytes, token_ids: tuple[tuple[int, ...], ...]) -> Entry | None:
        """The entry under `key` with exactly these tokens (ready or still being computed)."""
        entry = self._entries.get(key)
        if entry is None or entry.token_ids != token_ids:
            return None
        self._entries.move_to_end(key)
        return entry

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def holds(self, entry: Entry) -> bool:
        """Whether `entry` is still this pool's (not evicted or dropped); no LRU touch."""
        return self._entries.get(entry.key) is entry

    def has_key(self, key: bytes) -> bool:
        return key in self._entries

    def create(
        self, key: bytes, kind: str, token_ids: tuple[tuple[int, ...], ...], num_tokens: int
    ) -> Entry | None:
        """A new, not yet ready entry with its pages, or None when it cannot fit even after eviction."""
        need = self.pages_for(num_tokens)
        if need > self.num_pages or key in self._entries:
            return None
        self._evict_until(lambda: len(self._free) >= need)
        if len(self._free) < need:
            return None
        entry = Entry(key, kind, token_ids, num_tokens, [self._free.pop() for _ in range(need)])
        self._entries[key] = entry
        return entry

    def mark_ready(self, entry: Entry) -> None:
        entry.ready = True
        self.events.append(ChunkStored([to_wire(entry.key)], [entry.num_tokens], self.medium))
        limit = self.lru_threshold * self.budget_bytes
        self._evict_until(lambda: self.used_bytes <= limit)

    def state_events(self) -> list[ChunkStored]:
        """A ChunkStored of every ready entry, for a subscriber that lost its state."""
        ready = [e for e in self._entries.values() if e.ready]
        if not ready:
            return []
        return [ChunkStored([to_wire(e.key) for e in ready], [e.num_tokens for e in ready], self.medium)]

    def drop(self, entry: Entry) -> None:
        """Remove an entry that will never become ready (its job was cancelled)."""
        assert not entry.ready and entry.pins == 0
        del self._entries[entry.key]
        self._free.extend(entry.pages)
        entry.pages = []

    def evict_all(self) -> int:
        """Evict every ready entry no request holds (each demoted through `on_evict`); returns how many."""
        before = self.stats.evictions
        self._evict_until(lambda: False)
        return self.stats.evictions - before

    def _evict_until(self, enough) -> None:  # type: ignore[no-untyped-def]
        for key in list(self._entries):
            if enough():
                return
            entry = self._entries[key]
            if entry.ready and entry.pins == 0:
                if self.on_evict is not None:
                    self.on_evict(entry)
                del self._entries[key]
                self._free.extend(entry.pages)
                entry.pages = []
                self.stats.evictions += 1
                self.events.append(ChunkRemoved([to_wire(key)], self.medium))

    def check_integrity(self) -> None:
        seen: set[int] = set(self._free)
        assert len(seen) == len(self._free), "a pool page is free twice"
        for key, entry in self._entries.items():
            assert entry.key == key and not entry.private
            assert entry.pins >= 0, f"entry pinned {entry.pins} times"
            assert len(entry.pages) == self.pages_for(entry.num_tokens)
            if entry.sensitivity is not None:
                assert entry.sensitivity.shape == (entry.num_tokens,), "sensitivity of another length"
            for page in entry.pages:
                assert page not in seen, f"pool page {page} is owned twice"
                seen.add(page)
        assert seen == set(range(self.first_page, self.first_page + self.num_pages)), "pool pages lost"
        assert self.used_bytes <= self.budget_bytes
