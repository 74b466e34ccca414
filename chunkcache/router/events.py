"""KV event intake: ZMQ subscribers -> per-pod ordered workers -> the index (docs/design.md §4).

One receiver thread polls a SUB socket per pod (connected to the pod's publisher), and optionally
one bound SUB socket that pods connect to (pod id = the topic's `kv@<pod>@<model>` middle part).
Messages go to a pool of workers sharded by FNV-1a(pod id), so each pod's batches apply in order
while different pods proceed in parallel.

A pod publishes up to two streams, each with its own seq: vLLM's events on its `kv@...` topic and
this project's chunk events on `chunk@...` (kv_events.py). Seq tracking and replay are per stream;
a lost batch on either clears the whole pod.

KV cache groups (vLLM's hybrid allocator tags events with `group_idx`): only the full-attention
group with the lowest index is indexed, because only its blocks make a prefix hit; a sliding-window
group evicts blocks that the full-attention group still holds, and letting those removals through
would zero the pod's score. Events without `group_idx` (older vLLM, one group) all count.

Per pod, a worker tracks the publisher's seq. A gap asks the pod's replay endpoint for the missing
batches; when replay cannot fill it (no endpoint, buffer too short, timeout) the pod's entries are
cleared: with a batch lost we may have missed removals, and a pod claiming KV it no longer has
would attract requests for nothing (history lost: cleared, not trusted). A seq going backwards
means the publisher restarted, which also clears. A batch that fails to decode or apply is lost
history too: the pod is cleared before its next batch applies.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from chunkcache.curve import CurveKeys, CurveServer, load_public_key, secure_client
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
    chunk_topic_for,
    decode_batch,
    is_chunk_topic,
)
from chunkcache.kv_sockets import guarded_bind_endpoint, read_replay_reply, replay_request
from chunkcache.router.index import IndexUnavailableError, KVIndex
from chunkcache.router.scorer import DEFAULT_TIER_WEIGHTS, SHARED_REMOTE, tier_weight
from chunkcache.router.tokens import BlockKeyer, EngineKeyMap

logger = logging.getLogger(__name__)

_FNV64_OFFSET = 0xCBF29CE484222325
_FNV64_PRIME = 0x100000001B3


def fnv1a_64(data: bytes) -> int:
    h = _FNV64_OFFSET
    for b in data:
        h = ((h ^ b) * _FNV64_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


# No chunk holds more tokens than this (far beyond any context length): larger claims are forged.
MAX_CHUNK_TOKENS = 1 << 24


@dataclass(frozen=True)
class IntakeCurve:
    """CURVE for the router's event and replay sockets: its own keys, and a directory holding each
    backend's public key as `<pod>.key` (authorized on the bound socket, expected when connecting)."""

    keys: CurveKeys
    backend_keys_dir: str

    def secure_client(self, sock: zmq.Socket, pod: str) -> None:
        secure_client(sock, self.keys, load_public_key(Path(self.backend_keys_dir) / f"{pod}.key"))


def pod_from_topic(topic: str) -> str:
    """`kv@<pod>@<model>` -> pod (llm-d's topic convention), `chunk@<pod>@<model>` too (our chunk
    stream); any other topic is the pod id itself."""
    parts = topic.split("@")
    return parts[1] if len(parts) == 3 and parts[0] in ("kv", "chunk") else topic


def subscriptions(topic_filter: str) -> list[str]:
    """The ZMQ prefixes to subscribe to for a vLLM topic filter: a filter on vLLM's `kv@...` also
    takes our chunk stream of the same pods (`chunk@...`), which vLLM's prefix cannot match."""
    if topic_filter.startswith("kv@"):
        return [topic_filter, chunk_topic_for(topic_filter)]
    return [topic_filter]


def tier_of(medium: str | None) -> str:
    return (medium or "GPU").upper()  # vLLM leaves medium None for its GPU cache


@dataclass
class IntakeStats:
    batches: int = 0  # batches applied
    events: int = 0  # events applied
    blocks_stored: int = 0
    blocks_removed: int = 0
    failed: int = 0  # batches that could not be decoded or applied
    unknown_types: int = 0  # events skipped for an unknown type
    unresolved_blocks: int = 0  # stored blocks whose parent was unknown
    replays: int = 0  # replay requests sent
    replay_failures: int = 0  # replays that could not fill their gap
    clears: int = 0  # pods cleared (restart, lost history, AllBlocksCleared)
    other_group_blocks: int = 0  # stored/removed blocks of KV cache groups that are not scored
    unknown_topics: int = 0  # messages dropped: not from a configured backend (or its key)
    rejected_claims: int = 0  # chunk entries dropped for an impossible token count


# Stream key of vLLM's events; the chunk stream's key is its topic (which a replay request names).
VLLM_STREAM = ""


@dataclass
class _PodState:
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


@dataclass
class _Msg:
    pod: str
    seq: int
    payload: bytes
    stream: str = VLLM_STREAM
    forget: bool = False  # the pod is no longer a backend: drop its state and index entries


@dataclass
class _Worker:
    queue: queue.SimpleQueue[_Msg | None] = field(default_factory=queue.SimpleQueue)
    pods: dict[str, _PodState] = field(default_factory=dict)
    pending: int = 0
    thread: threading.Thread | None = None


class EventIntake:
    def __init__(
        self,
        index: KVIndex,
        keyer: BlockKeyer | None = None,
        num_workers: int = 4,
        topic_filter: str = "",
        bind_endpoint: str | None = None,
        replay_timeout_s: float = 1.0,
        pod_map_capacity: int = 1 << 21,
        on_clear: Callable[[str, str], None] | None = None,
        allowed_pods: Collection[str] | None = None,
        curve: IntakeCurve | None = None,
        tier_weights: Mapping[str, float] | None = None,
        unknown_tier_weight: float = 0.5,
        insecure: bool = False,
    ) -> None:
        if num_workers <= 0:
            raise ValueError(f"num_workers must be > 0, got {num_workers}")
        # Pods whose topics the bound socket accepts (None: any); the router passes its backends.
        self.allowed_pods = None if allowed_pods is None else frozenset(allowed_pods)
        self.curve = curve
        self.index = index
        self.keyer = keyer or BlockKeyer()
        self.topic_filter = topic_filter
        self.replay_timeout_s = replay_timeout_s
        self.pod_map_capacity = pod_map_capacity
        self.on_clear = on_clear
        self.tier_weights = {k.upper(): v for k, v in (tier_weights or DEFAULT_TIER_WEIGHTS).items()}
        self.unknown_tier_weight = unknown_tier_weight
        self._stats = IntakeStats()
        self._stats_lock = threading.Lock()
        self._replay_endpoints: dict[str, str] = {}
        self._workers = [_Worker() for _ in range(num_workers)]
        # CURVE needs a ZAP handler of its own, one per context.
        self._ctx = zmq.Context() if curve is not None else zmq.Context.instance()
        self._curve_server = (
            None if curve is None else CurveServer(self._ctx, curve.keys, curve.backend_keys_dir)
        )
        self._commands: queue.SimpleQueue[tuple[str, str, str | None]] = queue.SimpleQueue()
        self._subs: dict[str, zmq.Socket] = {}
        self._bound: zmq.Socket | None = None
        self.bound_endpoint: str | None = None
        if bind_endpoint is not None:
            self._bound = self._ctx.socket(zmq.SUB)
            self._bound.setsockopt(zmq.RCVHWM, 0)
            if self._curve_server is not None:
                self._curve_server.secure(self._bound)
            bind_endpoint = guarded_bind_endpoint(
                bind_endpoint, secured=curve is not None, insecure=insecure, flag="--events-insecure"
            )
            self._bound.bind(bind_endpoint[:-2] + ":*" if bind_endpoint.endswith(":0") else bind_endpoint)
            for prefix in subscriptions(topic_filter):
                self._bound.setsockopt_string(zmq.SUBSCRIBE, prefix)
            self.bound_endpoint = self._bound.getsockopt_string(zmq.LAST_ENDPOINT)
        self._running = False
        self._receiver: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._running = True
        for i, w in enumerate(self._workers):
            w.thread = threading.Thread(
                target=self._work, args=(w,), name=f"kv-events-worker-{i}", daemon=True
            )
            w.thread.start()
        self._receiver = threading.Thread(target=self._receive, name="kv-events-receiver", daemon=True)
        self._receiver.start()

    def close(self) -> None:
        self._running = False
        if self._receiver is not None:
            self._receiver.join(2.0)
        for w in self._workers:
            w.queue.put(None)
        for w in self._workers:
            if w.thread is not None:
                w.thread.join(2.0)
        if self._receiver is None and self._bound is not None:
            self._bound.close(linger=0)
        if self._curve_server is not None:
            self._curve_server.close()
            self._curve_server = None
            self._ctx.term()

    def add_pod(self, pod: str, endpoint: str | None, replay_endpoint: str | None = None) -> None:
        """Subscribe to a pod's publisher (`endpoint`), or only register its replay endpoint when
        the pod connects to our bound socket (`endpoint=None`); either way the bound socket
        accepts its topic from now on (when `allowed_pods` restricts it)."""
        if self.allowed_pods is not None:
            self.allowed_pods = self.allowed_pods | {pod}
        if replay_endpoint is not None:
            self._replay_endpoints[pod] = replay_endpoint
        if endpoint is not None:
            self._commands.put(("add", pod, endpoint))

    def remove_pod(self, pod: str) -> None:
        """Stop taking the pod's events and clear its index entries: its subscription closes on
        the receiver thread, which then queues the clearing behind the pod's pending batches, so
        no batch of the pod applies after it (the bound socket drops its topic from now on)."""
        if self.allowed_pods is not None:
            self.allowed_pods = self.allowed_pods - {pod}
        self._replay_endpoints.pop(pod, None)
        self._commands.put(("remove", pod, None))

    def stats(self) -> IntakeStats:
        with self._stats_lock:
            return IntakeStats(**vars(self._stats))

    def pending(self) -> int:
        return sum(w.pending for w in self._workers)

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """True once every queued batch is applied (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while self.pending() > 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    # --- receiving ---------------------------------------------------------------------------

    def submit(self, pod: str, seq: int, payload: bytes, stream: str = VLLM_STREAM) -> None:
        """Queue one batch for its pod's worker (the receiver's path; also usable directly).
        `stream` is VLLM_STREAM, or the chunk topic for a batch of the chunk stream."""
        w = self.worker_for(pod)
        with self._stats_lock:
            w.pending += 1
        w.queue.put(_Msg(pod, seq, payload, stream))

    def _apply_commands(self, poller: zmq.Poller) -> None:
        while True:
            try:
                op, pod, endpoint = self._commands.get_nowait()
            except queue.Empty:
                return
            old = self._subs.pop(pod, None)
            if old is not None:
                poller.unregister(old)
                old.close(linger=0)
            if op == "remove":
                w = self.worker_for(pod)
                with self._stats_lock:
                    w.pending += 1
                w.queue.put(_Msg(pod, -1, b"", forget=True))
            if op == "add" and endpoint is not None:
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.RCVHWM, 0)  # never drop silently here; the publisher's HWM rules
                try:
                    if self.curve is not None:
                        self.curve.secure_client(sock, pod)
                except ValueError as e:  # a discovered pod without a key file: not trusted
                    logger.error("not subscribing to pod %s's KV events: %s", pod, e)
                    sock.close(linger=0)
                    continue
                sock.connect(endpoint)
                for prefix in subscriptions(self.topic_filter):
                    sock.setsockopt_string(zmq.SUBSCRIBE, prefix)
                self._subs[pod] = sock
                poller.register(sock, zmq.POLLIN)

    def _receive(self) -> None:
        poller = zmq.Poller()
        if self._bound is not None:
            poller.register(self._bound, zmq.POLLIN)
        by_socket: dict[zmq.Socket, str] = {}
        try:
            while self._running:
                self._apply_commands(poller)
                by_socket = {s: p for p, s in self._subs.items()}
                if not poller.sockets:
                    time.sleep(0.05)  # zmq_poll with no sockets returns at once: do not spin
                    continue
                for sock, _ in poller.poll(50):
                    # Drain what is there: one poll per message would cost a syscall each.
                    for _ in range(1000):
                        try:
                            if sock is self._bound and self._curve_server is not None:
                                raw = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                                sender = self._curve_server.owners.get(raw[0].get("User-Id"))
                                frames = [f.bytes for f in raw]
                            else:
                                frames, sender = sock.recv_multipart(zmq.NOBLOCK), None
                        except zmq.Again:
                            break
                        self._dispatch(by_socket.get(sock), frames, sender)
        finally:
            for s in self._subs.values():
                s.close(linger=0)
            if self._bound is not None:
                self._bound.close(linger=0)

    def _dispatch(self, pod: str | None, frames: list[bytes], sender: str | None = None) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            logger.warning("dropping a KV event message with %d frames", len(frames))
            self._count(failed=1)
            return
        topic_bytes, seq_bytes, payload = frames
        topic = topic_bytes.decode(errors="replace")
        if pod is None:  # the bound socket: the topic names the pod, and must name a backend
            pod = pod_from_topic(topic)
            forged = self.curve is not None and sender != pod  # a key speaks for its own pod only
            if forged or (self.allowed_pods is not None and pod not in self.allowed_pods):
                logger.debug("dropping KV events for unknown or foreign pod %r", pod)
                self._count(unknown_topics=1)
                return
        stream = topic if is_chunk_topic(topic) else VLLM_STREAM
        self.submit(pod, int.from_bytes(seq_bytes, "big"), payload, stream)

    # --- applying (worker threads; each pod only ever on one worker) --------------------------

    def _work(self, w: _Worker) -> None:
        while True:
            msg = w.queue.get()
            if msg is None:
                break
            try:
                if msg.forget:
                    self._forget(w, msg.pod)
                else:
                    self.process(w, msg.pod, msg.seq, msg.payload, msg.stream)
            except Exception:
                logger.exception("KV event worker failed on pod %s seq %d", msg.pod, msg.seq)
            finally:
                with self._stats_lock:
                    w.pending -= 1
        for st in w.pods.values():
            if st.replay_socket is not None:
                st.replay_socket.close(linger=0)

    def worker_for(self, pod: str) -> _Worker:
        """The one worker that applies this pod's batches (FNV-1a of the pod id)."""
        return self._workers[fnv1a_64(pod.encode()) % len(self._workers)]

    def process(self, w: _Worker, pod: str, seq: int, payload: bytes, stream: str = VLLM_STREAM) -> None:
        """Apply one live batch with seq tracking (called on the pod's worker thread)."""
        st = w.pods.get(pod)
        if st is None:
            st = w.pods[pod] = _PodState(EngineKeyMap(self.keyer, self.pod_map_capacity))
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
        self, pod: str, st: _PodState, start: int, stop: int, must_fill: bool, stream: str = VLLM_STREAM
    ) -> None:
        """Fetch batches [start, stop) from the pod's replay endpoint and apply them. When the range
        does not fully arrive and `must_fill`, the pod is marked for clearing first, then only the
        contiguous tail ending at stop-1 applies (everything before the hole is unknown anyway)."""
        endpoint = self._replay_endpoints.get(pod)
        if endpoint is None:
            if must_fill:
                self._count(replay_failures=1)
                st.dirty = True
            return
        self._count(replays=1)
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
        if not (ok and all(s in got for s in range(start, stop))):
            self._count(replay_failures=1)
            if must_fill:
                st.dirty = True
            hole = stop - 1
            while hole in got:
                hole -= 1
            got = {s: p for s, p in got.items() if s > hole}
        for s in sorted(got):
            self._apply_payload(pod, st, s, got[s], stream)

    def _forget(self, w: _Worker, pod: str) -> None:
        st = w.pods.pop(pod, None)
        if st is not None and st.replay_socket is not None:
            st.replay_socket.close(linger=0)
        try:
            self.index.clear_pod(pod)
        except IndexUnavailableError as e:
            # Should a pod of this name come back, its first batch clears the old entries first.
            w.pods[pod] = _PodState(EngineKeyMap(self.keyer, self.pod_map_capacity), dirty=True)
            logger.warning("pod %s is no longer a backend, its index entries stay for now: %s", pod, e)
            return
        self._count(clears=1)
        logger.info("cleared pod %s from the index: no longer a backend", pod)

    def _clear(self, pod: str, st: _PodState, reason: str) -> None:
        self.index.clear_pod(pod)
        st.keymap.clear()
        st.chunk_tiers.clear()
        st.dirty = False
        self._count(clears=1)
        logger.info("cleared pod %s from the index: %s", pod, reason)
        if self.on_clear is not None:
            self.on_clear(pod, reason)

    def _apply_payload(
        self, pod: str, st: _PodState, seq: int, payload: bytes, stream: str = VLLM_STREAM
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
            self._count(failed=1)
            return
        except IndexUnavailableError as e:
            # Part of the batch may be applied, so the pod's entries are no longer a faithful copy:
            # cleared once the index is back.
            logger.warning("pod %s batch %d not applied: %s", pod, seq, e)
            st.dirty = True
            self._count(failed=1)
            return
        except Exception:
            st.dirty = True
            self._count(failed=1)
            raise
        self._count(batches=1, events=len(decoded.batch.events), unknown_types=len(decoded.unknown_types))

    def _weighted(self, tiers: Iterable[str], num_tokens: int) -> int:
        return round(num_tokens * tier_weight(self.tier_weights, tiers, self.unknown_tier_weight))

    def _chunks_stored(self, pod: str, st: _PodState, chunks: list[tuple[int, int]], tier: str) -> None:
        if tier == MEDIUM_REMOTE:  # shared: every replica can load it, whoever wrote it
            self.index.add_chunks(SHARED_REMOTE, [(h, self._weighted((tier,), n)) for h, n in chunks])
            return
        entries = []
        for h, n in chunks:
            tiers = st.chunk_tiers.setdefault(h, {})
            tiers[tier] = n
            entries.append((h, self._weighted(tiers, n)))
        self.index.add_chunks(pod, entries)

    def _chunks_removed(self, pod: str, st: _PodState, hashes: Sequence[int], tier: str) -> None:
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

    def apply_batch(self, pod: str, st: _PodState, batch: KVEventBatch) -> None:
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
                    self._count(rejected_claims=len(claims) - len(sane))
                self._chunks_stored(pod, st, sane, tier_of(ev.medium))
            elif isinstance(ev, ChunkRemoved):
                self._chunks_removed(pod, st, ev.chunk_hashes, tier_of(ev.medium))
        self._count(
            other_group_blocks=other,
            blocks_stored=stored,
            blocks_removed=removed,
            unresolved_blocks=keymap.unresolved_blocks - unresolved_before,
        )
