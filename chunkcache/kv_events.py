"""KV cache events in vLLM's wire format, shared by the engine (publisher) and the router (decoder).

Wire format (DESIGN.md §4), compatible with vLLM and llm-d's indexer:
- ZMQ multipart `[topic, seq as 8-byte big-endian, msgpack(batch)]` on a PUB socket;
- batch = array `[ts, [events], data_parallel_rank]`;
- an event = a map tagged with `"type"` (vLLM's current encoding). Older vLLM tagged arrays
  (`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, ...]`) decode too, and so do batches encoded as maps;
- a hash = unsigned 64-bit int, or bytes (newer vLLM) read as their low 64 bits, big-endian.

Replay (vLLM's protocol): a ROUTER socket takes `[identity, b"", start_seq (8 bytes)]` and answers
one `[identity, b"", seq, payload]` per buffered batch with seq >= start, then an end marker whose
seq is -1 (8 bytes, signed) and whose payload is empty. Clients use a DEALER socket and send
`[b"", start_seq]`, so every reply arrives (a REQ socket would accept only the first one).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from chunkcache.curve import CurveKeys, CurveServer, secure_client

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
# Seq of the replay end marker: -1 as a signed 8-byte big-endian int.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_U64 = 2**64 - 1


@dataclass
class BlockStored:
    """Full blocks entered the prefix cache; `token_ids` holds every block's tokens, in order."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


@dataclass
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (reset, restart)."""


@dataclass
class ChunkStored:
    """Chunks entered the chunk pool; `num_tokens[i]` is the length of chunk i (this project's event)."""

    chunk_hashes: list[int]
    num_tokens: list[int]
    medium: str | None = MEDIUM_GPU


@dataclass
class ChunkRemoved:
    chunk_hashes: list[int]
    medium: str | None = MEDIUM_GPU


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | ChunkStored | ChunkRemoved


@dataclass
class KVEventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


@dataclass
class DecodedBatch:
    batch: KVEventBatch
    # Tags of events this decoder does not know (skipped, not an error: newer engines add types).
    unknown_types: list[str] = field(default_factory=list)


class KVEventDecodeError(ValueError):
    """A payload that is not a KV event batch, or a known event with malformed fields."""


# Field order of each event in vLLM's tagged-array encoding (after the tag). Trailing fields with
# default values are omitted by msgspec, and older versions lack the later fields.
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
    "ChunkStored": ("chunk_hashes", "num_tokens", "medium"),
    "ChunkRemoved": ("chunk_hashes", "medium"),
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
    "ChunkStored": ("chunk_hashes", "num_tokens"),
    "ChunkRemoved": ("chunk_hashes",),
}


def hash_to_int(raw: Any) -> int:
    """An engine hash as an unsigned 64-bit int: ints as is (masked), bytes by their low 64 bits."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw & _U64
    if isinstance(raw, bytes | bytearray) and raw:
        return int.from_bytes(raw[-8:], "big")
    raise KVEventDecodeError(f"block hash must be an int or non-empty bytes, got {type(raw).__name__}")


def encode_event(event: KVEvent) -> dict[str, Any]:
    """An event as vLLM's tagged map: `{"type": <class name>, <fields>...}`."""
    out: dict[str, Any] = {"type": type(event).__name__}
    out.update(vars(event))
    return out


def encode_batch(batch: KVEventBatch) -> bytes:
    return msgpack.packb([batch.ts, [encode_event(e) for e in batch.events], batch.data_parallel_rank])


def _hashes(raw: Any, what: str) -> list[int]:
    if not isinstance(raw, list | tuple):
        raise KVEventDecodeError(f"{what} must be an array, got {type(raw).__name__}")
    # Fast path (the router decodes every block of every event): all unsigned ints already.
    if raw and set(map(type, raw)) == {int} and min(raw) >= 0:
        return raw if isinstance(raw, list) else list(raw)
    return [hash_to_int(h) for h in raw]


def _build(tag: str, f: dict[str, Any]) -> KVEvent:
    missing = [name for name in _REQUIRED[tag] if f.get(name) is None]
    if missing:
        raise KVEventDecodeError(f"{tag} event lacks {missing}")
    if tag == "BlockStored":
        parent = f.get("parent_block_hash")
        token_ids = f["token_ids"]
        if not isinstance(token_ids, list | tuple):
            raise KVEventDecodeError("BlockStored token_ids must be an array")
        return BlockStored(
            block_hashes=_hashes(f["block_hashes"], "block_hashes"),
            parent_block_hash=None if parent is None else hash_to_int(parent),
            token_ids=token_ids if isinstance(token_ids, list) else list(token_ids),
            block_size=int(f["block_size"]),
            lora_id=f.get("lora_id"),
            medium=f.get("medium"),
            lora_name=f.get("lora_name"),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(f["block_hashes"], "block_hashes"), f.get("medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "ChunkStored":
        hashes = _hashes(f["chunk_hashes"], "chunk_hashes")
        num_tokens = [int(n) for n in f["num_tokens"]]
        if len(num_tokens) != len(hashes):
            raise KVEventDecodeError(f"ChunkStored has {len(hashes)} hashes but {len(num_tokens)} lengths")
        return ChunkStored(hashes, num_tokens, f.get("medium"))
    return ChunkRemoved(_hashes(f["chunk_hashes"], "chunk_hashes"), f.get("medium"))


def decode_event(raw: Any) -> KVEvent | str:
    """One event in either vLLM encoding; an unknown tag is returned as its name (a str)."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list | tuple) and raw:
        tag = raw[0]
        names = _ARRAY_FIELDS.get(tag, ()) if isinstance(tag, str) else ()
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise KVEventDecodeError(f"an event must be a tagged map or a tagged array, got {raw!r:.80}")
    if not isinstance(tag, str):
        raise KVEventDecodeError(f"event tag must be a string, got {tag!r:.80}")
    if tag not in _ARRAY_FIELDS:
        return tag
    try:
        return _build(tag, fields)
    except (TypeError, ValueError) as e:
        if isinstance(e, KVEventDecodeError):
            raise
        raise KVEventDecodeError(f"malformed {tag} event: {e}") from e


def decode_batch(payload: bytes) -> DecodedBatch:
    """A msgpack batch in any encoding vLLM has used (array or map batch; tagged maps or arrays)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise KVEventDecodeError(f"payload is not msgpack: {e}") from e
    if isinstance(obj, list | tuple) and len(obj) >= 2:
        ts, raw_events, rank = obj[0], obj[1], (obj[2] if len(obj) > 2 else None)
    elif isinstance(obj, dict) and "events" in obj:
        ts, raw_events, rank = obj.get("ts", 0.0), obj["events"], obj.get("data_parallel_rank")
    else:
        raise KVEventDecodeError(f"a batch must be [ts, events, dp_rank] or a map, got {obj!r:.80}")
    if not isinstance(raw_events, list | tuple):
        raise KVEventDecodeError("batch events must be an array")
    events: list[KVEvent] = []
    unknown: list[str] = []
    for raw in raw_events:
        ev = decode_event(raw)
        if isinstance(ev, str):
            unknown.append(ev)
        else:
            events.append(ev)
    return DecodedBatch(KVEventBatch(float(ts), events, rank), unknown)


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


class KVEventPublisher:
    """ZMQ PUB of KV event batches with a sequence-numbered replay buffer.

    `publish()` encodes in the caller's thread (so later mutation of the events cannot leak into
    the payload) and hands the bytes to a background thread that owns both sockets, because ZMQ
    sockets are not thread-safe and the engine step must never wait on the network.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        data_parallel_rank: int | None = None,
        hwm: int = 100_000,
        bind: bool | None = None,
        curve: PublisherCurve | None = None,
    ) -> None:
        if buffer_steps <= 0:
            raise ValueError(f"buffer_steps must be > 0, got {buffer_steps}")
        self.topic = topic
        self._topic_bytes = topic.encode()
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        # CURVE needs a ZAP handler of its own, one per context.
        self._ctx = zmq.Context() if curve is not None else zmq.Context.instance()
        self._curve_server = curve.server(self._ctx) if curve is not None else None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        self._pub_bound: str | None = None
        self.replay_endpoint: str | None = None
        try:
            if _should_bind(endpoint) if bind is None else bind:
                if curve is not None:
                    curve.secure_bound(self._pub, self._curve_server)
                self._pub.bind(_bindable(endpoint))
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
                self._replay.bind(_bindable(replay_endpoint))
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._next_seq = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one batch (one engine step's events); an empty list sends nothing."""
        if self._closed:
            raise RuntimeError("KVEventPublisher is closed")
        if not events:
            return
        self._queue.put(encode_batch(KVEventBatch(time.time(), list(events), self._rank)))

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, stop the thread and release the sockets."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    @property
    def published(self) -> int:
        """Number of batches sent so far (= the next seq)."""
        return self._next_seq

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    # Short wait: replay requests are only noticed between queue reads.
                    payload = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if payload is None:
                    break
                seq = self._next_seq
                try:
                    self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
                except zmq.ZMQError:
                    # The batch still enters the buffer: a subscriber sees the gap and replays it.
                    logger.exception("KV event publish failed (seq %d)", seq)
                self._buffer.append((seq, payload))
                self._next_seq = seq + 1
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

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
