"""The router's configuration (one frozen value, built by app.py's command line or by a caller)
and the KV index it names."""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkcache.config import DEFAULT_DOCUMENTS_FORMAT
from chunkcache.router.backends import BackendSpec
from chunkcache.router.discovery import DiscoveryConfig
from chunkcache.router.index import KVIndex, MemoryIndex
from chunkcache.router.policy import DEFAULT_CACHE_THRESHOLD
from chunkcache.router.redis_index import RedisIndex
from chunkcache.router.scorer import DEFAULT_TIER_WEIGHTS


def open_index(spec: str, capacity: int = 10_000_000, pods_per_key: int = 10) -> KVIndex:
    """`"memory"` or a `redis://host:port/db` URL (also `rediss://`, `unix://`)."""
    if spec == "memory":
        return MemoryIndex(capacity=capacity, pods_per_key=pods_per_key)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisIndex(spec, pods_per_key=pods_per_key)
    raise ValueError(f"index must be 'memory' or a redis:// URL, got {spec!r}")


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[BackendSpec, ...]
    model_name: str
    tokenizer: str | None = None  # a tokenizer dir or GGUF file; None when a processor is injected
    index: str = "memory"  # or redis://host:port/db
    index_capacity: int = 10_000_000
    pods_per_key: int = 10
    policy: str = "cache_aware"
    load_weight: float = 0.5
    # No backend holding this share of a prompt: it goes to the least loaded (policy.py).
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD
    tier_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    # Backends (pod ids) that share one remote chunk tier; None = all of them.
    remote_pods: tuple[str, ...] | None = None
    block_size: int = 16
    chunk_separator: str = " # # "
    chunk_hash_algorithm: str = "sha256"
    enable_chunks: bool = True
    # The engines' documents_format (chat `documents` are cut into chunks as the engines cut them).
    documents_format: str = DEFAULT_DOCUMENTS_FORMAT
    lora_names: tuple[str, ...] = ()  # request `model` values that name LoRA adapters
    events_bind: str | None = None  # one SUB socket that pods connect to
    events_topic_filter: str = ""
    event_workers: int = 4
    replay_timeout_s: float = 1.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    request_timeout_s: float = 600.0
    index_retry_s: float = 2.0  # after an index failure, skip the index this long
    seed: int | None = None
    # Required as 'Authorization: Bearer <key>' on every route but /health (and /metrics when
    # `open_metrics`); clients' Authorization headers are forwarded to the backends.
    api_key: str | None = None
    open_metrics: bool = False
    # ZMQ CURVE on the event and replay sockets (chunkcache/curve.py): the router's secret
    # certificate file, and a directory of the backends' public keys named `<pod>.key`.
    events_curve_secret_key: str | None = None
    events_curve_backend_keys: str | None = None
    # Bind `events_bind` on a non-loopback address without CURVE (anyone reaching it can forge events).
    events_insecure: bool = False
    # Sent as 'Authorization: Bearer' on the router's own calls to backends (state re-publishing);
    # None: the router's api_key.
    backend_api_key: str | None = None
    max_request_bytes: int = 4 * 2**20  # larger bodies: HTTP 413 before they are read
    # Serve FastAPI's /docs and /openapi.json (off: they describe the deployment to anyone).
    serve_docs: bool = False
    # Kubernetes pods as backends, beside the static ones (discovery.py).
    discovery: DiscoveryConfig | None = None
