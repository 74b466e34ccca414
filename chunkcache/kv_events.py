"""KV cache events in vLLM's wire format, shared by the engine (publisher) and the router (decoder).

Wire format (docs/design.md §4), compatible with vLLM and llm-d's indexer:
- ZMQ multipart `[topic, seq as 8-byte big-endian, msgpack(batch)]` on a PUB socket;
- batch = array `[ts, [events], data_parallel_rank]` (msgspec `array_like`, trailing defaults
  omitted as msgspec does);
- an event = a map tagged with `"type"`, fields in vLLM's declaration order, fields that have a
  default omitted while at it (msgspec `omit_defaults`): vLLM's current encoding. Older vLLM tagged
  arrays (`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, ...]`) decode too, and so do batches encoded as maps;
- a hash = unsigned 64-bit int, or bytes (newer vLLM) read as their low 64 bits, big-endian;
- `group_idx` names the KV cache group (vLLM's hybrid allocator), `kv_cache_spec_kind` its kind
  (`full_attention`, `sliding_window`, ...). This engine has one full-attention group, 0.

Two streams: vLLM's event types go on the configured topic (`kv@<pod>@<model>`); this project's
chunk events go on a topic of their own (`chunk_topic_for`: `chunk@<pod>@<model>`), each stream
with its own seq and replay buffer. A consumer subscribed to `kv@` (llm-d) therefore only ever
sees vLLM's types and a gap-free seq; our router subscribes to both.

Replay, vLLM's current protocol (0.33): a ROUTER socket takes `[identity, b"", start_seq (8 bytes)]`
and answers one `[identity, b"", topic, seq, payload]` per buffered batch with seq >= start, then
the end marker `[identity, b"", b"", -1 (8 bytes, signed), b""]`. vLLM 0.10 answered without the
topic frame (`[identity, b"", seq, payload]`, end `[identity, b"", -1, b""]`); `read_replay_reply`
reads both. Clients use a DEALER socket and send `[b"", start_seq]`, so every reply arrives (a REQ
socket would accept only the first one). A request may add a fourth frame naming the topic to
replay (this project's extension, for the chunk stream); without it the vLLM stream is served.
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
# The chunk pool's lower tiers (chunkcache/chunk/tiers/), in the same field: vLLM names its own
# offloaded KV "CPU"; a local disk and a remote store shared by several engines follow suit.
MEDIUM_DISK = "DISK"
MEDIUM_REMOTE = "REMOTE"
# vLLM's KVCacheSpecKind values whose blocks hold every token's KV (a prefix hit is a real hit).
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
FULL_ATTENTION = "full_attention"
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
    # vLLM's later fields (all with defaults there, so omitted from the wire while None).
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


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
# The event types vLLM's own decoder (`KVEventBatch`) knows; anything else travels on the chunk topic.
VLLM_EVENT_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


def chunk_topic_for(topic: str) -> str:
    """The chunk stream's topic for a vLLM-stream topic: `kv@pod@model` -> `chunk@pod@model`.

    It never starts with `kv@`, so a subscriber filtering on vLLM's prefix never receives it."""
    return "chunk@" + (topic[3:] if topic.startswith("kv@") else topic)


def is_chunk_topic(topic: str) -> bool:
    return topic.startswith("chunk@")


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
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
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


# Fields that have a default in vLLM's structs: msgspec (omit_defaults=True) leaves them out while
# they hold it. The others (block_hashes ... lora_name, BlockRemoved.medium) are always written.
_OMITTED_WHEN_NONE = frozenset(
    {"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
)


def encode_event(event: KVEvent) -> dict[str, Any]:
    """An event as vLLM's tagged map: `{"type": <class name>, <fields in declaration order>...}`."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for name, value in vars(event).items():
        if value is None and name in _OMITTED_WHEN_NONE:
            continue
        out[name] = value
    return out


def encode_batch(batch: KVEventBatch) -> bytes:
    body: list[Any] = [batch.ts, [encode_event(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:  # msgspec omits a trailing default of an array_like struct
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body)


def _hashes(raw: Any, what: str) -> list[int]:
    if not isinstance(raw, list | tuple):
        raise KVEventDecodeError(f"{what} must be an array, got {type(raw).__name__}")
    # Fast path (the router decodes every block of every event): all unsigned ints already.
    if raw and set(map(type, raw)) == {int} and min(raw) >= 0:
        return raw if isinstance(raw, list) else list(raw)
    return [hash_to_int(h) for h in raw]


def _group(raw: Any) -> int | None:
    if raw is None:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise KVEventDecodeError(f"group_idx must be a non-negative int, got {raw!r:.40}")
    return raw


def _opt_str(raw: Any, what: str) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise KVEventDecodeError(f"{what} must be a string, got {type(raw).__name__}")
    return raw


def _build(tag: str, f: dict[str, Any]) -> KVEvent:
    missing = [name for name in _REQUIRED[tag] if f.get(name) is None]
    if missing:
        raise KVEventDecodeError(f"{tag} event lacks {missing}")
    if tag == "BlockStored":
        parent = f.get("parent_block_hash")
        token_ids = f["token_ids"]
        if not isinstance(token_ids, list | tuple):
            raise KVEventDecodeError("BlockStored token_ids must be an array")
        window = f.get("kv_cache_spec_sliding_window")
        return BlockStored(
            block_hashes=_hashes(f["block_hashes"], "block_hashes"),
            parent_block_hash=None if parent is None else hash_to_int(parent),
            token_ids=token_ids if isinstance(token_ids, list) else list(token_ids),
            block_size=int(f["block_size"]),
            lora_id=f.get("lora_id"),
            medium=f.get("medium"),
            lora_name=f.get("lora_name"),
            extra_keys=f.get("extra_keys"),
            group_idx=_group(f.get("group_idx")),
            kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
            kv_cache_spec_sliding_window=None if window is None else int(window),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(
            _hashes(f["block_hashes"], "block_hashes"), f.get("medium"), _group(f.get("group_idx"))
        )
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


@dataclass
class ReplayReply:
    """One reply frame set read by a replay client (DEALER): a batch, or the end marker."""

    seq: int
    payload: bytes
    topic: bytes | None  # None in vLLM 0.10's layout, which has no topic frame
    end: bool


def read_replay_reply(frames: Sequence[bytes]) -> ReplayReply | None:
    """A replay reply as a DEALER receives it, in either vLLM layout; None if it is neither.

    vLLM 0.33: `[b"", topic, seq, payload]`, end `[b"", b"", END_SEQ, b""]`.
    vLLM 0.10: `[b"", seq, payload]`, end `[b"", END_SEQ, b""]`.
    """
    if len(frames) == 4 and frames[0] == b"" and len(frames[2]) == 8:
        _, topic, seq_bytes, payload = frames
    elif len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8:
        _, seq_bytes, payload = frames
        topic = None
    else:
        return None
    if seq_bytes == END_SEQ:
        return ReplayReply(-1, b"", topic, True)
    return ReplayReply(int.from_bytes(seq_bytes, "big"), payload, topic, False)


def replay_request(start_seq: int, topic: str | None = None) -> list[bytes]:
    """The frames a DEALER sends to ask for batches from `start_seq` on (vLLM's request; a topic
    frame asks this project's publisher for another stream than vLLM's)."""
    frames = [b"", start_seq.to_bytes(8, "big")]
    if topic is not None:
        frames.append(topic.encode())
    return frames


def _bindable(endpoint: str) -> str:
    # ZMQ spells "any free port" as `*`; accept the usual `:0` too.
    return endpoint[:-2] + ":*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint


_WILDCARD_HOSTS = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]", "::1"})


def guarded_bind_endpoint(endpoint: str, *, secured: bool, insecure: bool, flag: str) -> str:
    """The endpoint to bind a KV-event socket on. Without CURVE anyone who reaches such a socket
    reads other clients' prompt token ids (PUB, replay) or forges events (a router's SUB), so a
    wildcard host binds loopback only, and any other non-loopback address is refused, unless
    `insecure` (the command line's `flag`) says that is meant; that case logs a warning.
    ipc:// and inproc:// endpoints are local and kept."""
    if not endpoint.startswith("tcp://") or secured:
        return endpoint
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or host in _LOOPBACK_HOSTS or host.startswith("127."):
        return endpoint
    if insecure:
        logger.warning(
            "KV events: %s is bound on a non-loopback address without CURVE (%s): anyone who can reach "
            "it reads cached prompts' token ids or forges events",
            endpoint,
            flag,
        )
        return endpoint
    if host in _WILDCARD_HOSTS:
        bound = f"tcp://{_WILDCARD_HOSTS[host]}:{port}"
        logger.info("KV events: binding %s on loopback (no CURVE keys; %s binds every address)", bound, flag)
        return bound
    raise ValueError(
        f"KV event endpoint {endpoint} binds a non-loopback address without CURVE: configure CURVE "
        f"keys, bind 127.0.0.1, or pass {flag} to accept unauthenticated access"
    )


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

        def bindable(endpoint: str) -> str:
            flag = "--kv-events-insecure"
            return _bindable(
                guarded_bind_endpoint(endpoint, secured=curve is not None, insecure=insecure, flag=flag)
            )

        try:
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
        except (zmq.ZMQError, ValueError):  # ValueError: a refused endpoint or CURVE setting
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

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
