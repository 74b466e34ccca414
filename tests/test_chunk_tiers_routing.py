"""Tier-aware chunk routing: ChunkStored/ChunkRemoved `medium` from real publishers, weighted by
`--tier-weights`, and a shared remote tier credited to every backend; the engine side's events."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from chunkcache.chunk.tiers.disk import DiskTier
from chunkcache.chunk.tiers.provider import StoredKV, encode
from chunkcache.chunk.tiers.stack import TierStack
from chunkcache.hashing import to_wire
from chunkcache.kv_events import AllBlocksCleared, BlockRemoved, ChunkRemoved, ChunkStored
from chunkcache.kv_publisher import KVEventPublisher
from chunkcache.router.events import EventIntake
from chunkcache.router.index import MemoryIndex
from chunkcache.router.scorer import Scorer, ScorerConfig, parse_tier_weights


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def intake() -> Iterator[EventIntake]:
    weights = parse_tier_weights("gpu=1.0,cpu=0.8,disk=0.3,remote=0.2")
    it = EventIntake(MemoryIndex(), num_workers=2, tier_weights=weights)
    it.start()
    yield it
    it.close()


def _publisher(intake: EventIntake, pod: str) -> KVEventPublisher:
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    intake.add_pod(pod, pub.endpoint, pub.replay_endpoint)
    before = intake.stats().batches
    deadline = time.monotonic() + 5
    while intake.stats().batches == before:  # ZMQ's slow joiner: probe until delivered
        assert time.monotonic() < deadline, "subscription never delivered"
        pub.publish([BlockRemoved([0])])
        time.sleep(0.05)
    return pub


def test_chunk_scores_follow_tiers_and_the_shared_remote(intake: EventIntake) -> None:
    a, b = _publisher(intake, "a"), _publisher(intake, "b")
    scorer = Scorer(intake.index)

    def chunk_scores(keys: list[int]) -> dict[str, int]:
        return {p: s.chunk_tokens for p, s in scorer.score([], keys, pods=["a", "b", "c"]).items()}

    def expect(keys: list[int], want: dict[str, int]) -> None:
        _wait(lambda: chunk_scores(keys) == want)

    try:
        a.publish([ChunkStored([1], [100], "GPU"), ChunkStored([1], [100], "DISK")])
        expect([1], {"a": 100, "b": 0, "c": 0})
        a.publish([ChunkRemoved([1], "GPU")])  # evicted from the pool, still on a's disk
        expect([1], {"a": 30, "b": 0, "c": 0})
        a.publish([ChunkStored([2], [50], "REMOTE")])  # any backend sharing the remote may load it
        expect([2], {"a": 10, "b": 10, "c": 10})
        b.publish([ChunkStored([2], [50], "GPU")])
        expect([1, 2], {"a": 40, "b": 50, "c": 10})
        a.publish([AllBlocksCleared()])  # a's own tiers are forgotten, the remote is not a's
        expect([1, 2], {"a": 10, "b": 50, "c": 10})
        a.publish([ChunkRemoved([1], "DISK")])  # nothing left of chunk 1 anywhere
        expect([1], {"a": 0, "b": 0, "c": 0})
        # Only the backends said to share the remote tier are credited for it.
        sharing = Scorer(intake.index, ScorerConfig(remote_pods=frozenset({"a", "c"})))
        scores = sharing.score([], [2], pods=["a", "b", "c", "d"])
        assert {p: s.chunk_tokens for p, s in scores.items()} == {"a": 10, "b": 50, "c": 10, "d": 0}
        assert intake.stats().failed == 0
        intake.index.check_integrity()
    finally:
        a.close()
        b.close()


def test_tier_weights_parse() -> None:
    assert parse_tier_weights("gpu=1.0,cpu=0.8,disk=0.3") == {
        "GPU": 1.0,
        "CPU": 0.8,
        "DISK": 0.3,
        "REMOTE": 0.3,
    }
    with pytest.raises(ValueError, match="NAME=WEIGHT"):
        parse_tier_weights("gpu")
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        parse_tier_weights("disk=3")


def test_tier_stack_events_carry_the_medium(tmp_path: Path) -> None:
    def kv(i: int) -> StoredKV:
        k = torch.full((2, 8, 2, 4), float(i))
        return StoredKV("m" * 64, bytes([i]) * 32, "chunk", ((1,), tuple(range(8))), k, k.clone())

    size = len(encode(kv(1)))
    stack = TierStack([DiskTier(str(tmp_path), budget_bytes=2 * size)], "m" * 64)
    try:
        for i in (1, 2, 3):  # the third pushes the first out of the budget
            stack.store(kv(i))
            stack.flush()
        events = stack.drain_events()
        wire = [to_wire(bytes([i]) * 32) for i in (1, 2, 3)]
        stored = [e for e in events if isinstance(e, ChunkStored)]
        assert [(e.chunk_hashes, e.num_tokens, e.medium) for e in stored] == [
            ([w], [8], "DISK") for w in wire
        ]
        assert [(e.chunk_hashes, e.medium) for e in events if isinstance(e, ChunkRemoved)] == [
            ([wire[0]], "DISK")
        ]
        (state,) = stack.state_events()  # what a restarted router is told: the files on disk
        assert sorted(state.chunk_hashes) == sorted(wire[1:]) and state.medium == "DISK"
        assert not stack.holds(bytes([1]) * 32) and stack.holds(bytes([3]) * 32)
        stack.check_integrity()
    finally:
        stack.close()
