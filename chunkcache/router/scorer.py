"""Per-pod scores of a prompt: longest consecutive cached prefix plus cached chunks.

Prefix: a pod's run of the prompt's blocks from the first one until the first block it lacks
(KV after a missing block cannot be reused as a prefix), each block weighted by the best tier
the pod holds it in (GPU 1.0, CPU 0.8: offloaded KV must be copied back). Chunk score (this
project): the tokens of the prompt's chunks that the pod holds, in any order, each weighted at
intake by the best tier the pod holds it in (its pool "GPU", its disk "DISK"); a chunk in a
remote store shared by the replicas ("REMOTE", index entry `SHARED_REMOTE`) counts for every pod
that shares it (`remote_pods`; all by default), unless the pod's own copy weighs more. Both are in tokens, so `total` is an estimate of the prompt
tokens a pod will not recompute.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from chunkcache.router.index import KVIndex, Tiers

DEFAULT_TIER_WEIGHTS: dict[str, float] = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.3, "REMOTE": 0.3}
# The index's name for chunks in a remote tier that every replica shares: never a backend id.
SHARED_REMOTE = "*remote*"


@dataclass(frozen=True)
class ScorerConfig:
    tier_weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    # Weight of a tier not in `tier_weights` (a disk or remote tier from a newer engine).
    unknown_tier_weight: float = 0.5
    block_size: int = 16
    # The backends that share the remote tier (can load what any of them stored there);
    # None = every backend scored.
    remote_pods: frozenset[str] | None = None


@dataclass
class PodScore:
    prefix_blocks: int = 0  # consecutive cached blocks from the start
    prefix_tokens: float = 0.0  # the same, tier-weighted, in tokens
    chunk_tokens: int = 0  # cached tokens of the prompt's chunks
    chunked: bool = False  # the prompt has chunks: an engine serves it from its chunk pool

    def total(self, use_chunks: bool = True) -> float:
        """Prompt tokens a pod would not recompute. A chunked prompt's KV comes from the chunk
        pool only (its S and chunks, in any order), never from the prefix cache, so with chunk
        scores its prefix blocks add nothing; without them (a prefix router) they are all it has."""
        if not use_chunks:
            return self.prefix_tokens
        return self.chunk_tokens if self.chunked else self.prefix_tokens + self.chunk_tokens


def tier_weight(weights: Mapping[str, float], tiers: Iterable[str], unknown: float) -> float:
    """The weight of the best of `tiers` (upper-case names)."""
    return max((weights.get(t, unknown) for t in tiers), default=0.0)


def parse_tier_weights(spec: str) -> dict[str, float]:
    """`"gpu=1.0,cpu=0.8,disk=0.3"` -> {"GPU": 1.0, "CPU": 0.8, "DISK": 0.3}; a tier not named
    keeps its default weight."""
    out: dict[str, float] = dict(DEFAULT_TIER_WEIGHTS)
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"tier weight {item!r} is not NAME=WEIGHT")
        weight = float(value)
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"tier weight {item!r} must be in [0, 1]")
        out[name.strip().upper()] = weight
    return out


class _WeightTable(dict[Tiers, float]):
    """Tiers string -> weight (the best of its tiers), filled on first sight; a dict subclass so
    that `__getitem__` can be mapped over rows at C speed."""

    def __init__(self, weights: Mapping[str, float], unknown: float) -> None:
        super().__init__()
        self.weights = {k.upper(): v for k, v in weights.items()}
        self.unknown = unknown

    def __missing__(self, tiers: Tiers) -> float:
        w = self[tiers] = max(self.weights.get(t, self.unknown) for t in tiers.split("+"))
        return w


class Scorer:
    def __init__(self, index: KVIndex, config: ScorerConfig | None = None) -> None:
        self.index = index
        self.config = config or ScorerConfig()
        self._weight = _WeightTable(self.config.tier_weights, self.config.unknown_tier_weight)

    def score(
        self,
        block_keys: Sequence[int],
        chunk_keys: Sequence[int] = (),
        pods: Iterable[str] | None = None,
        use_chunks: bool = True,
        chunk_tokens: Sequence[int] | None = None,
    ) -> dict[str, PodScore]:
        """Scores of `pods` (every pod the index names when None); pods with nothing cached get a
        zero score when listed, and are absent otherwise. `chunk_tokens[i]`, the real token count
        of chunk i in the prompt, caps what a pod's claim for it can earn (claims come from the
        event socket). Raises IndexUnavailableError."""
        scores: dict[str, PodScore] = {p: PodScore() for p in pods} if pods is not None else {}
        restrict = pods is not None
        rows = self.index.lookup(block_keys)
        if rows:
            bs = self.config.block_size
            weight = self._weight.__getitem__
            for p, depth in self._depths(rows, scores if restrict else None).items():
                s = scores.setdefault(p, PodScore())
                s.prefix_blocks = depth
                # C-level map over the pod's run: this loop is most of a long prompt's scoring.
                s.prefix_tokens = sum(map(weight, map(itemgetter(p), rows[:depth]))) * bs
        if use_chunks and chunk_keys:
            for s in scores.values():
                s.chunked = True
            for i, row in enumerate(self.index.lookup_chunks(chunk_keys)):
                cap = chunk_tokens[i] if chunk_tokens is not None else None
                shared = row.pop(SHARED_REMOTE, 0)
                if shared and restrict:  # the pods sharing the remote tier may each load it
                    sharers = self.config.remote_pods
                    row = {
                        p: max(row.get(p, 0), shared if sharers is None or p in sharers else 0)
                        for p in scores
                    }
                for p, n in row.items():
                    if restrict and p not in scores:
                        continue
                    scores.setdefault(p, PodScore(chunked=True)).chunk_tokens += (
                        n if cap is None else min(n, cap)
                    )
        return scores

    @staticmethod
    def _depths(rows: Sequence[Mapping[str, Tiers]], only: Mapping[str, object] | None) -> dict[str, int]:
        """Each pod's consecutive run from the first row: the index of its first missing row."""
        active = {p for p in rows[0] if only is None or p in only}
        depth: dict[str, int] = {}
        for i, row in enumerate(rows):
            if row.keys() >= active:  # the usual case: every pod still running holds this block
                continue
            gone = active.difference(row)
            depth.update(dict.fromkeys(gone, i))
            active -= gone
            if not active:
                break
        depth.update(dict.fromkeys(active, len(rows)))
        return depth
