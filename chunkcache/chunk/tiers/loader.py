"""Loads from the lower tiers off the engine thread.

A pool miss that a tier may answer becomes a *pending load*: its pool entry exists (pages held,
not ready) while a loader thread reads, decodes and verifies the entry (TierStack.load). The
engine thread collects finished loads between steps (`finished()`), so reading a disk file or a
Redis value never stalls the other requests' steps. One loader thread: loads are I/O and
checksums, and a second thread would only compete with the engine for the same cores.
"""

from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from chunkcache.chunk.tiers.provider import StoredKV
from chunkcache.chunk.tiers.stack import TierStack

logger = logging.getLogger(__name__)


@dataclass
class PendingLoad:
    entry: Any  # the pool Entry being loaded
    context: Any  # what the caller needs once the load ends (its fill job's inputs)
    future: Future[tuple[StoredKV, str] | None]


class TierLoader:
    def __init__(self, tiers: TierStack) -> None:
        self.tiers = tiers
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunk-tier-loader")
        self._pending: dict[int, PendingLoad] = {}  # id(entry) -> its load

    def start(self, entry: Any, token_ids: tuple[tuple[int, ...], ...], context: Any) -> None:
        future = self._pool.submit(self.tiers.load, entry.key, token_ids)
        self._pending[id(entry)] = PendingLoad(entry, context, future)

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, entry: Any) -> bool:
        return id(entry) in self._pending

    def finished(self) -> list[tuple[PendingLoad, tuple[StoredKV, str] | None]]:
        """The loads that ended since the last call, with what they found (None: a miss, or a
        load that failed, which is logged and then treated as a miss)."""
        out = []
        for key, load in list(self._pending.items()):
            if not load.future.done():
                continue
            del self._pending[key]
            try:
                found = load.future.result()
            except Exception:
                logger.exception("loading a chunk from the lower tiers failed; computing it instead")
                found = None
            out.append((load, found))
        return out

    def wait(self, timeout: float) -> None:
        """Sleep until a pending load ends, at most `timeout` seconds (instead of spinning)."""
        futures = [load.future for load in self._pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
