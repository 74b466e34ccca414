"""The local disk tier: one safetensors file per entry in one directory, LRU within a byte budget.

- Files are written to a temporary name and renamed, so a reader (or a restart) never sees half a
  file under an entry's name; a crash leaves only `*.tmp` files, removed at start-up.
- The index (name -> size, least recently used first) is rebuilt at start-up from the directory,
  ordered by modification time; a load touches the file, so the order survives a restart.
- Several engines may share the directory: a name missing from the index is looked up on disk.
- Over the budget, the least recently used files go first. An entry larger than the whole budget
  is never written. A failed write for lack of space (ENOSPC, EDQUOT) or permission (a directory
  that is or turns read-only: EROFS, EACCES, EPERM) stops all writing: it is logged once and shown
  in `stats()["writes_stopped"]`; loads go on, so a read-only directory is served read-only, from
  start-up or from the moment it turned read-only. Failed reads are counted (`read_errors`).
- Only regular files named as tier keys are entries: symlinks (which could point anywhere), other
  files and directories in the directory are left alone and never read.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from chunkcache.chunk.tiers.provider import TierProvider, parse_tier_key
from chunkcache.kv_events import MEDIUM_DISK

logger = logging.getLogger(__name__)
SUFFIX = ".safetensors"
# Write failures that every later write would repeat: out of space, or not allowed to write.
_STOPS_WRITING = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


def _is_entry_file(path: Path) -> bool:
    """A regular file (not a symlink) named `<tier key>.safetensors`."""
    if not path.name.endswith(SUFFIX) or parse_tier_key(path.name[: -len(SUFFIX)]) is None:
        return False
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _touch(path: Path) -> None:
    # The clock in nanoseconds: a file system's own timestamps can be a whole tick coarse, and
    # entries written within one tick would lose their order at the next start-up.
    now = time.time_ns()
    os.utime(path, ns=(now, now))


class DiskTier(TierProvider):
    medium = MEDIUM_DISK

    def __init__(self, directory: str, budget_bytes: int) -> None:
        self.dir = Path(directory)
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # front = least recently used
        self.used_bytes = 0
        self.writes_stopped: str | None = None  # why, once writing stopped
        self.too_large = 0
        self.write_errors = 0
        self.read_errors = 0
        self.evictions = 0
        self._check_directory(directory)
        self._rebuild_index()

    def _check_directory(self, directory: str) -> None:
        """A directory that cannot be read is an error; one that cannot be written is served
        read-only (its entries are still worth loading)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            os.listdir(self.dir)
        except OSError as e:
            raise ValueError(f"chunk_cache_disk_dir {directory!r} is not a readable directory: {e}") from None
        probe = self.dir / f".probe.{os.getpid()}.tmp"
        try:
            with open(probe, "wb"):
                pass
            probe.unlink()
        except OSError as e:
            self._stop_writing(
                f"{directory} is not writable ({e.strerror or e}): serving its entries read-only"
            )

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def _stop_writing(self, why: str) -> None:
        if self.writes_stopped is None:
            self.writes_stopped = why
            logger.error("disk tier %s: %s; the tier stops writing and goes on serving loads", self.dir, why)

    def _unlink(self, path: Path) -> None:
        """Delete a file; a failure is counted and logged, never raised (the tier keeps serving)."""
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            self.write_errors += 1
            if e.errno in _STOPS_WRITING:
                self._stop_writing(f"{os.strerror(e.errno)} deleting {path.name}")
            else:
                logger.warning("disk tier %s: deleting %s failed: %s", self.dir, path.name, e)

    def _rebuild_index(self) -> None:
        found: list[tuple[int, str, int]] = []
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp") and self.writes_stopped is None and not path.is_symlink():
                self._unlink(path)  # a write cut short by a crash
            elif _is_entry_file(path):
                st = path.lstat()
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
            if self.writes_stopped is None:  # read-only: the file stays, only the index forgets it
                self._unlink(self._path(key))
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
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self.write_errors += 1
            if e.errno in _STOPS_WRITING:
                self._stop_writing(f"{os.strerror(e.errno)} writing {tmp.name}")
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
            # O_NOFOLLOW: an entry is a regular file of this directory, never what a symlink names.
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:
            self._forget(key)
            self.read_errors += 1
            logger.warning("disk tier %s: reading %s failed: %s", self.dir, key, e)
            return None
        if self.writes_stopped is None:
            try:
                _touch(path)  # recency on disk, so that the LRU order survives a restart
            except OSError as e:  # the directory turned read-only: the load still counts
                if e.errno in _STOPS_WRITING:
                    self._stop_writing(f"{os.strerror(e.errno)} touching {path.name}")
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
            return key in self._index or _is_entry_file(self._path(key))

    def evict(self, key: str) -> None:
        if self.writes_stopped is None:
            self._unlink(self._path(key))
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
                "read_errors": self.read_errors,
                "writes_stopped": int(self.writes_stopped is not None),
            }

    def check_integrity(self) -> None:
        with self._lock:
            assert self.used_bytes == sum(self._index.values()), "disk tier byte count drifted"
            assert self.used_bytes <= self.budget_bytes, "disk tier over its budget"
