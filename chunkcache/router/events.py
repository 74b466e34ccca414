"""KV event intake: ZMQ subscribers -> per-pod ordered workers -> the index (docs/design.md §4).

One receiver thread polls a SUB socket per pod (connected to the pod's publisher), and optionally
one bound SUB socket that pods connect to (pod id = the topic's `kv@<pod>@<model>` middle part).
Messages go to a pool of workers sharded by FNV-1a(pod id), so each pod's batches apply in order
while different pods proceed in parallel.

A pod publishes up to two streams, each with its own seq: vLLM's events on its `kv@...` topic and
this project's chunk events on `chunk@...` (kv_events.py). Seq tracking and replay are per stream;
a lost batch on either clears the whole pod. What a worker does with a pod's batch (seq tracking,
replay, clearing, the events as index entries) is `router/pod_events.py`; this module is the
sockets, the threads and the sharding in front of it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from chunkcache.curve import CurveKeys, CurveServer, load_public_key, secure_client
from chunkcache.kv_events import chunk_topic_for, is_chunk_topic
from chunkcache.kv_sockets import guarded_bind_endpoint
from chunkcache.router.index import KVIndex
from chunkcache.router.pod_events import VLLM_STREAM, PodEvents, PodState
from chunkcache.router.tokens import BlockKeyer

logger = logging.getLogger(__name__)

_FNV64_OFFSET = 0xCBF29CE484222325
_FNV64_PRIME = 0x100000001B3


def fnv1a_64(data: bytes) -> int:
    h = _FNV64_OFFSET
    for b in data:
        h = ((h ^ b) * _FNV64_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


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
    pods: dict[str, PodState] = field(default_factory=dict)  # only this worker touches them
    pending: int = 0
    thread: threading.Thread | None = None


class EventIntake:
    """The router's KV event intake: a receiver thread and the workers behind it (see above)."""

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
        self._stats = IntakeStats()
        self._stats_lock = threading.Lock()
        self._replay_endpoints: dict[str, str] = {}
        self._workers = [_Worker() for _ in range(num_workers)]
        # CURVE needs a ZAP handler of its own, one per context.
        self._ctx = zmq.Context() if curve is not None else zmq.Context.instance()
        self._curve_server = (
            None if curve is None else CurveServer(self._ctx, curve.keys, curve.backend_keys_dir)
        )
        self._pods = PodEvents(
            index,
            self.keyer,
            self._count,
            self._replay_endpoints,
            self._ctx,
            curve=curve,
            replay_timeout_s=replay_timeout_s,
            pod_map_capacity=pod_map_capacity,
            on_clear=on_clear,
            tier_weights=tier_weights,
            unknown_tier_weight=unknown_tier_weight,
        )
        self._commands: queue.SimpleQueue[tuple[str, str, str | None]] = queue.SimpleQueue()
        self._subs: dict[str, zmq.Socket] = {}
        self._bound: zmq.Socket | None = None
        self.bound_endpoint: str | None = None
        if bind_endpoint is not None:
            self._bind(bind_endpoint, insecure)
        self._running = False
        self._receiver: threading.Thread | None = None

    def _bind(self, endpoint: str, insecure: bool) -> None:
        """The SUB socket that pods connect to (CURVE-secured when configured; a non-loopback
        address without CURVE only when `insecure`)."""
        self._bound = self._ctx.socket(zmq.SUB)
        self._bound.setsockopt(zmq.RCVHWM, 0)
        if self._curve_server is not None:
            self._curve_server.secure(self._bound)
        endpoint = guarded_bind_endpoint(
            endpoint, secured=self.curve is not None, insecure=insecure, flag="--events-insecure"
        )
        self._bound.bind(endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint)
        for prefix in subscriptions(self.topic_filter):
            self._bound.setsockopt_string(zmq.SUBSCRIBE, prefix)
        self.bound_endpoint = self._bound.getsockopt_string(zmq.LAST_ENDPOINT)

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
                    self._pods.forget(w.pods, msg.pod)
                else:
                    self._pods.process(w.pods, msg.pod, msg.seq, msg.payload, msg.stream)
            except Exception:
                logger.exception("KV event worker failed on pod %s seq %d", msg.pod, msg.seq)
            finally:
                with self._stats_lock:
                    w.pending -= 1
        self._pods.close(w.pods)

    def worker_for(self, pod: str) -> _Worker:
        """The one worker that applies this pod's batches (FNV-1a of the pod id)."""
        return self._workers[fnv1a_64(pod.encode()) % len(self._workers)]
