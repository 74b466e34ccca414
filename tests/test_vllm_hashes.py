"""Prefix-cache block hashes against vLLM's definitions (vllm/v1/core/kv_cache_utils.py and
vllm/utils/hashing.py), written out here from those definitions, not imported."""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest

from chunkcache.config import EngineConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.hashing import block_hashes, none_hash, to_wire
from chunkcache.kv_events import BlockStored


def vllm_sha256(obj) -> bytes:  # vLLM's `sha256`, the default --prefix-caching-hash-algo
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_sha256_cbor(obj) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def vllm_chain(hash_fn, seed: str, tokens: list[int], block_size: int) -> list[bytes]:
    # init_none_hash: NONE_HASH = hash_fn(PYTHONHASHSEED); hash_block_tokens:
    # hash_fn((parent or NONE_HASH, tuple(block tokens), extra_keys)), extra_keys None without LoRA/MM/salt.
    parent = hash_fn(seed)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_fn((parent, tuple(tokens[start : start + block_size]), None))
        out.append(parent)
    return out


TOKENS = list(range(1000, 1050))


@pytest.mark.parametrize(("algorithm", "fn"), [("sha256", vllm_sha256), ("sha256_cbor", vllm_sha256_cbor)])
def test_block_hashes_equal_vllms(algorithm: str, fn) -> None:
    assert block_hashes("42", TOKENS, 16, algorithm) == vllm_chain(fn, "42", TOKENS, 16)


def test_the_default_is_vllms_default_pickle_sha256() -> None:
    assert block_hashes("0", TOKENS, 16) == vllm_chain(vllm_sha256, "0", TOKENS, 16)
    assert EngineConfig("m").cache.prefix_caching_hash_algo == "sha256"


def test_without_a_seed_the_root_is_random_per_process_like_vllm() -> None:
    assert EngineConfig("m").cache.hash_seed is None
    a, b = none_hash(None), none_hash(None)
    assert len(a) == 32 and a != b
    m1 = BlockManager(8, 4, True, None, "GPU")
    m2 = BlockManager(8, 4, True, None, "GPU")
    assert m1.root_hash != m2.root_hash
    assert none_hash("0") == vllm_sha256("0")


def test_pythonhashseed_sets_the_seed_and_the_algorithm_is_an_option(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    config = EngineConfig.from_options("m", prefix_caching_hash_algo="sha256_cbor")
    assert (config.cache.hash_seed, config.cache.prefix_caching_hash_algo) == ("123", "sha256_cbor")
    monkeypatch.delenv("PYTHONHASHSEED")
    assert EngineConfig.from_options("m").cache.hash_seed is None
    with pytest.raises(ValueError, match="prefix_caching_hash_algo 'md5' is not one of"):
        EngineConfig.from_options("m", prefix_caching_hash_algo="md5")


def test_xxhash_needs_its_package() -> None:
    try:
        import xxhash
    except ImportError:
        with pytest.raises(ValueError, match="xxhash"):
            EngineConfig.from_options("m", prefix_caching_hash_algo="xxhash")
    else:
        fn = lambda obj: xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))  # noqa: E731
        assert block_hashes("1", TOKENS, 16, "xxhash") == vllm_chain(fn, "1", TOKENS, 16)


def test_block_manager_publishes_vllm_hashes_in_the_full_attention_group() -> None:
    m = BlockManager(8, 16, True, "7", "GPU", hash_algorithm="sha256")
    blocks = m.allocate(4)
    hashes: list[bytes] = []
    m.register_full_blocks(blocks, TOKENS, hashes, len(TOKENS))
    want = vllm_chain(vllm_sha256, "7", TOKENS, 16)
    assert hashes == want
    assert m.events == [
        BlockStored(
            [to_wire(h)],
            to_wire(want[i - 1]) if i else None,
            TOKENS[16 * i : 16 * (i + 1)],
            16,
            None,
            "GPU",
            None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        for i, h in enumerate(want)
    ]
    m.free(blocks)
    m.check_integrity()
