"""The chunk pool's traffic with its lower tiers: loads in, write-through and demotion out.

The pool's entries live in pages of the engine's KV tensors; the tiers keep CPU copies
(`StoredKV`). This is the one place that copies between the two: a finished load is scattered
into its entry's pages (promotion), a computed entry is gathered and written down at once
(write-through, chunk/manager.py calls `store`), and an entry the pool evicts is written down
unless a tier already holds it (demotion, the pool's `on_evict`). What an entry *means* to the
requests waiting for it (ready, a fill job on a miss, dropped when nobody waits) stays with the
manager; this module only moves bytes and knows which loads are pending.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from chunkcache.chunk.pool import ChunkPool
from chunkcache.chunk.tiers.loader import TierLoader
from chunkcache.chunk.tiers.provider import StoredKV
from chunkcache.chunk.tiers.stack import TierStack
from chunkcache.core.kv_slots import gather_kv, scatter_kv
from chunkcache.core.plan import Entry


class PoolTiers:
    def __init__(
        self,
        tiers: TierStack,
        pool: ChunkPool,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slots: Callable[[Entry], torch.Tensor],
    ) -> None:
        """`slots`: an entry's KV slots in `kv_caches` (the manager's, which assembles from them)."""
        assert kv_caches, "lower tiers need the KV tensors to copy entries in and out"
        self.tiers, self.kv_caches, self.slots = tiers, kv_caches, slots
        self.loader = TierLoader(tiers)
        pool.on_evict = self._demote

    # ---- in --------------------------------------------------------------------------------

    def load(self, entry: Entry, token_ids: tuple[tuple[int, ...], ...], context: Any) -> None:
        """Ask the tiers for `entry` (its pool pages held, not ready) on the loader thread."""
        entry.loading = True
        self.loader.start(entry, token_ids, context)

    def finished(self) -> list[tuple[Entry, Any, bool]]:
        """The loads that ended: (entry, its context, found). A found entry's KV is in its pages
        now (not marked ready: the manager does that); a miss's pages hold nothing."""
        out = []
        for load, found in self.loader.finished():
            entry: Entry = load.entry
            entry.loading = False
            if found is not None:
                kv = found[0]
                scatter_kv(self.kv_caches, self.slots(entry), kv.k, kv.v)
                entry.sensitivity = kv.sensitivity
                entry.from_tier = True
            out.append((entry, load.context, found is not None))
        return out

    def wait(self, timeout: float) -> None:
        """Sleep until a load ends (at most `timeout` s): for an engine with nothing else to run."""
        self.loader.wait(timeout)

    def __len__(self) -> int:
        return len(self.loader)

    def __contains__(self, entry: Entry) -> bool:
        return entry in self.loader

    # ---- out -------------------------------------------------------------------------------

    def store(self, entry: Entry, replace: bool = False) -> None:
        """Write a computed entry down to every tier (in the background; `replace`: over a copy
        they hold, e.g. one without the sensitivity measured since)."""
        self.tiers.store(self._read_kv(entry), replace=replace)

    def _demote(self, entry: Entry) -> None:
        if not self.tiers.holds(entry.key):
            self.tiers.store(self._read_kv(entry))

    def _read_kv(self, entry: Entry) -> StoredKV:
        """A CPU copy of a pool entry's KV (and its sensitivity, if measured)."""
        k, v = gather_kv(self.kv_caches, self.slots(entry))
        return StoredKV(self.tiers.model, entry.key, entry.kind, entry.token_ids, k, v, entry.sensitivity)

    def close(self) -> None:
        """Stop loading; finish the tiers' pending writes and close them."""
        self.loader.close()
        self.tiers.close()
