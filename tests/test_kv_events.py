"""The KV event schema and publisher: vLLM's wire format over real ZMQ sockets on loopback."""

from __future__ import annotations

import logging
import struct
import time

import msgpack
import pytest
import zmq

from chunkcache.config import EngineConfig
from chunkcache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChunkRemoved,
    ChunkStored,
    KVEventBatch,
    KVEventDecodeError,
    chunk_topic_for,
    decode_batch,
    encode_batch,
    hash_to_int,
)
from chunkcache.kv_publisher import KVEventPublisher
from chunkcache.kv_sockets import ReplayReply, guarded_bind_endpoint, read_replay_reply, replay_request

BIG = 2**64 - 5  # above 2**63: must survive as an unsigned int


def sample_events() -> list:
    return [
        BlockStored([BIG, 7], None, list(range(32)), 16, None, "GPU", None),
        BlockStored([9], 7, list(range(32, 48)), 16, 3, "CPU", "adapter"),
        BlockRemoved([BIG], "GPU"),
        AllBlocksCleared(),
        ChunkStored([11, 12], [100, 250], "GPU"),
        ChunkRemoved([11], "GPU"),
    ]


def test_round_trip_all_event_types() -> None:
    batch = KVEventBatch(123.5, sample_events(), 2)
    decoded = decode_batch(encode_batch(batch))
    assert decoded.batch == batch
    assert decoded.unknown_types == []


def _str(s: str) -> bytes:
    """msgpack fixstr (every name here is shorter than 32 bytes)."""
    assert len(s) < 32
    return bytes([0xA0 | len(s)]) + s.encode()


def test_wire_bytes_are_vllm_current() -> None:
    """The bytes vLLM's msgspec structs give (vllm/distributed/kv_events.py): EventBatch is
    `array_like` with `omit_defaults`, events are tagged maps (`tag=True`) with the tag first and
    the fields in declaration order; fields that have a default are left out while they hold it
    (BlockStored's extra_keys, group_idx, kv_cache_spec_*), those without one always written."""
    removed = BlockRemoved([7], "GPU", group_idx=0)
    expected = (
        b"\x93"  # [ts, events, data_parallel_rank]
        + b"\xcb" + struct.pack(">d", 1.5)  # msgspec writes floats as float64
        + b"\x91"  # one event
        + b"\x84" + _str("type") + _str("BlockRemoved")
        + _str("block_hashes") + b"\x91\x07"
        + _str("medium") + _str("GPU")
        + _str("group_idx") + b"\x00"
        + b"\x00"  # data_parallel_rank 0
    )  # fmt: skip
    assert encode_batch(KVEventBatch(1.5, [removed], 0)) == expected
    # data_parallel_rank None is the struct's default: msgspec drops the trailing element.
    assert encode_batch(KVEventBatch(1.5, [removed], None)) == b"\x92" + expected[1:-1]
    # BlockRemoved without group_idx (vLLM <= 0.10's fields) omits it.
    assert msgpack.unpackb(encode_batch(KVEventBatch(1.5, [BlockRemoved([7], None)], 0)))[1] == [
        {"type": "BlockRemoved", "block_hashes": [7], "medium": None}
    ]
    stored = BlockStored([BIG], 7, [1, 2], 2, None, "GPU", None, group_idx=1, kv_cache_spec_kind="sliding_window",
                         kv_cache_spec_sliding_window=4096)  # fmt: skip
    ordered = [
        ("type", "BlockStored"),
        ("block_hashes", [BIG]),
        ("parent_block_hash", 7),
        ("token_ids", [1, 2]),
        ("block_size", 2),
        ("lora_id", None),
        ("medium", "GPU"),
        ("lora_name", None),
        ("group_idx", 1),
        ("kv_cache_spec_kind", "sliding_window"),
        ("kv_cache_spec_sliding_window", 4096),
    ]
    body = b"\x8b" + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in ordered)
    assert (
        encode_batch(KVEventBatch(1.5, [stored], 0))
        == b"\x93\xcb" + struct.pack(">d", 1.5) + b"\x91" + body + b"\x00"
    )
    assert msgpack.packb(BIG) == b"\xcf" + BIG.to_bytes(8, "big")  # uint64, never a negative int64


def test_tagged_arrays_decode_like_tagged_maps() -> None:
    tokens = list(range(16))
    arrays = msgpack.packb(
        [
            9.0,
            [
                ["BlockStored", [1, 2], None, tokens * 2, 16, None, "GPU"],
                ["BlockStored", [3], 2, tokens, 16, None],  # oldest vLLM: no medium field at all
                ["BlockRemoved", [1], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    maps = msgpack.packb(
        {
            "ts": 9.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [1, 2],
                    "parent_block_hash": None,
                    "token_ids": tokens * 2,
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                },
                {
                    "type": "BlockStored",
                    "block_hashes": [3],
                    "parent_block_hash": 2,
                    "token_ids": tokens,
                    "block_size": 16,
                },
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
        }
    )
    a, m = decode_batch(arrays).batch, decode_batch(maps).batch
    assert a == m
    assert a.events[1] == BlockStored([3], 2, tokens, 16, None, None, None)


def test_newer_vllm_fields_decode_and_unknown_ones_are_ignored() -> None:
    # vLLM appends extra_keys, group_idx, kv_cache_spec_* after lora_name (array and map forms);
    # later versions add event_version, locality, ownership, which this decoder does not use.
    arrays = msgpack.packb(
        [1.0, [["BlockStored", [5], None, list(range(16)), 16, None, "GPU", None, None, 1, "sliding_window", 128],
               ["BlockRemoved", [5], "GPU", 1]]]
    )  # fmt: skip
    maps = msgpack.packb(
        [1.0, [{"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": list(range(16)),
                "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "event_version": 1,
                "group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 128,
                "locality": "LOCAL"},
               {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 1, "ownership": None}], 0]
    )  # fmt: skip
    want = [
        BlockStored([5], None, list(range(16)), 16, None, "GPU", None, None, 1, "sliding_window", 128),
        BlockRemoved([5], "GPU", 1),
    ]
    assert decode_batch(arrays).batch.events == want
    assert decode_batch(maps).batch.events == want
    with pytest.raises(KVEventDecodeError):
        decode_batch(msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [5], "group_idx": -1}]]))


def test_hashes_as_bytes_use_low_64_bits() -> None:
    digest = bytes(range(32))
    assert hash_to_int(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert hash_to_int(b"\x01\x02") == 0x0102
    assert hash_to_int(-1) == 2**64 - 1  # a signed msgpack int64 read as unsigned
    payload = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [digest], "medium": None}]])
    assert decode_batch(payload).batch.events == [BlockRemoved([hash_to_int(digest)], None)]


def test_unknown_event_types_are_counted_and_skipped() -> None:
    payload = msgpack.packb(
        [1.0, [["FutureEvent", 1, 2], {"type": "Other"}, ["BlockRemoved", [4], "GPU"]], 0]
    )
    decoded = decode_batch(payload)
    assert decoded.unknown_types == ["FutureEvent", "Other"]
    assert decoded.batch.events == [BlockRemoved([4], "GPU")]
    assert decoded.batch.data_parallel_rank == 0


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1not msgpack",
        msgpack.packb(42),
        msgpack.packb([1.0, "events"]),
        msgpack.packb([1.0, [["BlockStored", [1], None]]]),  # missing token_ids and block_size
        msgpack.packb([1.0, [["BlockRemoved", [1.5], "GPU"]]]),  # a float hash
        msgpack.packb([1.0, [["ChunkStored", [1, 2], [10], "GPU"]]]),  # lengths mismatch
        msgpack.packb([1.0, [[7, 1]]]),  # a non-string tag
    ],
)
def test_malformed_payloads_raise(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def _recv(sock: zmq.Socket, timeout_ms: int = 3000) -> list[bytes]:
    assert sock.poll(timeout_ms), "no message arrived"
    return sock.recv_multipart()


@pytest.fixture
def ctx() -> zmq.Context:
    return zmq.Context.instance()


def _subscribed(ctx: zmq.Context, pub: KVEventPublisher) -> tuple[zmq.Socket, int]:
    """A SUB socket that is known to receive (PUB drops messages until a subscription reaches it,
    ZMQ's slow joiner), and the next seq the publisher will use."""
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    deadline = time.monotonic() + 10
    while True:
        pub.publish([BlockRemoved([0])])  # a probe
        if sub.poll(100):
            seq = int.from_bytes(sub.recv_multipart()[1], "big")
            break
        assert time.monotonic() < deadline, "subscription never reached the publisher"
    while sub.poll(200):  # probes still in flight
        seq = int.from_bytes(sub.recv_multipart()[1], "big")
    return sub, seq + 1


def test_publisher_frames_seq_and_empty_batches(ctx: zmq.Context) -> None:
    pub = KVEventPublisher("tcp://127.0.0.1:0", topic="kv@pod-a@tiny")
    sub, first = _subscribed(ctx, pub)
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
        pub.publish([])  # nothing to say: nothing sent, no seq used
        pub.publish([AllBlocksCleared()])
        pub.publish([BlockRemoved([1])])
        frames = [_recv(sub), _recv(sub)]
        assert [f[0] for f in frames] == [b"kv@pod-a@tiny"] * 2
        assert [int.from_bytes(f[1], "big") for f in frames] == [first, first + 1]
        assert all(len(f[1]) == 8 for f in frames)
        assert decode_batch(frames[1][2]).batch.events == [BlockRemoved([1], "GPU")]
        assert not sub.poll(100)
    finally:
        sub.close(linger=0)
        pub.close()


def _replay(
    ctx: zmq.Context, endpoint: str, start: int, topic: bytes = b"", ask: list[bytes] | None = None
) -> list[tuple[int, bytes]]:
    """A replay as a client written for vLLM 0.33 reads it: `[b"", topic, seq, payload]` per batch,
    then `[b"", b"", -1 as 8 signed bytes, b""]`."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big"), *(ask or [])])
        out = []
        while True:
            frames = _recv(dealer)
            assert len(frames) == 4 and frames[0] == b"", frames
            _, got_topic, seq, payload = frames
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert got_topic == b"" and payload == b""
                return out
            assert got_topic == topic
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def test_replay_serves_buffered_batches_from_a_seq(ctx: zmq.Context) -> None:
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=3)
    try:
        for i in range(5):
            pub.publish([BlockRemoved([i])])
        deadline = time.monotonic() + 3
        while pub.published < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        got = _replay(ctx, pub.replay_endpoint, 3)
        assert [s for s, _ in got] == [3, 4]
        assert decode_batch(got[0][1]).batch.events == [BlockRemoved([3])]
        # Only the last `buffer_steps` batches are kept: seq 0 and 1 are gone.
        assert [s for s, _ in _replay(ctx, pub.replay_endpoint, 0)] == [2, 3, 4]
        assert _replay(ctx, pub.replay_endpoint, 9) == []
    finally:
        pub.close()


def test_chunk_events_travel_on_their_own_topic_and_seq(ctx: zmq.Context) -> None:
    """A consumer subscribed to vLLM's `kv@` prefix (llm-d) sees only vLLM's event types and a
    gap-free seq; the chunk stream has its own topic, seq and replay."""
    pub = KVEventPublisher("tcp://127.0.0.1:0", topic="kv@pod-a@tiny", replay_endpoint="tcp://127.0.0.1:0")
    assert pub.chunk_topic == "chunk@pod-a@tiny" == chunk_topic_for("kv@pod-a@tiny")
    vllm_sub = ctx.socket(zmq.SUB)
    vllm_sub.connect(pub.endpoint)
    vllm_sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    all_sub, _ = _subscribed(ctx, pub)
    try:
        deadline = time.monotonic() + 10
        while not vllm_sub.poll(100):  # the kv@ subscription reaches the publisher too
            assert time.monotonic() < deadline
            pub.publish([BlockRemoved([0])])
        while vllm_sub.poll(200):
            first = int.from_bytes(vllm_sub.recv_multipart()[1], "big") + 1
        while all_sub.poll(200):
            all_sub.recv_multipart()
        for i in range(3):
            pub.publish([BlockRemoved([i]), ChunkStored([100 + i], [5]), ChunkRemoved([99])])
        pub.publish([ChunkRemoved([100])])  # a step with only chunk events
        got = [_recv(vllm_sub) for _ in range(3)]
        assert not vllm_sub.poll(200)
        assert [f[0] for f in got] == [b"kv@pod-a@tiny"] * 3
        assert [int.from_bytes(f[1], "big") for f in got] == [first, first + 1, first + 2]
        for i, f in enumerate(got):
            decoded = decode_batch(f[2])
            assert decoded.batch.events == [BlockRemoved([i])]
            # What vLLM's KVEventBatch decoder accepts: only its own tags.
            assert {e["type"] for e in msgpack.unpackb(f[2])[1]} <= {
                "BlockStored",
                "BlockRemoved",
                "AllBlocksCleared",
            }
        frames = [_recv(all_sub) for _ in range(7)]
        chunk_frames = [f for f in frames if f[0] == b"chunk@pod-a@tiny"]
        assert [int.from_bytes(f[1], "big") for f in chunk_frames] == [0, 1, 2, 3]
        assert decode_batch(chunk_frames[1][2]).batch.events == [ChunkStored([101], [5]), ChunkRemoved([99])]
        # Replay: vLLM's 3-frame request serves the vLLM stream; a topic frame names the chunk stream.
        assert [s for s, _ in _replay(ctx, pub.replay_endpoint, first, b"kv@pod-a@tiny")] == [
            first,
            first + 1,
            first + 2,
        ]
        chunk_replay = _replay(ctx, pub.replay_endpoint, 2, b"chunk@pod-a@tiny", ask=[b"chunk@pod-a@tiny"])
        assert [s for s, _ in chunk_replay] == [2, 3]
        assert decode_batch(chunk_replay[1][1]).batch.events == [ChunkRemoved([100])]
        assert _replay(ctx, pub.replay_endpoint, 0, ask=[b"no-such-topic"]) == []
    finally:
        vllm_sub.close(linger=0)
        all_sub.close(linger=0)
        pub.close()


def test_replay_replies_of_both_vllm_generations_read() -> None:
    payload = b"\x92\xcb" + struct.pack(">d", 1.0) + b"\x90"
    seven = (7).to_bytes(8, "big")
    end = (-1).to_bytes(8, "big", signed=True)
    # vLLM 0.33: [b"", topic, seq, payload]; end [b"", b"", -1, b""].
    assert read_replay_reply([b"", b"kv@p@m", seven, payload]) == ReplayReply(7, payload, b"kv@p@m", False)
    assert read_replay_reply([b"", b"", end, b""]).end
    # vLLM 0.10: [b"", seq, payload]; end [b"", -1, b""].
    assert read_replay_reply([b"", seven, payload]) == ReplayReply(7, payload, None, False)
    assert read_replay_reply([b"", end, b""]).end
    assert read_replay_reply([b"", b"short", payload]) is None
    assert read_replay_reply([seven, payload]) is None
    assert replay_request(5) == [b"", (5).to_bytes(8, "big")]
    assert replay_request(5, "chunk@p@m") == [b"", (5).to_bytes(8, "big"), b"chunk@p@m"]


def test_close_releases_the_port_and_rejects_publishing(ctx: zmq.Context) -> None:
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    pub.close()
    with pytest.raises(RuntimeError):
        pub.publish([AllBlocksCleared()])
    # libzmq tears listeners down on its I/O thread, so the port frees shortly after close().
    deadline = time.monotonic() + 5
    while True:
        try:
            again = KVEventPublisher(endpoint, replay_endpoint=replay, bind=True)
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline, "the ports were never released"
            time.sleep(0.05)
    assert again.endpoint == endpoint
    again.close()


def test_publisher_can_connect_to_a_bound_subscriber(ctx: zmq.Context) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.bind("tcp://127.0.0.1:*")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    pub = KVEventPublisher(endpoint, topic="kv@p1@m")  # a concrete host:port connects
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(100):
            assert time.monotonic() < deadline, "nothing arrived"
            pub.publish([AllBlocksCleared()])
        assert sub.recv_multipart()[0] == b"kv@p1@m"
    finally:
        pub.close()
        sub.close(linger=0)


def test_wildcard_binds_loopback_without_curve(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 35: `tcp://*` without CURVE let anyone on the network read prompts' token ids from the
    replay socket. A wildcard now binds loopback unless insecure binding is asked for, with a warning."""
    pub = KVEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0")
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint.startswith(
            "tcp://127.0.0.1:"
        )
    finally:
        pub.close()
    with caplog.at_level(logging.WARNING, logger="chunkcache.kv_sockets"):
        pub = KVEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0", insecure=True)
    try:
        assert pub.endpoint.startswith("tcp://0.0.0.0:") and pub.replay_endpoint.startswith("tcp://0.0.0.0:")
        assert "without CURVE" in caplog.text
    finally:
        pub.close()
    with pytest.raises(ValueError, match="--kv-events-insecure"):
        guarded_bind_endpoint(
            "tcp://10.1.2.3:5557", secured=False, insecure=False, flag="--kv-events-insecure"
        )
    # CURVE-secured sockets, loopback and local transports are bound as given.
    for endpoint in ("tcp://10.1.2.3:5557", "tcp://*:5557"):
        assert guarded_bind_endpoint(endpoint, secured=True, insecure=False, flag="-") == endpoint
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "ipc:///tmp/x", "inproc://x"):
        assert guarded_bind_endpoint(endpoint, secured=False, insecure=False, flag="-") == endpoint
    assert (
        guarded_bind_endpoint("tcp://[::]:5557", secured=False, insecure=False, flag="-")
        == "tcp://[::1]:5557"
    )


def test_kv_events_insecure_is_an_engine_option() -> None:
    config = EngineConfig.from_options(
        "m", use_env=False, kv_events_endpoint="tcp://*:5557", kv_events_insecure=True
    )
    assert config.kv_events.insecure is True
    assert EngineConfig.from_options("m", use_env=False).kv_events.insecure is False


def test_engine_passes_kv_events_insecure_to_its_publisher(checkpoint) -> None:
    from chunkcache.engine.engine import LLMEngine

    model = str(checkpoint("llama"))
    for insecure, host in ((False, "127.0.0.1"), (True, "0.0.0.0")):
        options = {"device": "cpu", "kv_cache_tokens": 256, "kv_events_endpoint": "tcp://*:0"}
        engine = LLMEngine(
            EngineConfig.from_options(model, use_env=False, kv_events_insecure=insecure, **options)
        )
        try:
            assert engine.publisher is not None and engine.publisher.endpoint.startswith(f"tcp://{host}:")
        finally:
            engine.close()
    with pytest.raises(ValueError, match="--kv-events-insecure"):
        options = {"device": "cpu", "kv_cache_tokens": 256, "kv_events_endpoint": "tcp://192.0.2.1:0"}
        LLMEngine(EngineConfig.from_options(model, use_env=False, **options))
