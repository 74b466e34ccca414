"""Prometheus metrics of one router, on its own registry (several apps can live in one process).

Counters that the index and the event intake already keep are read at scrape time by a collector
rather than mirrored on every update, so the hot paths pay nothing for metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from chunkcache.router.backends import BackendPool
from chunkcache.router.discovery import PodWatcher
from chunkcache.router.events import EventIntake
from chunkcache.router.index import IndexUnavailableError, KVIndex

logger = logging.getLogger(__name__)

P = "chunkcache_router_"
# Scoring is sub-millisecond to a few ms; tokenization of long prompts reaches tens of ms.
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _StateCollector(Collector):
    def __init__(self, index: KVIndex, intake: Callable[[], EventIntake | None], pool: BackendPool) -> None:
        self.index = index
        self.intake = intake
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        try:
            size: float = self.index.size()
        except IndexUnavailableError:
            size = float("nan")
        yield GaugeMetricFamily(P + "index_size", "Block keys in the index (Redis: keys in its db)", size)
        st = self.index.stats()
        for name, value, doc in (
            ("index_admissions", st.admissions, "Block entries (key, pod, tier) added"),
            ("index_removals", st.removals, "Block entries removed by events and pod clears"),
            ("index_evictions", st.evictions, "Block entries dropped for capacity"),
            ("index_chunk_admissions", st.chunk_admissions, "Chunk entries added"),
            ("index_chunk_removals", st.chunk_removals, "Chunk entries removed"),
            ("index_chunk_evictions", st.chunk_evictions, "Chunk entries dropped for capacity"),
        ):
            yield CounterMetricFamily(P + name, doc, value)
        intake = self.intake()
        if intake is not None:
            ev = intake.stats()
            for name, value, doc in (
                ("event_batches_processed", ev.batches, "KV event batches applied"),
                ("events_processed", ev.events, "KV events applied"),
                ("events_failed", ev.failed, "KV event batches that failed to decode or apply"),
                ("events_unknown_type", ev.unknown_types, "KV events skipped for an unknown type"),
                ("event_blocks_stored", ev.blocks_stored, "Blocks in applied BlockStored events"),
                ("event_blocks_removed", ev.blocks_removed, "Blocks in applied BlockRemoved events"),
                ("event_blocks_unresolved", ev.unresolved_blocks, "Stored blocks with an unknown parent"),
                ("event_replays", ev.replays, "Replay requests sent after a seq gap"),
                ("event_replay_failures", ev.replay_failures, "Seq gaps replay could not fill"),
                ("pod_clears", ev.clears, "Pods cleared from the index (restart, lost history)"),
                (
                    "event_blocks_other_group",
                    ev.other_group_blocks,
                    "Blocks of KV cache groups not scored (sliding window, mamba, ...)",
                ),
                (
                    "events_unknown_topic",
                    ev.unknown_topics,
                    "KV event messages not from a configured backend",
                ),
                ("events_rejected_claims", ev.rejected_claims, "Chunk claims with impossible token counts"),
            ):
                yield CounterMetricFamily(P + name, doc, value)
            yield GaugeMetricFamily(P + "event_queue_length", "KV event batches waiting", intake.pending())
        load = GaugeMetricFamily(P + "backend_in_flight", "Requests open on a backend", labels=["backend"])
        healthy = GaugeMetricFamily(
            P + "backend_healthy", "1 when a backend passes health checks", labels=["backend"]
        )
        for b in self.pool:
            load.add_metric([b.pod_id], b.in_flight)
            healthy.add_metric([b.pod_id], 1.0 if b.healthy else 0.0)
        yield load
        yield healthy


class _DiscoveryCollector(Collector):
    def __init__(self, watcher: PodWatcher) -> None:
        self.watcher = watcher

    def collect(self) -> Iterator[Metric]:
        w = self.watcher
        yield GaugeMetricFamily(
            P + "discovered_backends", "Discovered pods that are backends", len(w.backends)
        )
        yield CounterMetricFamily(
            P + "discovery_lists", "Pod lists (the first, after a 410 or a failure)", w.lists
        )
        yield CounterMetricFamily(
            P + "discovery_failures", "Pod list or watch failures (unreachable, 403, ...)", w.failures
        )


class RouterMetrics:
    def __init__(
        self,
        index: KVIndex,
        pool: BackendPool,
        intake: Callable[[], EventIntake | None],
        discovery: PodWatcher | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.lookups = Counter(P + "lookups", "Prompts scored against the index", registry=r)
        self.lookup_tokens = Counter(P + "lookup_tokens", "Prompt tokens scored", registry=r)
        self.hit_tokens = Counter(
            P + "lookup_hit_tokens", "Cached prompt tokens on the chosen backend (tier-weighted)", registry=r
        )
        self.scoring_latency = Histogram(
            P + "scoring_latency_seconds",
            "Index lookup and scoring, excluding tokenization",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokenization_latency = Histogram(
            P + "tokenization_latency_seconds", "Prompt tokenization", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.decisions = Counter(
            P + "routing_decisions",
            "Requests routed, by deciding policy and backend",
            ["policy", "backend"],
            registry=r,
        )
        self.fallbacks = Counter(
            P + "fallbacks", "Cache-aware decisions that fell back to least-loaded", ["reason"], registry=r
        )
        self.index_errors = Counter(
            P + "index_errors", "Index lookups that failed (backend down)", registry=r
        )
        self.proxy_errors = Counter(
            P + "proxy_errors",
            "Requests a backend failed to take (retried elsewhere)",
            ["backend"],
            registry=r,
        )
        self.requests_failed = Counter(P + "requests_failed", "Requests no backend could take", registry=r)
        self.tokens_scored = 0.0
        self.tokens_hit = 0.0
        r.register(_StateCollector(index, intake, pool))
        r.register(_HitRatio(self))
        if discovery is not None:
            r.register(_DiscoveryCollector(discovery))

    def record_lookup(self, num_tokens: int, hit_tokens: float) -> None:
        self.lookups.inc()
        self.lookup_tokens.inc(num_tokens)
        self.hit_tokens.inc(hit_tokens)
        self.tokens_scored += num_tokens
        self.tokens_hit += hit_tokens

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _HitRatio(Collector):
    """hit ratio = cached tokens on chosen backends / prompt tokens scored, since start."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        total, hits = self.m.tokens_scored, self.m.tokens_hit
        yield GaugeMetricFamily(
            P + "hit_ratio", "Cached share of scored prompt tokens", hits / total if total else 0.0
        )
