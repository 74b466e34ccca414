"""Host memory on CPU: activations freed by one step are not faulted in again by the next
(keep_freed_memory), and the paged KV blocks are mapped before the first request while the chunk
pool is mapped as entries arrive (ModelRunner's committed slots)."""

from __future__ import annotations

import ctypes
import json
import mmap
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chunkcache import LLM
from chunkcache.malloc import MMAP_THRESHOLD

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only"
)

# A prefill's pattern: many blocks of a few MB allocated, written and freed together, twice; the
# page faults of the second round are counted. A fresh interpreter, so that glibc's defaults hold
# until keep_freed_memory() is called.
_CHILD = """
import json, resource, torch
from chunkcache.malloc import keep_freed_memory

def second_round_faults():
    counts = []
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.empty(2 << 20).fill_(1.0) for _ in range(12)]  # 12 x 8 MB
        del blocks
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return counts[1]

default = second_round_faults()
applied = keep_freed_memory()
second_round_faults()  # the heap grows to the peak once
kept = second_round_faults()
print(json.dumps({"default": default, "applied": applied, "kept": kept}))
"""


@pytest.mark.slow  # a child interpreter that imports torch and faults 96 MB
def test_freed_blocks_stay_mapped() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["applied"]
    # 96 MB of 4 KB pages is ~24k faults when glibc hands the blocks back to the kernel.
    assert result["default"] > 10_000, result
    assert result["kept"] < 500, result


# Load-time garbage: heap blocks freed between blocks still in use (every other one), so that no
# trim of the heap's top reaches them; RSS (kB) before and after release_freed_memory().
_TRIM_CHILD = """
import ctypes, json
from chunkcache.malloc import release_freed_memory

def rss_kb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
blocks = [libc.malloc(100_000) for _ in range(800)]  # 80 MB of heap, below the mmap threshold
for b in blocks:
    ctypes.memset(b, 1, 100_000)
for b in blocks[::2]:  # 40 MB of holes
    libc.free(b)
before = rss_kb()
released = release_freed_memory()
print(json.dumps({"before": before, "after": rss_kb(), "released": released}))
"""


def test_release_freed_memory_returns_heap_holes() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _TRIM_CHILD], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["released"], result
    assert result["before"] - result["after"] > 30_000, result  # most of the 40 MB of holes


def test_idempotent() -> None:
    from chunkcache.malloc import keep_freed_memory

    assert keep_freed_memory() is keep_freed_memory()


def _resident_share(t: torch.Tensor, start: int, end: int) -> float:
    """The share of the pages of t's bytes [start, end) that are mapped (mincore(2))."""
    page = mmap.PAGESIZE
    first = (t.data_ptr() + start + page - 1) // page * page
    last = (t.data_ptr() + end) // page * page
    pages = (last - first) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(last - first), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


def test_paged_kv_mapped_at_start_pool_on_demand(checkpoint) -> None:
    # A pool large enough that each layer's cache is a fresh mapping of its own (over malloc's
    # mmap threshold), never heap memory an earlier test freed and that is mapped already.
    llm = LLM(str(checkpoint()), device="cpu", dtype="float32", kv_cache_tokens=8192, chunk_cache_size_gb=1.0)
    engine = llm.engine
    paged = engine.blocks.num_blocks * engine.blocks.block_size
    for k_layer, v_layer in engine.runner.kv_caches:
        slot_bytes = k_layer[0].numel() * k_layer.element_size()
        assert k_layer.numel() * k_layer.element_size() > MMAP_THRESHOLD
        assert k_layer.shape[0] > paged  # the chunk pool's pages follow the paged blocks
        for t in (k_layer, v_layer):
            assert _resident_share(t, 0, paged * slot_bytes) == 1.0
            assert _resident_share(t, paged * slot_bytes, t.numel() * t.element_size()) < 0.1


def _region_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


def test_weights_go_to_huge_page_mappings() -> None:
    """`huge_page_copy`: the same values, cache-line aligned, one after another in one mapping
    advised for huge pages (THPeligible where the kernel's THP mode is not `never`: then a decode
    step's stream of the weight takes no 4 KB page walks); a weight larger than a mapping gets one
    of its own from a 2 MB boundary; alive as long as the tensors; small tensors stay as they
    are."""
    import gc

    from chunkcache.malloc import ARENA_BYTES, HUGE_PAGE, HUGE_PAGE_MIN_BYTES, huge_page_copy

    small = torch.arange(16, dtype=torch.uint8)
    assert huge_page_copy(small) is small
    sources = [
        torch.randint(0, 255, (HUGE_PAGE_MIN_BYTES // 1000 + 7, 1000), dtype=torch.uint8) for _ in range(2)
    ]
    sources.append(torch.randint(0, 255, (ARENA_BYTES // 1000 + 3, 1000), dtype=torch.uint8))
    expected = [t.clone() for t in sources]
    copies = [huge_page_copy(t) for t in sources]
    del sources  # the copies own their bytes
    gc.collect()
    first, second, large = copies
    assert all(torch.equal(c, e) for c, e in zip(copies, expected, strict=True))
    assert all(c.data_ptr() % 64 == 0 and c.is_contiguous() for c in copies)
    assert large.data_ptr() % HUGE_PAGE == 0
    regions = [_region_of(c.data_ptr()) for c in copies]
    if regions[0] == regions[1]:  # one mapping (unless the first filled the one before): adjacent
        assert second.data_ptr() - first.data_ptr() == -(-first.numel() // 64) * 64
    first[0, 0] = 3  # writable (a private mapping)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if "[never]" not in (thp.read_text() if thp.exists() else "[never]"):
        assert all(r["THPeligible"] == "1" for r in regions)
    assert all(r.get("Shared_Dirty", "0 kB") == "0 kB" for r in regions)
