"""The local disk tier: one safetensors file per entry in one directory, LRU within a byte budget.

- Files are written to a temporary name and renamed, so a reader (or a restart) never sees half a
  file under an entry's name; a crash leaves only `*.tmp` files, removed at start-up.
- The index (name -> size, least recently used first) is rebuilt at start-up from the directory,
  ordered by modification time; a load touches the file, so the order survives a restart.
- Several engines may share the directory: a name missing from the index is looked up on disk.
- Over the budget, the least recently used files go first. An entry larger than the whole budget
  is never written. A failed write for lack of space (ENOSPC, EDQUOT) stops all writing: it is
  logged once and shown in `stats()["writes_stopped"]`; loads go on.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from chunkcache.chunk.tiers.provider import TierProvider
from chunkcache.kv_events import MEDIUM_DISK

logger = logging.getLogger(__name__)
SUFFIX = ".safetensors"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _touch(path: Path) -> None:
    # The clock in nanoseconds: a file system's own timestamps can be a whole tick coarse, and
    # entries written within one tick would lose their order at the next start-up.
    now = time.time_ns()
    os.utime(path, ns=(now, now))


class DiskTier(TierProvider):
    medium = MEDIUM_DISK

    def __init__(self, directory: str, budget_bytes: int) -> None:
        self.dir = Path(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"chunk_cache_disk_dir {directory!r} is not a writable directory: {e}") from None
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # front = least recently used
        self.used_bytes = 0
        self.writes_stopped: str | None = None  # why, once writing stopped
        self.too_large = 0
        self.write_errors = 0
        self.evictions = 0
        self._rebuild_index()

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def _rebuild_index(self) -> None:
        found: list[tuple[int, str, int]] = []
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write cut short by a crash
            elif path.name.endswith(SUFFIX) and path.is_file():
                st = path.stat()
                found.append((st.st_mtime_ns, path.name[: -len(SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used_bytes += size
        with self._lock:
            self._evict_until(self.budget_bytes)
        logger.info(
            "disk tier %s: %d entries, %.1f MiB of %.1f MiB",
            self.dir,
            len(self._index),
            self.used_bytes / 2**20,
            self.budget_bytes / 2**20,
        )

    def _evict_until(self, limit: int) -> None:
        while self.used_bytes > limit and self._index:
            key, size = self._index.popitem(last=False)
            self.used_bytes -= size
            self._path(key).unlink(missing_ok=True)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(key)

    def store(self, key: str, blob: bytes) -> bool:
        if self.writes_stopped is not None:
            return False
        if len(blob) > self.budget_bytes:
            self.too_large += 1
            logger.warning(
                "disk tier: an entry of %d bytes exceeds the whole budget (%d bytes); not written",
                len(blob),
                self.budget_bytes,
            )
            return False
        with self._lock:
            if key in self._index:  # replaced (the entry learned its sensitivity): evicted last
                self._index.move_to_end(key)
            self._evict_until(self.budget_bytes - len(blob) + self._index.get(key, 0))
        tmp = self.dir / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
            _touch(self._path(key))
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.write_errors += 1
            if e.errno in _NO_SPACE:
                self.writes_stopped = f"{os.strerror(e.errno)} writing {tmp.name}"
                logger.error("disk tier %s: %s; the tier stops writing", self.dir, self.writes_stopped)
            else:
                logger.warning("disk tier %s: writing %s failed: %s", self.dir, key, e)
            return False
        with self._lock:
            # A load may have indexed the file meanwhile (another engine wrote it): count it once.
            self.used_bytes += len(blob) - self._index.get(key, 0)
            self._index[key] = len(blob)
        return True

    def load(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
            _touch(path)  # recency on disk, so that the LRU order survives a restart
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:
            logger.warning("disk tier %s: reading %s failed: %s", self.dir, key, e)
            return None
        with self._lock:
            if key not in self._index:  # written by another engine sharing the directory
                self._index[key] = len(data)
                self.used_bytes += len(data)
                self._evict_until(self.budget_bytes)
            else:
                self._index.move_to_end(key)
        return data

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index or self._path(key).is_file()

    def evict(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
        self._forget(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.used_bytes -= size

    def names(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "entries": len(self._index),
                "bytes": self.used_bytes,
                "budget_bytes": self.budget_bytes,
                "evictions": self.evictions,
                "too_large": self.too_large,
                "write_errors": self.write_errors,
                "writes_stopped": int(self.writes_stopped is not None),
            }

    def check_integrity(self) -> None:
        with self._lock:
            assert self.used_bytes == sum(self._index.values()), "disk tier byte count drifted"
            assert self.used_bytes <= self.budget_bytes, "disk tier over its budget"
