"""Which backend gets a request.

- `cache_aware` (default): the best cached share of the prompt (prefix + chunks) net of load;
- `prefix_only`: the same without chunk scores (what a prefix-only router such as llm-d sees);
- `least_loaded`, `round_robin`, `random`: cache-blind baselines.
The cache policies fall back to least-loaded when the index knows nothing of the prompt or cannot
be reached, and, with `cache_threshold` > 0, when no backend holds that share of it (SGLang's
router does this, at 0.5): a mostly new prompt then goes where the load is least, instead of to the
backend that holds a little of it, so a backend that started with little is not left idle while
the others queue (bench_router_cluster saw splits of 60/9/51 requests). It is off by default: at
0.5 it evened the split, and mean TTFT in bench_router_cluster's interleaved runs was 0.91-1.07x
that of threshold 0 (six comparisons, within the round-to-round spread; benchmarks/history/
RESULTS-narrative.md "bench_router_cluster").
The decision says which rule chose, for the metrics.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from chunkcache.router.backends import Backend
from chunkcache.router.scorer import PodScore

POLICIES = ("cache_aware", "prefix_only", "least_loaded", "round_robin", "random")
CACHE_POLICIES = ("cache_aware", "prefix_only")
# The least share of a prompt that some backend must hold for the cache to choose its backend
# (0: any cached token counts, as before the option existed).
DEFAULT_CACHE_THRESHOLD = 0.0


@dataclass(frozen=True)
class Decision:
    backend: Backend
    policy: str  # the policy that actually chose (least_loaded on a fallback)
    fallback: str | None = None  # why a cache policy fell back
    value: float = 0.0  # cached share net of load, for cache policies


class Picker:
    def __init__(
        self,
        policy: str = "cache_aware",
        load_weight: float = 0.5,
        seed: int | None = None,
        cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        self.policy = policy
        self.load_weight = load_weight
        self.cache_threshold = cache_threshold
        self._rng = random.Random(seed)
        self._turn = itertools.count()

    @property
    def needs_scores(self) -> bool:
        return self.policy in CACHE_POLICIES

    def _rotate(self, cands: Sequence[Backend]) -> list[Backend]:
        # Starting ties at a rotating position spreads equal candidates instead of always
        # favouring the first one listed.
        k = next(self._turn) % len(cands)
        return [*cands[k:], *cands[:k]]

    def least_loaded(self, cands: Sequence[Backend]) -> Backend:
        return min(self._rotate(cands), key=lambda b: b.in_flight)

    def pick(
        self,
        cands: Sequence[Backend],
        scores: Mapping[str, PodScore] | None = None,
        num_tokens: int = 0,
        index_error: bool = False,
    ) -> Decision:
        if not cands:
            raise ValueError("no backend to pick from")
        if self.policy == "round_robin":
            return Decision(cands[next(self._turn) % len(cands)], self.policy)
        if self.policy == "random":
            return Decision(self._rng.choice(list(cands)), self.policy)
        if self.policy == "least_loaded":
            return Decision(self.least_loaded(cands), self.policy)
        if index_error or scores is None:
            return Decision(self.least_loaded(cands), "least_loaded", "index_unavailable")
        use_chunks = self.policy == "cache_aware"
        cached = {b.pod_id: s.total(use_chunks) for b in cands if (s := scores.get(b.pod_id)) is not None}
        if not cached or max(cached.values()) <= 0:
            return Decision(self.least_loaded(cands), "least_loaded", "no_index_knowledge")
        denom = max(num_tokens, 1)
        if max(cached.values()) < self.cache_threshold * denom:
            return Decision(self.least_loaded(cands), "least_loaded", "below_cache_threshold")
        max_load = max(b.in_flight for b in cands)

        def value(b: Backend) -> float:
            return cached.get(b.pod_id, 0.0) / denom - self.load_weight * b.in_flight / (1 + max_load)

        best = max(self._rotate(cands), key=value)
        return Decision(best, self.policy, None, value(best))
