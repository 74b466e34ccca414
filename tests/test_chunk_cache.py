"""Chunk cache, layout "isolated" (docs/design.md §2), against transformers with the 4D chunk mask."""

from __future__ import annotations

import random
from functools import partial

import pytest

from chunkcache import LLM, SamplingParams
from chunkcache.config import EngineConfig
from chunkcache.errors import InvalidRequestError, PromptTooLongError
from tests.support.engines import tiny_llm
from tests.support.oracle import chunk_isolated_mask, hf_greedy_with_mask, hf_logprobs_with_mask
from tests.support.prompts import ALICE, BOB, CAROL, COINS, QUESTION, RIVER, SEP, SYSTEM, ZORVAK, chunked

# "x": a document of one token.
DOCS = [ALICE, COINS, BOB, "x", CAROL, ZORVAK, RIVER]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
# One pool page of the tiny checkpoints = 16 tokens * 2 layers * 2 (K, V) * 2 heads * 16 dims * 4 B.
PAGE_BYTES = 16 * 2 * 2 * 2 * 16 * 4


# These tests check the exact layout "isolated" (the engine's default is "offset" + blend).
_llm = partial(tiny_llm, chunk_layout="isolated")


def _prompt(doc_ids: list[int], question: str = QUESTION) -> str:
    return chunked(SYSTEM, [DOCS[i] for i in doc_ids], question)


def _oracle(path, llm: LLM, doc_ids: list[int], question: str = QUESTION):
    tok = llm.tokenizer
    sys_ids = tok.encode(SYSTEM, add_special_tokens=True)
    chunks = [tok.encode(DOCS[i], add_special_tokens=False) for i in doc_ids]
    q_ids = tok.encode(question, add_special_tokens=False)
    mask, positions = chunk_isolated_mask(len(sys_ids), [len(c) for c in chunks], len(q_ids))
    ids = sys_ids + [t for c in chunks for t in c] + q_ids
    return ids, mask, positions


def _assert_matches_oracle(path, llm: LLM, doc_ids: list[int], out) -> None:
    ids, mask, positions = _oracle(path, llm, doc_ids)
    assert out.prompt_token_ids == ids
    ref = hf_logprobs_with_mask(path, ids, mask, positions)
    for token, lp in out.outputs[0].logprobs[0].items():
        assert abs(ref[token].item() - lp) < 1e-4, (token, ref[token].item(), lp)
    assert out.outputs[0].token_ids == hf_greedy_with_mask(path, ids, mask, positions, GREEDY.max_tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_matches_transformers_with_chunk_isolated_mask(checkpoint, arch: str) -> None:
    path = checkpoint(arch=arch)
    llm = _llm(path)
    rng = random.Random(7)
    for n in range(1, 7):
        doc_ids = rng.sample(range(len(DOCS)), n)
        out = llm.generate(_prompt(doc_ids), GREEDY)[0]
        _assert_matches_oracle(path, llm, doc_ids, out)
    llm.check_integrity()


def test_cold_warm_partial_and_reordered_agree(checkpoint) -> None:
    path = checkpoint(arch="qwen3")
    llm = _llm(path)
    tok = llm.tokenizer
    lens = [len(tok.encode(d, add_special_tokens=False)) for d in DOCS]
    cold = llm.generate(_prompt([0, 1, 2]), GREEDY)[0]
    assert cold.num_chunk_cached_tokens == 0 and cold.num_prefix_cached_tokens == 0
    s = llm.chunk_cache_stats()
    assert (s["hits"], s["misses"], s["entries"]) == (0, 3, 4)  # 3 chunks + the system part
    assert s["pinned_entries"] == 0  # the request gave its pins back

    warm = llm.generate(_prompt([2, 0, 1]), GREEDY)[0]
    assert warm.num_chunk_cached_tokens == lens[0] + lens[1] + lens[2]
    assert warm.num_prefix_cached_tokens == len(tok.encode(SYSTEM))
    assert warm.num_computed_tokens == len(tok.encode(QUESTION, add_special_tokens=False))
    partial = llm.generate(_prompt([1, 4, 0]), GREEDY)[0]
    assert partial.num_chunk_cached_tokens == lens[1] + lens[0]
    s = llm.chunk_cache_stats()
    assert (s["hits"], s["misses"]) == (5, 4)
    assert s["hit_tokens"] == 2 * (lens[0] + lens[1]) + lens[2]
    # Chunks share one position range and attention is a sum over keys: order does not matter.
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    for token, lp in cold.outputs[0].logprobs[0].items():
        assert abs(warm.outputs[0].logprobs[0][token] - lp) < 1e-5
    _assert_matches_oracle(path, llm, [1, 4, 0], partial)
    llm.check_integrity()


def test_same_chunk_in_two_concurrent_requests_is_computed_once(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path, max_num_batched_tokens=16)
    prompts = [_prompt([0, 2]), _prompt([2, 0, 5]), _prompt([5, 5])]
    outs = llm.generate(prompts, GREEDY)
    s = llm.chunk_cache_stats()
    assert s["entries"] == 4  # S, doc 0, doc 2, doc 5: each computed once
    for doc_ids, out in zip([[0, 2], [2, 0, 5], [5, 5]], outs, strict=True):
        _assert_matches_oracle(path, llm, doc_ids, out)
    llm.check_integrity()


def test_plain_and_chunked_requests_in_one_batch(checkpoint) -> None:
    path = checkpoint(arch="qwen2")
    llm = _llm(path, max_num_batched_tokens=24)
    plain = "A plain prompt without any separator at all"
    outs = llm.generate([_prompt([3, 6]), plain, _prompt([6, 3])], GREEDY)
    _assert_matches_oracle(path, llm, [3, 6], outs[0])
    reference = LLM(str(path), dtype="float32", enable_chunk_cache=False, kv_cache_tokens=1024).generate(
        [plain], GREEDY
    )[0]
    assert outs[1].outputs[0].token_ids == reference.outputs[0].token_ids
    assert outs[1].num_chunk_cached_tokens == 0
    llm.check_integrity()


def test_tiny_budget_evicts_lru_and_keeps_pinned_entries(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path, chunk_cache_size_gb=8 * PAGE_BYTES / 2**30, chunk_cache_lru_threshold=1.0)
    engine = llm.engine
    pool = engine.chunks.pool
    assert pool.num_pages == 8
    for doc_ids in ([0, 1], [4, 5], [2, 6], [0, 3]):
        out = llm.generate(_prompt(doc_ids), GREEDY)[0]
        _assert_matches_oracle(path, llm, doc_ids, out)
        assert pool.used_bytes <= pool.budget_bytes
        llm.check_integrity()
    assert llm.chunk_cache_stats()["evictions"] > 0

    # A running request pins its entries: a later request cannot evict them while it runs.
    engine.add_request("long", _prompt([6]), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    state = engine._requests["long"].chunks
    assert state is not None
    pinned = [e.key for e in state.entries]
    assert all(e.ready and e.pins > 0 for e in state.entries)
    engine.add_request("other", _prompt([2, 4, 0]), GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
        if "long" not in finished:
            assert all(pool.has_key(k) for k in pinned)
        assert pool.used_bytes <= pool.budget_bytes
    _assert_matches_oracle(path, llm, [2, 4, 0], finished["other"])
    llm.check_integrity()


def test_chunk_larger_than_budget_is_computed_not_cached(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path, chunk_cache_size_gb=2 * PAGE_BYTES / 2**30)
    out = llm.generate(_prompt([6, 1]), GREEDY)[0]  # doc 6 needs more than 2 pages
    _assert_matches_oracle(path, llm, [6, 1], out)
    s = llm.chunk_cache_stats()
    assert s["uncacheable"] >= 1 and s["bytes"] <= s["budget_bytes"]
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.check_integrity()


def test_abort_during_fill_and_preemption_leave_everything_consistent(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path, max_num_batched_tokens=8, kv_cache_tokens=96)
    engine = llm.engine
    engine.add_request("a", _prompt([2, 6]), GREEDY)
    engine.step()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    s = llm.chunk_cache_stats()
    assert s["jobs_running"] == 0
    llm.check_integrity()
    # Five chunked requests whose questions and outputs do not fit in 6 blocks together.
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    outs = llm.generate([_prompt([i, (i + 1) % 7]) for i in range(5)], params)
    assert engine.scheduler.num_preemptions > 0
    for i, out in enumerate(outs):
        ids, mask, positions = _oracle(path, llm, [i, (i + 1) % 7])
        assert out.outputs[0].token_ids == hf_greedy_with_mask(path, ids, mask, positions, 30)
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert all(e.pins == 0 for e in engine.chunks.pool._entries.values())
    llm.check_integrity()


def test_bad_chunked_input_is_rejected_and_pool_unchanged(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path, max_model_len=128)
    llm.generate(_prompt([0, 1]), GREEDY)
    before = llm.chunk_cache_stats()
    engine = llm.engine
    long_chunk = " ".join(["word"] * 200)
    with pytest.raises(PromptTooLongError, match="chunk 1 is"):
        engine.add_request("x", SYSTEM + SEP + "short" + SEP + long_chunk + SEP + "q", GREEDY)
    with pytest.raises(InvalidRequestError, match="more than max_chunks 256"):
        engine.add_request("y", SYSTEM + SEP + SEP.join(["a"] * 3000) + SEP + "q", GREEDY)
    with pytest.raises(InvalidRequestError, match="no non-empty chunk"):
        engine.add_request("z", SEP + SEP + SEP, GREEDY)
    with pytest.raises(InvalidRequestError, match="empty question"):
        engine.add_request("w", SYSTEM + SEP + "doc" + SEP, GREEDY)
    assert llm.chunk_cache_stats() == before
    out = llm.generate(_prompt([1, 0]), GREEDY)[0]
    _assert_matches_oracle(path, llm, [1, 0], out)
    llm.check_integrity()


def test_fewer_than_two_separators_takes_the_plain_path(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path)
    out = llm.generate(SYSTEM + SEP + DOCS[0], GREEDY)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode(SYSTEM + SEP + DOCS[0])
    assert llm.chunk_cache_stats()["misses"] == 0


def test_config_env_vars_and_vllm_aliases(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_CHUNK_CACHE_SIZE_GB", "0.5")
    monkeypatch.setenv("CHUNKCACHE_CHUNK_CACHE_LRU_THRESHOLD", "0.75")
    monkeypatch.setenv("VLLM_CHUNK_CACHE_HASH_ALGORITHM", "blake2b")
    monkeypatch.setenv("CHUNKCACHE_ENABLE_CHUNK_CACHE", "false")
    config = EngineConfig.from_options("m")
    assert config.chunk.cache_size_gb == 0.5
    assert config.chunk.lru_threshold == 0.75
    assert config.chunk.hash_algorithm == "blake2b"
    assert config.chunk.enable is False
    assert EngineConfig.from_options("m", enable_chunk_cache=True).chunk.enable is True
    monkeypatch.setenv("CHUNKCACHE_CHUNK_CACHE_LRU_THRESHOLD", "1.5")
    with pytest.raises(ValueError, match="lru_threshold"):
        EngineConfig.from_options("m")
    monkeypatch.setenv("CHUNKCACHE_ENABLE_CHUNK_CACHE", "maybe")
    with pytest.raises(ValueError, match="CHUNKCACHE_ENABLE_CHUNK_CACHE"):
        EngineConfig.from_options("m")


def test_hash_algorithm_changes_keys_not_outputs(checkpoint) -> None:
    path = checkpoint(arch="llama")
    a = _llm(path).generate(_prompt([0, 1]), GREEDY)[0]
    b = _llm(path, chunk_cache_hash_algorithm="sha3_256").generate(_prompt([0, 1]), GREEDY)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a_chunk_that_tokenizes_to_nothing_is_skipped_and_logged(checkpoint, caplog) -> None:
    """An empty document between two others is skipped with a log line naming it; the request is
    served as the prompt without it is."""
    path = checkpoint(arch="llama")
    llm = _llm(path)
    with caplog.at_level("INFO", logger="chunkcache.chunk.parse"):
        out = llm.generate(chunked(SYSTEM, [ALICE, "", BOB], QUESTION), GREEDY)[0]
    assert "skipped 1 of 3 chunks that tokenize to nothing (chunks [1]" in caplog.text
    assert (
        out.outputs[0].token_ids
        == llm.generate(chunked(SYSTEM, [ALICE, BOB], QUESTION), GREEDY)[0].outputs[0].token_ids
    )
    llm.check_integrity()
