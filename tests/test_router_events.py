"""Event intake: real ZMQ sockets on loopback, per-pod order, replay, clears, both encodings."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq

from chunkcache.hashing import block_hashes, to_wire
from chunkcache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChunkStored,
    KVEventBatch,
    encode_batch,
)
from chunkcache.kv_publisher import KVEventPublisher
from chunkcache.kv_sockets import END_SEQ, read_replay_reply, replay_request
from chunkcache.router.config import open_index
from chunkcache.router.events import EventIntake, fnv1a_64, pod_from_topic, subscriptions
from chunkcache.router.index import KVIndex, MemoryIndex
from chunkcache.router.scorer import Scorer
from chunkcache.router.tokens import BlockKeyer
from tests.support.redis_server import RedisServer


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def engine_events(seed: str, tokens: list[int], per_event: int = 4) -> list[BlockStored]:
    """BlockStored events as an engine with this hash seed emits them for one prompt."""
    hashes = [to_wire(h) for h in block_hashes(seed, tokens, 16)]
    out = []
    for i in range(0, len(hashes), per_event):
        part = hashes[i : i + per_event]
        out.append(BlockStored(part, hashes[i - 1] if i else None, tokens[16 * i : 16 * (i + len(part))], 16))
    return out


def tokens_for(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


@pytest.fixture
def intake() -> Iterator[EventIntake]:
    it = EventIntake(MemoryIndex(), num_workers=2, replay_timeout_s=1.0)
    it.start()
    yield it
    it.close()


def connect(intake: EventIntake, pub: KVEventPublisher, pod: str) -> None:
    """Subscribe and wait until the subscription carries messages (ZMQ's slow joiner)."""
    intake.add_pod(pod, pub.endpoint, pub.replay_endpoint)
    before = intake.stats().batches
    deadline = time.monotonic() + 5
    while intake.stats().batches == before:
        assert time.monotonic() < deadline, "subscription never delivered"
        pub.publish([BlockRemoved([0])])  # harmless probe: unknown hash
        time.sleep(0.05)
    assert intake.wait_idle()


def prefix_blocks(index: KVIndex, tokens: list[int]) -> dict[str, int]:
    scores = Scorer(index).score(BlockKeyer().request_keys(tokens))
    return {p: s.prefix_blocks for p, s in scores.items() if s.prefix_blocks}


def test_engine_events_drive_the_index_whatever_the_engine_seed(intake: EventIntake) -> None:
    tokens = tokens_for(200, 1000)  # 12 full blocks
    pubs = {pod: KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") for pod in "ab"}
    try:
        for pod, pub in pubs.items():
            connect(intake, pub, pod)
        for ev in engine_events("0", tokens):
            pubs["a"].publish([ev])
        pubs["b"].publish(engine_events("some-other-seed", tokens[:64]))  # one batch, 4 blocks
        pubs["b"].publish([ChunkStored([77], [40])])
        wait_for(lambda: prefix_blocks(intake.index, tokens) == {"a": 12, "b": 4})
        assert intake.index.lookup_chunks([77]) == [{"b": 40}]
        assert intake.stats().failed == 0
        intake.index.check_integrity()
    finally:
        for pub in pubs.values():
            pub.close()


def test_both_vllm_encodings_give_the_same_index_state() -> None:
    tokens = tokens_for(64, 5)
    hashes = [to_wire(h) for h in block_hashes("0", tokens, 16)]
    as_bytes = [b"\x00" * 24 + h.to_bytes(8, "big") for h in hashes]  # newer vLLM: bytes hashes
    arrays = [
        [1.0, [["BlockStored", hashes[:2], None, tokens[:32], 16, None, "GPU"]]],
        [2.0, [["BlockStored", hashes[2:], hashes[1], tokens[32:], 16, None, "CPU", None], ["Mystery", 1]]],
        [3.0, [["BlockRemoved", [hashes[3]], "CPU"]]],
    ]
    maps = [
        [1.0, [{"type": "BlockStored", "block_hashes": as_bytes[:2], "parent_block_hash": None,
                "token_ids": tokens[:32], "block_size": 16, "lora_id": None, "medium": "GPU"}]],
        {"ts": 2.0, "events": [{"type": "BlockStored", "block_hashes": as_bytes[2:], "parent_block_hash": as_bytes[1],
                                "token_ids": tokens[32:], "block_size": 16, "medium": "CPU"}, {"type": "Mystery"}]},
        [3.0, [{"type": "BlockRemoved", "block_hashes": [as_bytes[3]], "medium": "CPU"}]],
    ]  # fmt: skip
    dumps = []
    for encoding in (arrays, maps):
        it = EventIntake(MemoryIndex(), num_workers=1)
        it.start()
        for seq, batch in enumerate(encoding):
            it.submit("pod", seq, msgpack.packb(batch))
        assert it.wait_idle()
        assert it.stats().unknown_types == 1 and it.stats().failed == 0
        dumps.append(it.index.dump())
        it.close()
    assert dumps[0] == dumps[1]
    assert len(dumps[0].blocks) == 3
    assert prefix_blocks(MemoryIndex(), tokens) == {}


def test_per_pod_order_holds_under_concurrent_intake(intake: EventIntake) -> None:
    pods = [f"pod{i}" for i in range(4)]
    assert len({fnv1a_64(p.encode()) % 2 for p in pods}) == 2  # both workers are shared
    pubs = {p: KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") for p in pods}
    n = 60
    try:
        for p, pub in pubs.items():
            connect(intake, pub, p)
        before = intake.stats().batches

        def run(pod: int) -> None:
            pub = pubs[pods[pod]]
            for i in range(n):
                evs = engine_events("0", tokens_for(32, 100_000 * pod + 100 * i))
                pub.publish(evs)
                if i % 2:
                    # A removal overtaking its store would leave the blocks behind.
                    pub.publish([BlockRemoved(evs[0].block_hashes)])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pods))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wait_for(lambda: intake.stats().batches >= before + len(pods) * (n + n // 2), timeout=20)
        assert intake.wait_idle()
        dump = intake.index.dump()
        for k, p in enumerate(pods):
            held = {key for key, owners in dump.blocks.items() if p in owners}
            want = {
                key
                for i in range(0, n, 2)
                for key in BlockKeyer().request_keys(tokens_for(32, 100_000 * k + 100 * i))
            }
            assert held == want, p
        st = intake.stats()
        assert st.failed == 0 and st.clears == 0
    finally:
        for pub in pubs.values():
            pub.close()


def fetch_all(pub: KVEventPublisher, count: int) -> list[bytes]:
    """The payloads of seq 0..count-1, read through the replay socket."""
    wait_for(lambda: pub.published >= count)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    while True:
        assert dealer.poll(3000)
        _, _, seq, payload = dealer.recv_multipart()  # vLLM 0.33's layout: [b"", topic, seq, payload]
        if seq == END_SEQ:
            break
        out.append(payload)
    dealer.close(linger=0)
    return out


class OldVllmReplayServer:
    """A replay endpoint that answers as vLLM 0.10 did: `[identity, b"", seq, payload]` per batch and
    `[identity, b"", -1, b""]` at the end (no topic frame)."""

    def __init__(self, batches: dict[int, bytes]) -> None:
        self.batches = batches
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests: list[list[bytes]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            if not self.sock.poll(20):
                continue
            frames = self.sock.recv_multipart()
            self.requests.append(frames[1:])
            client, _, start = frames[:3]
            for seq in sorted(self.batches):
                if seq >= int.from_bytes(start, "big"):
                    self.sock.send_multipart([client, b"", seq.to_bytes(8, "big"), self.batches[seq]])
            self.sock.send_multipart([client, b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close(linger=0)


def test_a_gap_is_filled_from_a_vllm_0_10_replay_endpoint(intake: EventIntake) -> None:
    prompts = [tokens_for(32, 1000 * i) for i in range(3)]
    payloads = [
        encode_batch(KVEventBatch(float(i), list(engine_events("0", t)), 0)) for i, t in enumerate(prompts)
    ]
    server = OldVllmReplayServer({1: payloads[1]})
    try:
        intake.add_pod("old", None, server.endpoint)
        intake.submit("old", 0, payloads[0])
        intake.submit("old", 2, payloads[2])
        assert intake.wait_idle()
        assert all(prefix_blocks(intake.index, t) == {"old": 2} for t in prompts)
        st = intake.stats()
        assert (st.replays, st.replay_failures, st.clears, st.batches) == (1, 0, 0, 3)
        assert server.requests == [[b"", (1).to_bytes(8, "big")]]  # vLLM's request, no topic frame
    finally:
        server.close()


def test_a_lost_chunk_batch_is_replayed_from_the_chunk_stream(intake: EventIntake) -> None:
    pub = KVEventPublisher("tcp://127.0.0.1:0", topic="kv@p@m", replay_endpoint="tcp://127.0.0.1:0")
    try:
        t = tokens_for(32, 5)
        pub.publish([*engine_events("0", t), ChunkStored([1], [10])])
        pub.publish([ChunkStored([2], [20])])
        pub.publish([ChunkStored([3], [30])])
        wait_for(lambda: pub.published_on("chunk@p@m") == 3 and pub.published == 1)
        intake.add_pod("p", None, pub.replay_endpoint)
        block_batch = fetch_all(pub, 1)[0]
        chunk_batches = dict(_replay_stream(pub.replay_endpoint, "chunk@p@m"))
        intake.submit("p", 0, block_batch)
        intake.submit("p", 0, chunk_batches[0], "chunk@p@m")  # the chunk stream's own seq 0
        intake.submit("p", 2, chunk_batches[2], "chunk@p@m")  # chunk seq 1 was lost
        assert intake.wait_idle()
        assert intake.index.lookup_chunks([1, 2, 3]) == [{"p": 10}, {"p": 20}, {"p": 30}]
        assert prefix_blocks(intake.index, t) == {"p": 2}
        st = intake.stats()
        assert (st.replays, st.replay_failures, st.clears, st.batches) == (1, 0, 0, 4)
    finally:
        pub.close()


def _replay_stream(endpoint: str, topic: str) -> list[tuple[int, bytes]]:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart(replay_request(0, topic))
    out = []
    try:
        while True:
            assert dealer.poll(3000)
            reply = read_replay_reply(dealer.recv_multipart())
            assert reply is not None
            if reply.end:
                return out
            assert reply.topic == topic.encode()
            out.append((reply.seq, reply.payload))
    finally:
        dealer.close(linger=0)


def test_scores_follow_the_full_attention_group(intake: EventIntake) -> None:
    """vLLM's hybrid allocator: group 0 full attention, group 1 sliding window, same block hashes.
    The sliding-window group dropping its blocks must not take the prefix away."""
    t = tokens_for(64, 40)
    stored = list(engine_events("0", t))
    hashes = [h for ev in stored for h in ev.block_hashes]

    def in_group(group: int, kind: str | None) -> list[BlockStored]:
        return [BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, 16, None, None, None,
                            group_idx=group, kv_cache_spec_kind=kind) for ev in stored]  # fmt: skip

    batches = [
        [*in_group(1, "sliding_window"), *in_group(0, "full_attention")],
        [BlockRemoved(hashes[:2], None, group_idx=1)],  # the window slid past blocks 0 and 1
    ]
    for seq, evs in enumerate(batches):
        intake.submit("hybrid", seq, encode_batch(KVEventBatch(0.0, evs, 0)))
    assert intake.wait_idle()
    assert prefix_blocks(intake.index, t) == {"hybrid": 4}
    assert intake.stats().other_group_blocks == 6
    intake.submit(
        "hybrid", 2, encode_batch(KVEventBatch(0.0, [BlockRemoved(hashes[3:], None, group_idx=0)], 0))
    )
    assert intake.wait_idle()
    assert prefix_blocks(intake.index, t) == {"hybrid": 3}
    # No kinds named (an engine that only numbers its groups): group 0 is the one scored.
    for seq, evs in enumerate(
        [in_group(0, None) + in_group(1, None), [BlockRemoved(hashes, None, group_idx=1)]]
    ):
        intake.submit("numbered", seq, encode_batch(KVEventBatch(0.0, evs, 0)))
    assert intake.wait_idle()
    assert prefix_blocks(intake.index, t) == {"hybrid": 3, "numbered": 4}


def test_a_dropped_batch_is_replayed(intake: EventIntake) -> None:
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    try:
        prompts = [tokens_for(32, 1000 * i) for i in range(3)]
        for t in prompts:
            pub.publish(engine_events("0", t))
        payloads = fetch_all(pub, 3)
        intake.add_pod("p", None, pub.replay_endpoint)
        intake.submit("p", 0, payloads[0])
        intake.submit("p", 2, payloads[2])  # seq 1 was lost on the way
        assert intake.wait_idle()
        assert all(prefix_blocks(intake.index, t) == {"p": 2} for t in prompts)
        st = intake.stats()
        assert (st.replays, st.replay_failures, st.clears, st.batches) == (1, 0, 0, 3)
    finally:
        pub.close()


def test_an_unfillable_gap_clears_the_pod(intake: EventIntake) -> None:
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=1)
    try:
        prompts = [tokens_for(32, 1000 * i) for i in range(3)]
        pub.publish(engine_events("0", prompts[0]))
        first = fetch_all(pub, 1)[0]
        pub.publish(engine_events("0", prompts[1]))
        pub.publish([BlockRemoved([to_wire(h) for h in block_hashes("0", prompts[0], 16)])])
        last = fetch_all(pub, 3)[-1]  # the buffer keeps only seq 2: seq 1 is gone for good
        pub.publish(engine_events("0", prompts[2]))
        intake.add_pod("p", None, pub.replay_endpoint)
        intake.submit("p", 0, first)
        intake.submit("p", 2, last)
        assert intake.wait_idle()
        st = intake.stats()
        assert (st.replays, st.replay_failures, st.clears) == (1, 1, 1)
        # Cleared, not trusted: batch 0's blocks are gone although their removal was applied anyway.
        assert intake.index.size() == 0
    finally:
        pub.close()


def test_all_blocks_cleared_and_restarts_empty_only_that_pod(intake: EventIntake) -> None:
    t = tokens_for(48, 7)
    batch = encode_batch(KVEventBatch(0.0, list(engine_events("0", t))))
    for pod in ("a", "b"):
        intake.submit(pod, 0, batch)
    intake.submit("a", 1, encode_batch(KVEventBatch(0.0, [AllBlocksCleared()])))
    assert intake.wait_idle()
    assert prefix_blocks(intake.index, t) == {"b": 3}
    intake.submit("b", 0, encode_batch(KVEventBatch(0.0, [ChunkStored([5], [9])])))  # seq went back
    assert intake.wait_idle()
    assert prefix_blocks(intake.index, t) == {} and intake.index.lookup_chunks([5]) == [{"b": 9}]
    assert intake.stats().clears == 2


def test_bad_payloads_count_as_failed_and_untrust_the_pod(intake: EventIntake) -> None:
    t = tokens_for(32, 3)
    intake.submit("p", 0, encode_batch(KVEventBatch(0.0, list(engine_events("0", t)))))
    intake.submit("p", 1, b"\xc1garbage")
    intake.submit("p", 2, msgpack.packb([0.0, [["Unknown"], ["ChunkStored", [8], [4], "GPU"]]]))
    assert intake.wait_idle()
    st = intake.stats()
    assert (st.failed, st.unknown_types, st.clears) == (1, 1, 1)
    assert prefix_blocks(intake.index, t) == {} and intake.index.lookup_chunks([8]) == [{"p": 4}]


def test_bound_subscriber_takes_the_pod_from_the_topic() -> None:
    assert pod_from_topic("kv@pod-7@Qwen/Qwen3") == "pod-7" and pod_from_topic("plain") == "plain"
    assert pod_from_topic("chunk@pod-7@Qwen/Qwen3") == "pod-7"
    assert subscriptions("kv@") == ["kv@", "chunk@"] and subscriptions("") == [""]
    it = EventIntake(MemoryIndex(), num_workers=1, topic_filter="kv@", bind_endpoint="tcp://127.0.0.1:0")
    it.start()
    pub = KVEventPublisher(it.bound_endpoint, topic="kv@pod-7@tiny")
    other = KVEventPublisher(it.bound_endpoint, topic="metrics")  # filtered out by the prefix
    try:
        t = tokens_for(32, 11)
        deadline = time.monotonic() + 5
        while not prefix_blocks(it.index, t):
            assert time.monotonic() < deadline
            pub.publish(engine_events("0", t))
            other.publish(engine_events("0", t))
            time.sleep(0.05)
        assert prefix_blocks(it.index, t) == {"pod-7": 2}
        # The chunk stream of the same pod passes the kv@ filter's companion subscription.
        deadline = time.monotonic() + 5
        while it.index.lookup_chunks([42]) != [{"pod-7": 9}]:
            assert time.monotonic() < deadline
            pub.publish([ChunkStored([42], [9])])
            time.sleep(0.05)
    finally:
        pub.close()
        other.close()
        it.close()


def random_stream(seed: int) -> list[tuple[str, int, bytes]]:
    """A plausible mixed event stream for 3 pods: (pod, payload) in publish order."""
    rng = random.Random(seed)
    shared = tokens_for(64, 50_000)  # a system prompt every pod has seen
    out: list[tuple[str, list]] = []
    for step in range(60):
        pod = rng.choice("xyz")
        tokens = shared[: 16 * rng.randint(1, 4)] + tokens_for(16 * rng.randint(0, 3), 1000 * step)
        evs: list = list(engine_events("0", tokens, per_event=2))
        for ev in evs:
            ev.medium = rng.choice(["GPU", "GPU", "CPU"])
        if rng.random() < 0.3:
            evs.append(BlockRemoved(evs[-1].block_hashes, evs[-1].medium))
        if rng.random() < 0.3:
            evs.append(ChunkStored([step % 7], [rng.randint(10, 90)]))
        out.append((pod, evs))
    out.insert(40, ("y", [AllBlocksCleared()]))
    seqs = dict.fromkeys("xyz", 0)
    encoded = []
    for pod, evs in out:
        encoded.append((pod, seqs[pod], encode_batch(KVEventBatch(0.0, evs))))
        seqs[pod] += 1
    return encoded


def test_memory_and_redis_indexes_score_identically(redis_server: RedisServer) -> None:
    stream = random_stream(7)
    scorers = []
    intakes = []
    for index in (MemoryIndex(), open_index(redis_server.url)):
        it = EventIntake(index, num_workers=2)
        it.start()
        for pod, seq, payload in stream:
            it.submit(pod, seq, payload)
        assert it.wait_idle(10)
        assert it.stats().failed == 0
        index.check_integrity()
        intakes.append(it)
        scorers.append(Scorer(index))
    shared = tokens_for(64, 50_000)
    queries = [shared[: 16 * k] + tokens_for(48, 1000 * s) for k in range(1, 5) for s in range(0, 60, 3)]
    for q in queries:
        keys = BlockKeyer().request_keys(q)
        results = [sc.score(keys, list(range(7)), pods=["x", "y", "z"]) for sc in scorers]
        assert results[0] == results[1]
    assert any(s.prefix_blocks for s in scorers[0].score(BlockKeyer().request_keys(shared)).values())
    assert intakes[0].index.dump() == intakes[1].index.dump()
    for it in intakes:
        it.close()
        it.index.close()
