"""Every environment variable chunkcache reads, read here and nowhere else.

Each variable maps onto a flat engine option (see `config.EngineConfig.from_options`); the seeds'
`VLLM_*` names are accepted as aliases. Explicit options always win over the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


# option name -> (parser, env var names in order of precedence)
_ENV_OPTIONS: dict[str, tuple[Callable[[str], Any], tuple[str, ...]]] = {
    "enable_chunk_cache": (_bool, ("CHUNKCACHE_ENABLE_CHUNK_CACHE", "VLLM_ENABLE_CHUNK_CACHE")),
    "chunk_cache_size_gb": (float, ("CHUNKCACHE_CHUNK_CACHE_SIZE_GB", "VLLM_CHUNK_CACHE_SIZE_GB")),
    "chunk_cache_lru_threshold": (
        float,
        ("CHUNKCACHE_CHUNK_CACHE_LRU_THRESHOLD", "VLLM_CHUNK_CACHE_LRU_THRESHOLD"),
    ),
    "chunk_cache_hash_algorithm": (
        str,
        ("CHUNKCACHE_CHUNK_CACHE_HASH_ALGORITHM", "VLLM_CHUNK_CACHE_HASH_ALGORITHM"),
    ),
    "chunk_cache_disk_dir": (str, ("CHUNKCACHE_CHUNK_CACHE_DISK_DIR",)),
    "chunk_cache_disk_gb": (float, ("CHUNKCACHE_CHUNK_CACHE_DISK_GB",)),
    "chunk_cache_remote": (str, ("CHUNKCACHE_CHUNK_CACHE_REMOTE",)),
    "chunk_separator": (str, ("CHUNKCACHE_CHUNK_SEPARATOR",)),
    "chunk_layout": (str, ("CHUNKCACHE_CHUNK_LAYOUT",)),
    "kv_cache_memory_gb": (float, ("CHUNKCACHE_KV_CACHE_MEMORY_GB",)),
    "kv_events_endpoint": (str, ("CHUNKCACHE_KV_EVENTS_ENDPOINT",)),
    "hash_seed": (str, ("PYTHONHASHSEED",)),
    "threads": (int, ("CHUNKCACHE_THREADS",)),
    "require_kernels": (_bool, ("CHUNKCACHE_REQUIRE_KERNELS",)),
}


def env_names(option: str) -> tuple[str, ...]:
    """The environment variables that set a flat engine option, in order of precedence."""
    entry = _ENV_OPTIONS.get(option)
    return entry[1] if entry is not None else ()


def env_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Engine options found in the environment, parsed; a malformed value raises naming the variable."""
    environ = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for option, (parse, names) in _ENV_OPTIONS.items():
        for name in names:
            raw = environ.get(name)
            if raw is None or raw == "":
                continue
            try:
                found[option] = parse(raw)
            except ValueError as e:
                raise ValueError(f"environment variable {name}={raw!r} is invalid: {e}") from None
            break
    return found


def hf_home() -> str | None:
    """Where huggingface_hub caches models (it reads HF_HOME itself; we only report it)."""
    return os.environ.get("HF_HOME")


def omp_num_threads() -> str | None:
    """OMP_NUM_THREADS as set (torch applies it at start-up); the engine's `threads` default leaves it be."""
    return os.environ.get("OMP_NUM_THREADS") or None


def model_dir() -> str:
    """Where known models' joined files are kept (chunkcache.model.catalog)."""
    return os.environ.get("CHUNKCACHE_MODEL_DIR") or os.path.join("~", ".cache", "chunkcache", "models")


def fidelity_dir() -> str:
    """The folder of fidelity profiles named by model identity: where `chunkcache calibrate` writes
    and where an engine with `fidelity_target` and no `fidelity_profile` looks."""
    default = os.path.join("~", ".cache", "chunkcache", "fidelity")
    return os.environ.get("CHUNKCACHE_FIDELITY_DIR") or default


def kernel_dir() -> str:
    """Where the C kernels compiled at first use are cached, by source hash (model/kernels/build.py)."""
    default = os.path.join("~", ".cache", "chunkcache", "kernels")
    return os.environ.get("CHUNKCACHE_KERNEL_DIR") or default


def c_compiler() -> str:
    """The C compiler the kernels are built with (`CC`, as make reads it; default `cc`)."""
    return os.environ.get("CC") or "cc"


def log_level() -> str:
    return os.environ.get("CHUNKCACHE_LOG_LEVEL", "INFO").upper()
