"""One pod's KV event history, applied to the index in seq order (docs/design.md §4): the part
of the event intake that runs on a worker thread, apart from the sockets and the sharding
(`router/events.py`) because it is what decides what the index may believe.

Per pod and per stream (vLLM's `kv@...`, this project's `chunk@...`) the last applied seq is kept.
A gap asks the pod's replay endpoint for the missing batches; when replay cannot fill it (no
endpoint, buffer too short, timeout) the pod's entries are cleared: with a batch lost we may have
missed removals, and a pod claiming KV it no longer has would attract requests for nothing
(history lost: cleared, not trusted). A seq going backwards means the publisher restarted, which
also clears. A batch that fails to decode or apply is lost history too: the pod is cleared before
its next batch applies.

KV cache groups (vLLM's hybrid allocator tags events with `group_idx`): only the full-attention
group with the lowest index is indexed, because only its blocks make a prefix hit; a sliding-window
group evicts blocks that the full-attention group still holds, and letting those removals through
would zero the pod's score. Events without `group_idx` (older vLLM, one group) all count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from chunkcache.kv_events import (
    FULL_ATTENTION_KINDS,
    MEDIUM_REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChunkRemoved,
    ChunkStored,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
)
from chunkcache.kv_sockets import read_replay_reply, replay_request
from chunkcache.router.index import IndexUnavailableError, KVIndex
from chunkcache.router.scorer import DEFAULT_TIER_WEIGHTS, SHARED_REMOTE, tier_weight
from chunkcache.router.tokens import BlockKeyer, EngineKeyMap

if TYPE_CHECKING:
    from chunkcache.router.events import IntakeCurve

logger = logging.getLogger(__name__)

# No chunk holds more tokens than this (far beyond any context length): larger claims are forged.
MAX_CHUNK_TOKENS = 1 << 24

# Stream key of vLLM's events; the chunk stream's key is its topic (which a replay request names).
VLLM_STREAM = ""


def tier_of(medium: str | None) -> str:
    return (medium or "GPU").upper()  # vLLM leaves medium None for its GPU cache


@dataclass
class PodState:
    keymap: EngineKeyMap
    # Last applied seq per stream (VLLM_STREAM, or the chunk topic).
    last_seqs: dict[str, int] = field(default_factory=dict)
    dirty: bool = False  # a batch was lost: clear before trusting the next one
    replay_socket: zmq.Socket | None = None
    # KV cache group -> its kv_cache_spec_kind (None when the engine did not say), as learned.
    groups: dict[int, str | None] = field(default_factory=dict)
    # Chunk key -> {tier: num_tokens} of the pod's own tiers (pool, disk): the index holds the
    # tokens weighted by the best of them, so an eviction from one tier keeps the others' credit.
    chunk_tiers: dict[int, dict[str, int]] = field(default_factory=dict)

    def scored(self, group_idx: int | None) -> bool:
        """Whether blocks of this KV cache group are indexed: the lowest full-attention group
        (group 0 when the engine names no kinds)."""
        if group_idx is None:
            return True
        full = [g for g, kind in self.groups.items() if kind in FULL_ATTENTION_KINDS]
        if full:
            return group_idx == min(full)
        return group_idx == 0 and self.groups.get(0) is None


class PodEvents:
    """Applies the batches of the pods a worker owns (each pod only ever on one worker, so a pod's
    state in `pods` is touched by one thread): seq tracking, replay, clearing, and the events
    themselves as index entries (blocks by tier, chunks weighted by their best tier)."""

    def __init__(
        self,
        index: KVIndex,
        keyer: BlockKeyer,
        count: Callable[..., None],
        replay_endpoints: Mapping[str, str],
        context: zmq.Context,
        curve: IntakeCurve | None = None,
        replay_timeout_s: float = 1.0,
        pod_map_capacity: int = 1 << 21,
        on_clear: Callable[[str, str], None] | None = None,
        tier_weights: Mapping[str, float] | None = None,
        unknown_tier_weight: float = 0.5,
    ) -> None:
        self.index = index
        self.keyer = keyer
        self.count = count  # adds to the intake's stats: count(batches=1, ...)
        self.replay_endpoints = replay_endpoints  # the intake's, as pods come and go
        self._ctx = context
        self.curve = curve
        self.replay_timeout_s = replay_timeout_s
        self.pod_map_capacity = pod_map_capacity
        self.on_clear = on_clear
        self.tier_weights = {k.upper(): v for k, v in (tier_weights or DEFAULT_TIER_WEIGHTS).items()}
        self.unknown_tier_weight = unknown_tier_weight

    def _new_state(self, dirty: bool = False) -> PodState:
        return PodState(EngineKeyMap(self.keyer, self.pod_map_capacity), dirty=dirty)

    @staticmethod
    def close(pods: dict[str, PodState]) -> None:
        """Release the replay sockets of a worker's pods (on its thread, as it stops)."""
        for st in pods.values():
            if st.replay_socket is not None:
                st.replay_socket.close(linger=0)

    def process(
        self, pods: dict[str, PodState], pod: str, seq: int, payload: bytes, stream: str = VLLM_STREAM
    ) -> None:
        """Apply one live batch with seq tracking (called on the pod's worker thread)."""
        st = pods.get(pod)
        if st is None:
            st = pods[pod] = self._new_state()
        last = st.last_seqs.get(stream)
        if last is not None and seq <= last:
            # Seqs only grow within one publisher: this one restarted with a fresh cache. Every
            # stream restarted with it, so each starts over (the others must not clear again).
            self._clear(pod, st, "publisher restarted")
            st.last_seqs.clear()
            last = None
        expected = 0 if last is None else last + 1
        if seq > expected:
            # On first contact (late join, slow-joining SUB) we hold nothing of this pod, so an
            # unfilled gap loses nothing we claimed; a gap after that may hide removals.
            self._replay(pod, st, expected, seq, must_fill=last is not None, stream=stream)
        self._apply_payload(pod, st, seq, payload, stream)

    def _replay(
        self, pod: str, st: PodState, start: int, stop: int, must_fill: bool, stream: str = VLLM_STREAM
    ) -> None:
        """Fetch batches [start, stop) from the pod's replay endpoint and apply them. When the range
        does not fully arrive and `must_fill`, the pod is marked for clearing first, then only the
        contiguous tail ending at stop-1 applies (everything before the hole is unknown anyway)."""
        endpoint = self.replay_endpoints.get(pod)
        if endpoint is None:
            if must_fill:
                self.count(replay_failures=1)
                st.dirty = True
            return
        self.count(replays=1)
        ok, got = self._fetch(pod, st, endpoint, start, stop, stream)
        if not (ok and all(s in got for s in range(start, stop))):
            self.count(replay_failures=1)
            if must_fill:
                st.dirty = True
            hole = stop - 1
            while hole in got:
                hole -= 1
            got = {s: p for s, p in got.items() if s > hole}
        for s in sorted(got):
            self._apply_payload(pod, st, s, got[s], stream)

    def _fetch(
        self, pod: str, st: PodState, endpoint: str, start: int, stop: int, stream: str
    ) -> tuple[bool, dict[int, bytes]]:
        """Ask the replay endpoint for batches from `start` on: whether the end marker came within
        the timeout, and the batches of [start, stop) that did (by seq)."""
        got: dict[int, bytes] = {}
        sock = st.replay_socket
        if sock is None:
            sock = st.replay_socket = self._ctx.socket(zmq.DEALER)
            if self.curve is not None:
                self.curve.secure_client(sock, pod)
            sock.connect(endpoint)
        ok = False
        try:
            # vLLM's request for its own stream; the chunk stream is named by a topic frame.
            sock.send_multipart(replay_request(start, stream or None))
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1):
                    break
                reply = read_replay_reply(sock.recv_multipart())  # either vLLM generation's layout
                if reply is None:
                    continue
                if reply.end:
                    ok = True
                    break
                if start <= reply.seq < stop:
                    got[reply.seq] = reply.payload
        except zmq.ZMQError:
            logger.exception("replay request to %s failed", endpoint)
        if not ok:
            # Late replies would answer the next request: start that one on a fresh socket.
            sock.close(linger=0)
            st.replay_socket = None
        return ok, got

    def forget(self, pods: dict[str, PodState], pod: str) -> None:
        """Drop a pod that is no longer a backend: its state, its replay socket, its index entries."""
        st = pods.pop(pod, None)
        if st is not None and st.replay_socket is not None:
            st.replay_socket.close(linger=0)
        try:
            self.index.clear_pod(pod)
        except IndexUnavailableError as e:
            # Should a pod of this name come back, its first batch clears the old entries first.
            pods[pod] = self._new_state(dirty=True)
            logger.warning("pod %s is no longer a backend, its index entries stay for now: %s", pod, e)
            return
        self.count(clears=1)
        logger.info("cleared pod %s from the index: no longer a backend", pod)

    def _clear(self, pod: str, st: PodState, reason: str) -> None:
        self.index.clear_pod(pod)
        st.keymap.clear()
        st.chunk_tiers.clear()
        st.dirty = False
        self.count(clears=1)
        logger.info("cleared pod %s from the index: %s", pod, reason)
        if self.on_clear is not None:
            self.on_clear(pod, reason)

    def _apply_payload(
        self, pod: str, st: PodState, seq: int, payload: bytes, stream: str = VLLM_STREAM
    ) -> None:
        st.last_seqs[stream] = seq
        try:
            if st.dirty:
                self._clear(pod, st, "history lost: cleared, not trusted")
            decoded = decode_batch(payload)
            self.apply_batch(pod, st, decoded.batch)
        except (KVEventDecodeError, ValueError, OverflowError) as e:
            logger.warning("pod %s batch %d failed: %s", pod, seq, e)
            st.dirty = True
            self.count(failed=1)
            return
        except IndexUnavailableError as e:
            # Part of the batch may be applied, so the pod's entries are no longer a faithful copy:
            # cleared once the index is back.
            logger.warning("pod %s batch %d not applied: %s", pod, seq, e)
            st.dirty = True
            self.count(failed=1)
            return
        except Exception:
            st.dirty = True
            self.count(failed=1)
            raise
        self.count(batches=1, events=len(decoded.batch.events), unknown_types=len(decoded.unknown_types))

    def _weighted(self, tiers: Iterable[str], num_tokens: int) -> int:
        return round(num_tokens * tier_weight(self.tier_weights, tiers, self.unknown_tier_weight))

    def _chunks_stored(self, pod: str, st: PodState, chunks: list[tuple[int, int]], tier: str) -> None:
        if tier == MEDIUM_REMOTE:  # shared: every replica can load it, whoever wrote it
            self.index.add_chunks(SHARED_REMOTE, [(h, self._weighted((tier,), n)) for h, n in chunks])
            return
        entries = []
        for h, n in chunks:
            tiers = st.chunk_tiers.setdefault(h, {})
            tiers[tier] = n
            entries.append((h, self._weighted(tiers, n)))
        self.index.add_chunks(pod, entries)

    def _chunks_removed(self, pod: str, st: PodState, hashes: Sequence[int], tier: str) -> None:
        if tier == MEDIUM_REMOTE:
            self.index.remove_chunks(SHARED_REMOTE, hashes)
            return
        gone, kept = [], []
        for h in hashes:
            tiers = st.chunk_tiers.get(h)
            if tiers is None or tiers.pop(tier, None) is None or not tiers:
                st.chunk_tiers.pop(h, None)
                gone.append(h)
            else:
                kept.append((h, self._weighted(tiers, max(tiers.values()))))
        self.index.remove_chunks(pod, gone)
        if kept:
            self.index.add_chunks(pod, kept)

    def apply_batch(self, pod: str, st: PodState, batch: KVEventBatch) -> None:
        index, keymap = self.index, st.keymap
        stored = removed = other = 0
        unresolved_before = keymap.unresolved_blocks
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.group_idx is not None and (ev.group_idx not in st.groups or ev.kv_cache_spec_kind):
                    st.groups[ev.group_idx] = ev.kv_cache_spec_kind
                if not st.scored(ev.group_idx):
                    other += len(ev.block_hashes)
                    continue
                keys = keymap.stored(ev)
                index.add(pod, keys, tier_of(ev.medium))
                stored += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                if not st.scored(ev.group_idx):
                    other += len(ev.block_hashes)
                    continue
                index.remove(pod, keymap.removed(ev.block_hashes), tier_of(ev.medium))
                removed += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self._clear(pod, st, "AllBlocksCleared")
            elif isinstance(ev, ChunkStored):
                claims = list(zip(ev.chunk_hashes, ev.num_tokens, strict=True))
                sane = [(h, n) for h, n in claims if isinstance(n, int) and 0 < n <= MAX_CHUNK_TOKENS]
                if len(sane) < len(claims):
                    self.count(rejected_claims=len(claims) - len(sane))
                self._chunks_stored(pod, st, sane, tier_of(ev.medium))
            elif isinstance(ev, ChunkRemoved):
                self._chunks_removed(pod, st, ev.chunk_hashes, tier_of(ev.medium))
        self.count(
            other_group_blocks=other,
            blocks_stored=stored,
            blocks_removed=removed,
            unresolved_blocks=keymap.unresolved_blocks - unresolved_before,
        )
