"""The KV event schema and publisher: vLLM's wire format over real ZMQ sockets on loopback."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from chunkcache.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChunkRemoved,
    ChunkStored,
    KVEventBatch,
    KVEventDecodeError,
    KVEventPublisher,
    decode_batch,
    encode_batch,
    hash_to_int,
)

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


def test_wire_layout_is_vllm_current() -> None:
    raw = msgpack.unpackb(encode_batch(KVEventBatch(1.0, sample_events()[:1], None)), raw=False)
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] is None
    ev = raw[1][0]
    assert ev["type"] == "BlockStored"
    assert list(ev) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]


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


def test_newer_vllm_trailing_fields_are_ignored() -> None:
    # vLLM appends extra_keys, group_idx, kv_cache_spec_* after lora_name.
    payload = msgpack.packb(
        [1.0, [["BlockStored", [5], None, list(range(16)), 16, None, "GPU", None, None, 0, "full"]]]
    )
    assert decode_batch(payload).batch.events == [
        BlockStored([5], None, list(range(16)), 16, None, "GPU", None)
    ]


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
        pub.publish([ChunkRemoved([0])])  # a probe
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


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            empty, seq, payload = _recv(dealer)
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
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
