"""Prometheus metrics of one server, on a private registry (several servers can live in one
process, as in the tests, without clashing in prometheus_client's global registry).

Request latencies are observed by the engine thread as outputs come out of `step()`; engine state
(queue lengths, KV blocks, chunk pool) is read from `LLMEngine.stats()` at scrape time and exposed
through a collector, so the numbers are exactly those of the engine, never a shadow copy.

Two name sets: this project's (`chunkcache_*`; gauges never end in `_total`, 0-1 values end in
`_ratio`) and vLLM's (`vllm:*`, labelled `model_name` and `engine` as vLLM does), so that llm-d's
scheduler and vLLM dashboards read a chunkcache server unchanged. vLLM's names keep vLLM's meaning,
quirks included: `vllm:kv_cache_usage_perc` is a 0-1 fraction. Differences: `vllm:prefix_cache_*`
count prompt tokens of finished requests (vLLM counts at scheduling), and hits include tokens
served by the chunk cache, the second place this engine reuses KV from.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from chunkcache.chunk.tiers.stack import LOAD_BUCKETS
from chunkcache.engine.fusion import JOINT_DOCUMENT_BUCKETS, JOINT_MARGIN_BUCKETS
from chunkcache.outputs import RequestOutput


class TokenTimes(Protocol):
    """What the metrics read of a request's stream (engine_loop.RequestStream)."""

    arrival_time: float
    last_token_time: float | None


PREFIX = "chunkcache"
VLLM_PREFIX = "vllm:"
# vLLM's label names on every vllm:* metric; "engine" is the engine index (one engine here).
VLLM_LABELS = ("model_name", "engine")

# Seconds. Fine steps at the low end: a cached chunked prompt answers in milliseconds.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# The values of `LLMEngine.stats()["kernels"]` (engine/build.py's check_kernels), each a label.
KERNEL_KINDS = ("c", "torch")

# Cumulative engine counters among the chunk cache stats: exported as counters, the rest as gauges.
_CHUNK_COUNTERS = (
    "hits",
    "misses",
    "evictions",
    "blended_prefix_hits",
    "exact_prefix_hits",
    "exact_prefix_jobs",
)


class _EngineStatsCollector(Collector):
    """Exposes the last `LLMEngine.stats()` snapshot handed to `ServerMetrics.update_engine_stats`."""

    def __init__(self, vllm_labels: tuple[str, str]) -> None:
        self.stats: Mapping[str, Any] = {}
        self.vllm_labels = list(vllm_labels)

    def _vllm_gauge(self, name: str, doc: str, value: float) -> Metric:
        family = GaugeMetricFamily(f"{VLLM_PREFIX}{name}", doc, labels=VLLM_LABELS)
        family.add_metric(self.vllm_labels, value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        gauges = {
            "num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled."),
            "num_requests_running": ("num_running", "Requests being run."),
            "kv_blocks": ("kv_blocks_total", "KV cache blocks in the paged pool."),
            "kv_blocks_free": ("kv_blocks_free", "Free KV cache blocks."),
            "kv_cache_usage_ratio": ("kv_usage", "Share of KV cache blocks in use (0-1)."),
        }
        for name, (key, doc) in gauges.items():
            if stats.get(key) is not None:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(stats[key]))
        vllm_gauges = {
            "num_requests_running": ("num_running", "Number of requests in model execution batches."),
            "num_requests_waiting": ("num_waiting", "Number of requests waiting to be processed."),
            "kv_cache_usage_perc": ("kv_usage", "KV-cache usage. 1 means 100 percent usage."),
        }
        for name, (key, doc) in vllm_gauges.items():
            if stats.get(key) is not None:
                yield self._vllm_gauge(name, doc, float(stats[key]))
        if stats.get("kernels") is not None:
            kernels = GaugeMetricFamily(
                f"{PREFIX}_kernels",
                "Which kernels serve the CPU's quantized products: 1 for the serving kind, c (the "
                "built C library) or torch (its fallback, slower; the start-up log says why).",
                labels=["kind"],
            )
            for kind in KERNEL_KINDS:
                kernels.add_metric([kind], float(stats["kernels"] == kind))
            yield kernels
        if stats.get("num_preemptions") is not None:
            preemptions = CounterMetricFamily(
                f"{VLLM_PREFIX}num_preemptions",
                "Cumulative number of preemption from the engine.",
                labels=VLLM_LABELS,
            )
            preemptions.add_metric(self.vllm_labels, float(stats["num_preemptions"]))
            yield preemptions
            yield CounterMetricFamily(
                f"{PREFIX}_num_preemptions",
                "Requests preempted (KV freed, recomputed later).",
                value=float(stats["num_preemptions"]),
            )
        if stats.get("chunk_cache"):
            yield from _chunk_metrics(stats["chunk_cache"])


def _chunk_metrics(chunk: Mapping[str, Any]) -> Iterator[Metric]:
    """The chunk cache's counters and gauges, and its joint fusion, tiers and fidelity where present."""
    for key in _CHUNK_COUNTERS:
        if chunk.get(key) is not None:
            yield CounterMetricFamily(
                f"{PREFIX}_chunk_cache_{key}", f"Chunk cache {key} since start.", value=float(chunk[key])
            )
    chunk_gauges = {
        "bytes": "Bytes of KV held by the chunk cache pool.",
        "entries": "Chunks held by the chunk cache pool.",
        "usage_ratio": "Share of the chunk cache budget in use (0-1).",
        "hit_rate": "Chunk cache hits over lookups, counting chunks (0-1).",
        "token_hit_rate": "Chunk cache hits over lookups, counting tokens (0-1).",
    }
    # Exported names: every 0-1 value ends in _ratio.
    exported = {"hit_rate": "hit_ratio", "token_hit_rate": "token_hit_ratio"}
    for key, doc in chunk_gauges.items():
        if chunk.get(key) is not None:
            name = exported.get(key, key)
            yield GaugeMetricFamily(f"{PREFIX}_chunk_cache_{name}", doc, value=float(chunk[key]))
    if chunk.get("fusion_joint"):
        yield from _joint_metrics(chunk["fusion_joint"])
    if chunk.get("tiers"):
        yield from _tier_metrics(chunk["tiers"])
    if chunk.get("fidelity"):
        yield from _fidelity_metrics(chunk["fidelity"])


def _fidelity_metrics(fidelity: Mapping[str, Any]) -> Iterator[Metric]:
    """Shadow checks (fidelity/shadow.py) per reuse configuration, and the controller's moves."""
    checks = CounterMetricFamily(
        f"{PREFIX}_fidelity_checks",
        "Shadow checks of chunked requests against a full prefill, by configuration and result "
        "(agree, disagree: greedy replies; distribution: sampled replies; error, skipped; over_budget: "
        "drawn while checks took more than fidelity_max_share of the CPU).",
        labels=("config", "result"),
    )
    agreement = GaugeMetricFamily(
        f"{PREFIX}_fidelity_agreement",
        "Mean score of the last fidelity_window shadow checks (0-1), by configuration: a greedy reply "
        "scores 1 when identical to full prefill's, a sampled one prod(1 - total variation) over its "
        "first tokens' next-token distributions.",
        labels=("config",),
    )
    variation = GaugeMetricFamily(
        f"{PREFIX}_fidelity_total_variation",
        "Sampled replies' shadow checks: mean total variation between the served and full prefill's "
        "next-token distributions per token compared (0-1), by configuration.",
        labels=("config",),
    )
    for name, counts in fidelity["configs"].items():
        for result in ("agree", "disagree", "distribution", "error", "skipped", "over_budget"):
            checks.add_metric((name, result), float(counts.get(result, 0)))
        if counts.get("agreement") is not None:
            agreement.add_metric((name,), float(counts["agreement"]))
        if counts.get("total_variation") is not None:
            variation.add_metric((name,), float(counts["total_variation"]))
    yield checks
    yield agreement
    yield variation
    moves = CounterMetricFamily(
        f"{PREFIX}_fidelity_moves",
        "Moves of the fidelity controller between the profile's configurations, by direction.",
        labels=("direction",),
    )
    for direction, n in fidelity["moves"].items():
        moves.add_metric((direction,), float(n))
    yield moves
    yield CounterMetricFamily(
        f"{PREFIX}_fidelity_dropped_checks",
        "Sampled requests not checked because the shadow queue was full.",
        value=float(fidelity["dropped"]),
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_fidelity_pending_checks",
        "Shadow checks queued or running.",
        value=float(fidelity["pending"]),
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_fidelity_shadow_cpu_share",
        "Shadow checks' share of the CPU time of the engine's steps so far (capped near fidelity_max_share).",
        value=float(fidelity["cpu_share"]),
    )


# Per lower tier (chunkcache/chunk/tiers/), labelled tier="disk" | "remote".
_TIER_COUNTERS = {
    "hits": "Lookups this tier answered.",
    "misses": "Lookups this tier could not answer.",
    "corrupt": "Entries found corrupt (checksum, truncation) and deleted.",
    "stores": "Entries written to this tier.",
    "store_failures": "Writes this tier refused or failed (budget, disk full, backend down).",
    "bytes_loaded": "Bytes read from this tier.",
    "bytes_stored": "Bytes written to this tier.",
    "evictions": "Entries this tier evicted to stay within its budget.",
    "unavailable": "Calls skipped or failed because the remote store was down.",
    "read_errors": "Reads of an entry that failed (I/O error, permission, a symlink in its place).",
    "write_errors": "Writes and deletions of an entry that failed.",
    "misnamed": "Sound entries found under another entry's name, and deleted.",
}
_TIER_GAUGES = {
    "entries": "Entries held by this tier.",
    "bytes": "Bytes held by this tier.",
    "budget_bytes": "Byte budget of this tier.",
    "writes_stopped": "1 when this tier stopped writing (disk full or read-only); it still serves loads.",
    "up": "1 when the remote store answers, 0 while it is down.",
}


def _histogram(name: str, doc: str, bounds: tuple[float, ...], counts: list[int], total: float) -> Metric:
    """A histogram family from per-bucket counts (the last beyond every bound), made cumulative."""
    family, seen, buckets = HistogramMetricFamily(name, doc), 0, []
    for bound, n in zip([*bounds, float("inf")], counts, strict=True):
        seen += n
        buckets.append(("+Inf" if bound == float("inf") else str(bound), float(seen)))
    family.add_metric([], buckets, float(total))
    return family


def _joint_metrics(joint: Mapping[str, Any]) -> Iterator[Metric]:
    """Layout fusion's joint stream per request (engine/fusion.py JointStats)."""
    yield _histogram(
        f"{PREFIX}_fusion_joint_documents",
        "Documents the joint stream of a fusion request read (1: no joint stream joined).",
        JOINT_DOCUMENT_BUCKETS,
        joint["documents"],
        joint["documents_sum"],
    )
    yield _histogram(
        f"{PREFIX}_fusion_relevance_margin",
        "Relevance margin (nats) between a fusion request's two most relevant documents.",
        JOINT_MARGIN_BUCKETS,
        joint["margin"],
        joint["margin_sum"],
    )


def _tier_metrics(tiers: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    kinds = [(CounterMetricFamily, _TIER_COUNTERS), (GaugeMetricFamily, _TIER_GAUGES)]
    for make, docs in kinds:
        for key, doc in docs.items():
            family = make(f"{PREFIX}_chunk_tier_{key}", doc, labels=["tier"])
            for tier, st in tiers.items():
                if st.get(key) is not None:
                    family.add_metric([tier], float(st[key]))
            yield family
    seconds = HistogramMetricFamily(
        f"{PREFIX}_chunk_tier_load_seconds",
        "Time to load and verify one entry from this tier.",
        labels=["tier"],
    )
    for tier, st in tiers.items():
        counts, total = st["load_seconds_buckets"], 0
        buckets = []
        for bound, n in zip([*LOAD_BUCKETS, float("inf")], counts, strict=True):
            total += n
            buckets.append((str(bound) if bound != float("inf") else "+Inf", float(total)))
        seconds.add_metric([tier], buckets, float(st["load_seconds_sum"]))
    yield seconds


class _VllmMetrics:
    """vLLM's request metrics under vLLM's names and labels (vllm/v1/metrics/loggers.py)."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, str]) -> None:
        self.labels = labels

        def counter(name: str, doc: str) -> Any:
            return Counter(f"{VLLM_PREFIX}{name}", doc, VLLM_LABELS, registry=registry).labels(*labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            metric = Histogram(f"{VLLM_PREFIX}{name}", doc, VLLM_LABELS, buckets=buckets, registry=registry)
            return metric.labels(*labels)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.request_success = Counter(
            f"{VLLM_PREFIX}request_success",
            "Count of successfully processed requests.",
            [*VLLM_LABELS, "finished_reason"],
            registry=registry,
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _E2E_BUCKETS
        )


class ServerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self._vllm = _VllmMetrics(self.registry, (model_name, "0"))
        self.http_requests = Counter(
            f"{PREFIX}_http_requests",
            "HTTP requests to the API endpoints, by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.finished_requests = Counter(
            f"{PREFIX}_request_success",
            "Requests that left the engine, by finish reason (stop, length, abort).",
            ["finish_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From admission to the first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Between two consecutive outputs of a request, per token.",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry
        )
        self.cached_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache or the chunk cache.",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Generated tokens.", registry=self.registry
        )
        self._engine_stats = _EngineStatsCollector((model_name, "0"))
        self.registry.register(self._engine_stats)

    def observe_output(self, output: RequestOutput, stream: TokenTimes | None, now: float) -> None:
        """Called by the engine thread for every output of a step, before the stream's
        `last_token_time` is advanced to `now`."""
        num_new = len(output.new_token_ids)
        vllm = self._vllm
        if num_new:
            self.generation_tokens.inc(num_new)
            vllm.generation_tokens.inc(num_new)
            if stream is not None:
                if stream.last_token_time is None:
                    self.ttft.observe(now - stream.arrival_time)
                    vllm.ttft.observe(now - stream.arrival_time)
                else:
                    # Several tokens in one output share the gap; each counts as one interval.
                    per_token = (now - stream.last_token_time) / num_new
                    for _ in range(num_new):
                        self.itl.observe(per_token)
                        vllm.itl.observe(per_token)
        if output.finished:
            reason = (output.outputs[0].finish_reason if output.outputs else None) or "unknown"
            self.finished_requests.labels(finish_reason=reason).inc()
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.cached_tokens.inc(output.num_cached_tokens)
            vllm.request_success.labels(*vllm.labels, reason).inc()
            vllm.prompt_tokens.inc(len(output.prompt_token_ids))
            vllm.prefix_cache_queries.inc(len(output.prompt_token_ids))
            vllm.prefix_cache_hits.inc(output.num_cached_tokens)
            if stream is not None:
                vllm.e2e.observe(now - stream.arrival_time)

    def observe_http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

    def update_engine_stats(self, stats: Mapping[str, Any]) -> None:
        self._engine_stats.stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
