"""How glibc's malloc keeps the memory a CPU step frees (engines on CPU).

A prefill allocates activations of tens of MB per layer ([T, intermediate] for T = 2,000 tokens is
12-25 MB on SmolLM2-135M) and frees them a moment later. glibc's defaults hand such blocks back to
the kernel: above its (adaptive) mmap threshold a block is its own mapping, unmapped on free, and a
heap whose free top grows past twice that threshold is trimmed. The next layer's allocation then
faults every page in again, zero-filled by the kernel: 24k-187k page faults per 2,000-token prefill
here, 0.1-0.5 s of system time, ~5% of its CPU time (benchmarks/RESULTS.md "bench_host_memory";
benchmarks/history/RESULTS-narrative.md "Host memory and RoPE"). Serving wants the opposite trade:
keep the step's peak mapped, as a GPU server keeps its memory.

`keep_freed_memory()` sets glibc's malloc (`mallopt`) for the whole process, once:
- blocks up to 32 MB (glibc's largest mmap threshold on 64-bit) come from the heap, and up to
  1 GiB of free heap is kept instead of trimmed; larger blocks still map and unmap;
- one arena: a thread's own arena (the server steps the engine on a thread of its own) is made of
  64 MB heaps that glibc unmaps whenever one falls empty, whatever the trim threshold. This holds
  for threads that first allocate after the call, so engines call it before they start any.
The cost is that a process's resident memory stays at its peak instead of falling back after a
long prompt, and threads allocating at once share one lock (the engine's steps are one thread).
Elsewhere (musl, macOS, Windows) it does nothing.

`release_freed_memory()` (glibc's `malloc_trim(0)`) is the other half, called once after a
model's load: loading reads, converts and frees tensors in the heap, and the free pages between
the blocks still in use stay resident under any trim threshold (only the heap's top is trimmed).
It returned 0.24 GB of Qwen2.5-Coder-1.5B's native load (2.02 -> 1.78 GB) and 0.14 GB of
SmolLM2's (benchmarks/history/RESULTS-narrative.md, "Where a server's memory goes").
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import platform

import torch

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30

_applied = False


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the kernel (`malloc_trim(0)`: the middle of the heap too,
    by madvise); returns whether any were. Not in a step: it walks the whole heap."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see the module docstring); returns whether they are
    set. Idempotent: the thresholds are process-wide, so later engines find them set."""
    global _applied
    if _applied:
        return True
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success, 0 when glibc rejects a value.
    ok = all(
        libc.mallopt(param, value) == 1
        for param, value in (
            (_M_ARENA_MAX, 1),
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        )
    )
    if not ok:
        logger.warning("mallopt rejected a setting: freed activations may go back to the kernel")
    _applied = ok
    return ok


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
# Weights from this size are placed in huge pages (`huge_page_empty`); smaller ones stay on the heap.
HUGE_PAGE_MIN_BYTES = 64 << 10
# The mappings weights are placed in, one after another; a larger weight gets one of its own.
ARENA_BYTES = 64 << 20
_ALIGN = 64  # bytes between consecutive weights' starts: a cache line


class _Arena:
    """The current mapping weights are placed in and how much of it is taken."""

    region: mmap.mmap | None = None
    start = 0  # the first 2 MB aligned byte of it
    taken = 0


_arena = _Arena()


def _placed(nbytes: int) -> bool:
    """Whether a weight of `nbytes` goes to huge pages (`huge_page_empty`)."""
    return nbytes >= HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE")


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous private mapping of at least `nbytes` from a 2 MB boundary, advised for
    transparent huge pages: the mapping and that boundary's offset in it."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return region, start


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor for a weight the model holds as long as it lives, in memory
    advised for transparent huge pages (`madvise(MADV_HUGEPAGE)`, which the kernel's default
    `madvise` mode honours), where it is `HUGE_PAGE_MIN_BYTES` or more and the platform has them;
    else `torch.empty`. Weights are placed one after another in mappings of `ARENA_BYTES` (a
    larger one in its own), so only each mapping's last huge page is partly used: a mapping of
    its own per weight held ~1 MB more resident per weight (the 1.5B's 113: +0.1 GB).

    A batch-1 decode step streams every weight once, one core at ~10 GB/s: with 4 KB pages each 4 KB
    costs a TLB miss and a page walk. The weights a load builds came from glibc's heap (blocks under
    its 32 MB mmap threshold, `keep_freed_memory`), in 4 KB pages: 0.2 of the 1.5B's 1.1 GB sat in
    huge pages. On the AMX Xeon the 1.5B's Q4_K gate product out of cache took 0.83 ms from 4 KB
    pages, 0.72 from huge ones, and its decode 123 -> 103-105 ms a token
    (benchmarks/history/RESULTS-narrative.md, "the GGUF's own blocks on the AMX Xeon"). A mapping
    lives as long as any tensor in it (torch.frombuffer holds it): only weights go here, never
    transient tensors."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not _placed(nbytes):
        return torch.empty(shape, dtype=dtype)
    if nbytes > ARENA_BYTES:
        region, start = _mapping(nbytes)
    else:
        if _arena.region is None or _arena.taken + nbytes > ARENA_BYTES:
            _arena.region, _arena.start = _mapping(ARENA_BYTES)
            _arena.taken = 0
        region, start = _arena.region, _arena.start + _arena.taken
        _arena.taken += -(-nbytes // _ALIGN) * _ALIGN
    return torch.frombuffer(memoryview(region)[start : start + nbytes], dtype=dtype).view(shape)


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` (CPU, a weight held as long as the model) copied into `huge_page_empty`'s memory where
    that is huge pages; else `t` itself."""
    if not _placed(t.numel() * t.element_size()):
        return t
    return huge_page_empty(tuple(t.shape), t.dtype).copy_(t)
