"""The one factory of offline engines on a checkpoint, for tests that compare against oracles.

Each test module binds its own defaults with `functools.partial` (a layout, a larger KV cache);
a test overrides any of them by keyword. CPU and float32 because the `transformers` oracles run
in float32 (`dtype="auto"` is bfloat16 on CPUs with native bf16).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chunkcache import LLM


def tiny_llm(
    path: Path | str,
    *,
    kv_cache_tokens: int = 2048,
    chunk_cache_size_gb: float | None = 0.001,
    dtype: str = "float32",
    **options: Any,
) -> LLM:
    """An `LLM` on `path` with small caches (so that eviction and "every block is free again"
    checks are cheap to reach); `chunk_cache_size_gb=None` keeps the engine's default pool."""
    if chunk_cache_size_gb is not None:
        options["chunk_cache_size_gb"] = chunk_cache_size_gb
    return LLM(str(path), device="cpu", dtype=dtype, kv_cache_tokens=kv_cache_tokens, **options)
