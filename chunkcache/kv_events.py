"""KV cache events in vLLM's wire format: the schema and its codec, shared by the engine
(publisher, `kv_publisher.py`) and the router (decoder, `router/events.py`).

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

The sockets are elsewhere: the replay protocol and the bind guard both ends share in
`kv_sockets.py`, the engine's publisher in `kv_publisher.py`. This module is data only (no ZMQ),
the part every layer imports (core/, chunk/, the router).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

MEDIUM_GPU = "GPU"
# The chunk pool's lower tiers (chunkcache/chunk/tiers/), in the same field: vLLM names its own
# offloaded KV "CPU"; a local disk and a remote store shared by several engines follow suit.
MEDIUM_DISK = "DISK"
MEDIUM_REMOTE = "REMOTE"
# vLLM's KVCacheSpecKind values whose blocks hold every token's KV (a prefix hit is a real hit).
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
FULL_ATTENTION = "full_attention"
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
