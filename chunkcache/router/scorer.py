"""Per-pod scores of a prompt: longest consecutive cached prefix plus cached chunks.

Prefix: a pod's run of the prompt's blocks from the first one until the first block it lacks
(KV after a missing block cannot be reused as a prefix), each block weighted by the best tier
the pod holds it in (GPU 1.0, CPU 0.8: offloaded KV must be copied back). Chunk score (this
project): the tokens of the prompt's chunks that the pod's chunk pool holds, in any order.
Both are in tokens, so `total` is an estimate of the prompt tokens a pod will not recompute.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from chunkcache.router.index import KVIndex, Tiers

DEFAULT_TIER_WEIGHTS: dict[str, float] = {"GPU": 1.0, "CPU": 0.8}


@dataclass(frozen=True)
class ScorerConfig:
    tier_weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    # Weight of a tier not in `tier_weights` (a disk or remote tier from a newer engine).
    unknown_tier_weight: float = 0.5
    block_size: int = 16


@dataclass
class PodScore:
    prefix_blocks: int = 0  # consecutive cached blocks from the start
    prefix_tokens: float = 0.0  # the same, tier-weighted, in tokens
    chunk_tokens: int = 0  # cached tokens of the prompt's chunks

    def total(self, use_chunks: bool = True) -> float:
        return self.prefix_tokens + (self.chunk_tokens if use_chunks else 0)


def parse_tier_weights(spec: str) -> dict[str, float]:
    """`"GPU=1.0,CPU=0.8"` -> {"GPU": 1.0, "CPU": 0.8}."""
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"tier weight {item!r} is not NAME=WEIGHT")
        out[name.strip().upper()] = float(value)
    return out


class Scorer:
    def __init__(self, index: KVIndex, config: ScorerConfig | None = None) -> None:
        self.index = index
        self.config = config or ScorerConfig()
        self._weights = {k.upper(): v for k, v in self.config.tier_weights.items()}
        self._set_weight: dict[Tiers, float] = {}

    def _weight(self, tiers: Tiers) -> float:
        w = self._set_weight.get(tiers)
        if w is None:
            w = self._set_weight[tiers] = max(
                self._weights.get(t, self.config.unknown_tier_weight) for t in tiers.split("+")
            )
        return w

    def score(
        self,
        block_keys: Sequence[int],
        chunk_keys: Sequence[int] = (),
        pods: Iterable[str] | None = None,
        use_chunks: bool = True,
    ) -> dict[str, PodScore]:
        """Scores of `pods` (every pod the index names when None); pods with nothing cached get a
        zero score when listed, and are absent otherwise. Raises IndexUnavailableError."""
        scores: dict[str, PodScore] = {p: PodScore() for p in pods} if pods is not None else {}
        restrict = pods is not None
        rows = self.index.lookup(block_keys)
        weight = self._weight
        if rows:
            # Pods still on a consecutive run; a pod leaves at its first missing block.
            active = {p for p in rows[0] if not restrict or p in scores}
            weighted = dict.fromkeys(active, 0.0)
            depth = dict.fromkeys(active, 0)
            for row in rows:
                if not active:
                    break
                for p in list(active):
                    tiers = row.get(p)
                    if tiers is None:
                        active.discard(p)
                    else:
                        weighted[p] += weight(tiers)
                        depth[p] += 1
            bs = self.config.block_size
            for p, n in depth.items():
                s = scores.setdefault(p, PodScore())
                s.prefix_blocks = n
                s.prefix_tokens = weighted[p] * bs
        if use_chunks and chunk_keys:
            for row in self.index.lookup_chunks(chunk_keys):
                for p, n in row.items():
                    if restrict and p not in scores:
                        continue
                    scores.setdefault(p, PodScore()).chunk_tokens += n
        return scores
