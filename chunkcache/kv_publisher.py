"""The engine's KV event publisher: a ZMQ PUB socket per engine, with a sequence-numbered replay
buffer per stream served on a ROUTER socket (vLLM's protocol, `kv_sockets.py`), and CURVE when
configured. Apart from the schema (`kv_events.py`) because only the engine publishes: the router
and the cache's bookkeeping import the events, never the sockets and threads that send them.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from chunkcache.curve import CurveKeys, CurveServer, secure_client
from chunkcache.kv_events import VLLM_EVENT_TYPES, KVEvent, KVEventBatch, chunk_topic_for, encode_batch
from chunkcache.kv_sockets import END_SEQ, guarded_bind_endpoint

logger = logging.getLogger(__name__)


def _bindable(endpoint: str) -> str:
    # ZMQ spells "any free port" as `*`; accept the usual `:0` too.
    return endpoint[:-2] + ":*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint


def _should_bind(endpoint: str) -> bool:
    # vLLM's convention: wildcard hosts, ipc and inproc bind; a concrete host:port connects (to a
    # router's bound SUB). A port of 0 can only mean "bind an ephemeral port".
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
        or endpoint.endswith(":0")
    )


@dataclass(frozen=True)
class PublisherCurve:
    """CURVE for a publisher: its own keys; the public keys allowed to connect to its bound
    sockets (a directory of `*.key`); the public key of the router when its PUB connects."""

    keys: CurveKeys
    authorized_dir: str | None = None
    server_key: bytes | None = None

    def server(self, context: zmq.Context) -> CurveServer | None:
        return None if self.authorized_dir is None else CurveServer(context, self.keys, self.authorized_dir)

    def secure_bound(self, sock: zmq.Socket, server: CurveServer | None) -> None:
        if server is None:
            raise ValueError("CURVE on a bound event socket needs the authorized public keys directory")
        server.secure(sock)

    def secure_connecting(self, sock: zmq.Socket) -> None:
        if self.server_key is None:
            raise ValueError("CURVE on a connecting event socket needs the router's public key")
        secure_client(sock, self.keys, self.server_key)


@dataclass
class _Stream:
    """One topic's sequence numbers and replay buffer."""

    topic: bytes
    buffer: deque[tuple[int, bytes]]
    next_seq: int = 0


class KVEventPublisher:
    """ZMQ PUB of KV event batches with a sequence-numbered replay buffer per topic.

    `publish()` splits a step's events into vLLM's types (the main topic) and chunk events (the
    chunk topic), encodes in the caller's thread (so later mutation of the events cannot leak into
    the payload) and hands the bytes to a background thread that owns both sockets, because ZMQ
    sockets are not thread-safe and the engine step must never wait on the network.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        data_parallel_rank: int | None = 0,
        hwm: int = 100_000,
        bind: bool | None = None,
        chunk_topic: str | None = None,
        curve: PublisherCurve | None = None,
        insecure: bool = False,
    ) -> None:
        if buffer_steps <= 0:
            raise ValueError(f"buffer_steps must be > 0, got {buffer_steps}")
        self.topic = topic
        self.chunk_topic = chunk_topic_for(topic) if chunk_topic is None else chunk_topic
        if self.chunk_topic == topic:
            raise ValueError("the chunk topic must differ from the vLLM event topic")
        self._rank = data_parallel_rank
        self._streams = {
            name: _Stream(name.encode(), deque(maxlen=buffer_steps)) for name in (topic, self.chunk_topic)
        }
        self._queue: queue.SimpleQueue[tuple[str, bytes] | None] = queue.SimpleQueue()
        # CURVE needs a ZAP handler of its own, one per context.
        self._ctx = zmq.Context() if curve is not None else zmq.Context.instance()
        self._curve_server = curve.server(self._ctx) if curve is not None else None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        self._pub_bound: str | None = None
        self.replay_endpoint: str | None = None
        try:
            self._open(endpoint, replay_endpoint, bind, curve, insecure)
        except (zmq.ZMQError, ValueError):  # ValueError: a refused endpoint or CURVE setting
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def _open(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        bind: bool | None,
        curve: PublisherCurve | None,
        insecure: bool,
    ) -> None:
        """Bind (or connect) the PUB socket and bind the replay socket, each secured when CURVE
        is configured; the caller closes what opened should one of them fail."""

        def bindable(endpoint: str) -> str:
            flag = "--kv-events-insecure"
            return _bindable(
                guarded_bind_endpoint(endpoint, secured=curve is not None, insecure=insecure, flag=flag)
            )

        if _should_bind(endpoint) if bind is None else bind:
            if curve is not None:
                curve.secure_bound(self._pub, self._curve_server)
            self._pub.bind(bindable(endpoint))
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self._pub_bound = self.endpoint
        else:
            if curve is not None:
                curve.secure_connecting(self._pub)
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            if curve is not None:
                curve.secure_bound(self._replay, self._curve_server)
            self._replay.bind(bindable(replay_endpoint))
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one step's events: up to one batch per topic; an empty list sends nothing."""
        if self._closed:
            raise RuntimeError("KVEventPublisher is closed")
        vllm = [e for e in events if isinstance(e, VLLM_EVENT_TYPES)]
        chunks = [e for e in events if not isinstance(e, VLLM_EVENT_TYPES)]
        now = time.time()
        for topic, part in ((self.topic, vllm), (self.chunk_topic, chunks)):
            if part:
                self._queue.put((topic, encode_batch(KVEventBatch(now, part, self._rank))))

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, stop the thread and release the sockets."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    @property
    def published(self) -> int:
        """Number of batches sent so far on the vLLM topic (= its next seq)."""
        return self._streams[self.topic].next_seq

    def published_on(self, topic: str) -> int:
        return self._streams[topic].next_seq

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    # Short wait: replay requests are only noticed between queue reads.
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if item is None:
                    break
                stream = self._streams[item[0]]
                payload = item[1]
                seq = stream.next_seq
                try:
                    self._pub.send_multipart((stream.topic, seq.to_bytes(8, "big"), payload))
                except zmq.ZMQError:
                    # The batch still enters the buffer: a subscriber sees the gap and replays it.
                    logger.exception("KV event publish failed (seq %d)", seq)
                stream.buffer.append((seq, payload))
                stream.next_seq = seq + 1
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) not in (3, 4) or len(frames[2]) != 8:
            logger.warning("ignoring malformed KV event replay request (%d frames)", len(frames))
            return
        client, start_bytes = frames[0], frames[2]
        stream = self._streams.get(frames[3].decode(errors="replace") if len(frames) == 4 else self.topic)
        start = int.from_bytes(start_bytes, "big")
        if stream is not None:
            for seq, payload in list(stream.buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", stream.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        # Unbind first: a closed ZMQ socket releases its port asynchronously, and an engine that
        # restarts in-process must be able to bind the same endpoint at once.
        for sock, bound in ((self._pub, self._pub_bound), (self._replay, self.replay_endpoint)):
            if sock is None:
                continue
            if bound is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.unbind(bound)
            # linger=0: a router that went away must not keep an engine from shutting down.
            sock.close(linger=0)
        if self._curve_server is not None:
            self._curve_server.close()
            self._curve_server = None
            self._ctx.term()
