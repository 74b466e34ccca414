"""Router index backends (memory, Redis), the scorer and the token processor."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chunkcache.hashing import chunk_hash, system_hash, to_wire
from chunkcache.kv_events import BlockStored
from chunkcache.router.config import open_index
from chunkcache.router.index import IndexIntegrityError, KVIndex, MemoryIndex
from chunkcache.router.scorer import Scorer, ScorerConfig, parse_tier_weights
from chunkcache.router.tokens import BlockKeyer, EngineKeyMap, PromptProcessor
from tests.support.redis_server import RedisServer


@pytest.fixture(params=["memory", pytest.param("redis", marks=[pytest.mark.redis, pytest.mark.slow])])
def index(request: pytest.FixtureRequest) -> Iterator[KVIndex]:
    if request.param == "memory":
        yield MemoryIndex(pods_per_key=3)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    idx = open_index(server.url, pods_per_key=3)
    yield idx
    idx.close()


def test_add_lookup_remove(index: KVIndex) -> None:
    index.add("a", [1, 2, 3], "GPU")
    index.add("b", [1, 2], "GPU")
    index.add("b", [2], "CPU")
    rows = index.lookup([1, 2, 3, 4, 5])
    assert rows == [
        {"a": "GPU", "b": "GPU"},
        {"a": "GPU", "b": "CPU+GPU"},
        {"a": "GPU"},
    ]  # stops at key 4: nobody holds it
    index.remove("b", [2], "GPU")
    assert index.lookup([2]) == [{"a": "GPU", "b": "CPU"}]
    index.remove("a", [3], "CPU")  # a tier the pod does not hold: no-op
    index.remove("a", [3], "GPU")
    index.remove("a", [3], "GPU")  # idempotent
    assert index.lookup([3]) == []
    assert index.lookup([]) == []
    index.check_integrity()
    st = index.stats()
    assert st.admissions == 6 and st.removals == 2


def test_pods_per_key_keeps_the_most_recent(index: KVIndex) -> None:
    for pod in ("p1", "p2", "p3"):
        index.add(pod, [10], "GPU")
    index.add("p1", [10], "GPU")  # p1 stores again: now p2 is the oldest
    index.add("p4", [10], "GPU")
    assert set(index.lookup([10])[0]) == {"p1", "p3", "p4"}
    assert index.stats().evictions == 1
    index.check_integrity()


def test_chunks_any_order(index: KVIndex) -> None:
    index.add_chunks("a", [(100, 40), (101, 25)])
    index.add_chunks("b", [(101, 25)])
    assert index.lookup_chunks([101, 999, 100]) == [{"a": 25, "b": 25}, {}, {"a": 40}]
    index.remove_chunks("a", [101])
    assert index.lookup_chunks([101]) == [{"b": 25}]
    index.check_integrity()


def test_clear_pod_keeps_other_pods(index: KVIndex) -> None:
    index.add("a", list(range(50)), "GPU")
    index.add("a", [7], "CPU")
    index.add("b", [0, 1], "GPU")
    index.add_chunks("a", [(5, 9)])
    index.add_chunks("b", [(5, 9)])
    index.clear_pod("a")
    assert index.lookup(list(range(3))) == [{"b": "GPU"}, {"b": "GPU"}]
    assert index.lookup([7]) == []
    assert index.lookup_chunks([5]) == [{"b": 9}]
    dump = index.dump()
    assert set(dump.blocks) == {0, 1} and dump.chunks == {5: {"b": 9}}
    index.check_integrity()


def test_memory_key_capacity_is_lru() -> None:
    idx = MemoryIndex(capacity=3)
    idx.add("a", [1, 2, 3], "GPU")
    idx.lookup([1])  # key 1 is used: key 2 is now the least recently used
    idx.add("a", [4], "GPU")
    assert set(idx.dump().blocks) == {1, 3, 4}
    assert idx.stats().evictions == 1 and idx.size() == 3
    idx.check_integrity()


def test_memory_index_entries_are_invisible_to_the_gc() -> None:
    import gc

    idx = MemoryIndex()
    idx.add("a", [1, 2], "GPU")
    idx.add("b", [2], "CPU")
    idx.add_chunks("a", [(9, 10)])
    # Untracked inner dicts: millions of entries add nothing to a full collection's work.
    assert not any(gc.is_tracked(inner) for inner in (*idx._blocks.values(), *idx._chunks.values()))


def test_memory_integrity_check_catches_corruption() -> None:
    idx = MemoryIndex()
    idx.add("a", [1], "GPU")
    idx._blocks[1]["a"] = "GPU+CPU"  # not canonical: tiers are sorted
    with pytest.raises(IndexIntegrityError):
        idx.check_integrity()


def test_open_index_rejects_unknown_backends() -> None:
    with pytest.raises(ValueError):
        open_index("postgres://x")


def test_scorer_longest_consecutive_prefix_with_tiers() -> None:
    idx = MemoryIndex()
    idx.add("a", [1, 2], "GPU")
    idx.add("b", [1, 2, 3, 4], "CPU")
    idx.add("c", [2, 3, 4], "GPU")  # lacks the first block: no prefix at all
    idx.add("a", [4], "GPU")  # after a's gap at 3: does not count
    s = Scorer(idx, ScorerConfig(block_size=16)).score([1, 2, 3, 4], pods=["a", "b", "c", "d"])
    assert (s["a"].prefix_blocks, s["a"].prefix_tokens) == (2, 32.0)
    assert (s["b"].prefix_blocks, s["b"].prefix_tokens) == (4, pytest.approx(4 * 16 * 0.8))
    assert s["c"].prefix_blocks == 0 and s["d"].total() == 0
    custom = Scorer(idx, ScorerConfig(tier_weights=parse_tier_weights("gpu=1,cpu=0.5"), block_size=16))
    assert custom.score([1, 2, 3, 4])["b"].prefix_tokens == 32.0


def test_scorer_chunks_count_in_any_order() -> None:
    idx = MemoryIndex()
    idx.add("a", [1], "GPU")
    idx.add_chunks("a", [(50, 100), (51, 30)])
    idx.add_chunks("b", [(52, 70)])
    s = Scorer(idx).score([1], [52, 51, 50])
    # A chunked prompt is served from the chunk pool alone: its prefix blocks count only for a
    # prefix router (use_chunks=False).
    assert s["a"].chunk_tokens == 130 and s["a"].total() == 130
    assert s["a"].total(use_chunks=False) == 16
    assert s["b"].chunk_tokens == 70 and s["b"].prefix_blocks == 0 and s["b"].total() == 70
    plain = Scorer(idx).score([1])
    assert plain["a"].total() == plain["a"].total(use_chunks=False) == 16
    assert set(Scorer(idx).score([1], [52], pods=["a"])) == {"a"}


def test_keyer_chains_and_is_seed_independent() -> None:
    keyer = BlockKeyer()
    tokens = list(range(1000, 1040))  # 2 full blocks + 8 tokens
    keys = keyer.request_keys(tokens)
    assert len(keys) == 2 and keys == BlockKeyer().request_keys(tokens)
    assert keyer.chain(keys[0], tokens[16:32]) == keys[1:]
    assert keyer.request_keys(tokens, lora="ad") != keys
    assert keyer.request_keys([5, *tokens[1:]])[1] != keys[1]  # a different first block changes the chain


def test_engine_key_map_resolves_parents_and_bigger_blocks() -> None:
    keyer = BlockKeyer(16)
    want = keyer.request_keys(list(range(96)))
    m = EngineKeyMap(keyer)
    assert m.stored(BlockStored([0xA], None, list(range(32)), 32)) == want[:2]
    assert m.stored(BlockStored([0xB, 0xC], 0xA, list(range(32, 96)), 32)) == want[2:]
    assert m.stored(BlockStored([0xD], 0x99, list(range(32)), 32)) == []  # unknown parent
    assert m.unresolved_blocks == 1
    with pytest.raises(ValueError):
        m.stored(BlockStored([0xE], None, list(range(24)), 24))  # not a multiple of 16
    with pytest.raises(ValueError):
        m.stored(BlockStored([0xE], None, list(range(16)), 32))  # token count mismatch
    assert m.removed([0xB, 0x77]) == want[2:4]


def test_engine_key_map_refcounts_blocks_stored_twice() -> None:
    m = EngineKeyMap(BlockKeyer())
    ev = BlockStored([1], None, list(range(16)), 16, medium="GPU")
    key = m.stored(ev)
    m.stored(BlockStored([1], None, list(range(16)), 16, medium="CPU"))
    assert m.removed([1]) == key  # GPU copy gone; the CPU copy still maps
    assert m.removed([1]) == key
    assert m.removed([1]) == [] and len(m) == 0


class WordTokenizer:
    """Whitespace tokenizer with a BOS id, enough for prompt parsing."""

    bos_token = "<s>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [sum(map(ord, w)) for w in text.split()]
        return [1, *ids] if add_special_tokens else ids


def test_prompt_processor_chunk_keys_match_the_engines() -> None:
    p = PromptProcessor(WordTokenizer(), "tiny-model")
    prompt = "sys a b # # c1 c2 c3 # # d1 d2 # # question?"
    t = p.tokenize(prompt)
    assert t.prefix_token_ids == (1, *WordTokenizer().encode("sys a b", False))
    assert len(t.chunks) == 2
    keys = p.keys(t)
    tok = WordTokenizer()
    # The system part is an entry of the engine's chunk pool too: first key, S's length.
    expected = [
        to_wire(system_hash("tiny-model", t.prefix_token_ids)),
        to_wire(chunk_hash("tiny-model", t.prefix_token_ids, tuple(tok.encode("c1 c2 c3", False)))),
    ]
    assert keys.chunk_keys[:2] == expected and keys.chunk_tokens == [4, 3, 2]
    assert keys.block_keys == []  # fewer than 16 tokens: no full block
    # A chunked prompt's block keys run over its whole token list, as a prefix router sees it (an
    # engine registers S and the first chunk of an "offset" request): the same keys as for the
    # plain token list, whose first 16 tokens here are S and the first chunk.
    long_sys = " ".join(f"s{i}" for i in range(12))
    long = p.tokenize(f"{long_sys} # # c1 c2 c3 c4 c5 # # d1 d2 # # question?")
    assert len(long.token_ids) == 13 + 5 + 2 + 1
    assert (
        p.keys(long).block_keys
        == p.keyer.request_keys(long.token_ids)
        == p.keys(p.tokenize(list(long.token_ids))).block_keys
    )
    assert len(p.keys(long).block_keys) == 1
    plain = p.tokenize("just a prompt")
    assert plain.chunks == () and plain.prefix_token_ids[0] == 1
    assert p.tokenize("<s> rendered chat", rendered_chat=True).prefix_token_ids[0] != 1
    # A rendered chat's system part carries no added BOS, exactly as the engine tokenizes it.
    chat = p.tokenize(prompt, rendered_chat=True)
    assert chat.prefix_token_ids == tuple(WordTokenizer().encode("sys a b", False))
    assert p.tokenize([5, 6, 7]).prefix_token_ids == (5, 6, 7)
    assert PromptProcessor(WordTokenizer(), "m", enable_chunks=False).tokenize(prompt).chunks == ()


def test_cached_encoder_remembers_long_parts_within_its_capacity() -> None:
    from chunkcache.router.tokens import CachedEncoder

    calls: list[str] = []

    class Counting(WordTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            calls.append(text)
            return super().encode(text, add_special_tokens)

    tok = Counting()
    enc = CachedEncoder(tok, capacity_tokens=250, min_chars=20)
    docs = [" ".join(f"w{d}x{i}" for i in range(100)) for d in range(3)]  # 100 tokens each
    for doc in docs[:2]:
        assert list(enc.encode(doc, add_special_tokens=False)) == WordTokenizer().encode(doc, False)
    assert list(enc.encode(docs[0], add_special_tokens=True)) == WordTokenizer().encode(docs[0])  # own entry
    assert len(calls) == 3 and enc.num_tokens == 100 + 100 + 101 - 100  # the first entry went out
    enc.encode(docs[1], add_special_tokens=False)
    assert len(calls) == 3 and enc.hits == 1
    enc.encode(docs[2], add_special_tokens=False)  # evicts the least recently used: docs[0] special
    assert len(calls) == 4 and enc.num_tokens <= 250
    enc.encode("short", add_special_tokens=False)
    enc.encode("short", add_special_tokens=False)
    assert len(calls) == 6  # short texts are not remembered
    # The processor's chunked prompts go through it: a recurring document is tokenized once.
    p = PromptProcessor(tok, "m")
    p.parts.min_chars = 20
    calls.clear()
    first = p.tokenize(f"sys # # {docs[0]} # # {docs[1]} # # q?")
    again = p.tokenize(f"sys # # {docs[1]} # # {docs[0]} # # other q?")
    assert first.chunks == tuple(reversed(again.chunks))
    assert calls.count(docs[0]) == 1 and calls.count(docs[1]) == 1
