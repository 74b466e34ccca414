"""Content hashes shared by the engine, the KV events and the router.

Prefix-cache block hashes follow current vLLM (`vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`):
`h = hash_fn((parent, tuple(tokens), extra))` with parent = the previous block's digest (bytes), or
for the first block `NONE_HASH` = `hash_fn(PYTHONHASHSEED)` when a seed is set and 32 random bytes
when not. `hash_fn` is vLLM's `--prefix-caching-hash-algo`:
- `sha256` (vLLM's default): sha256 of `pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)`;
- `sha256_cbor`: sha256 of `cbor2.dumps(obj, canonical=True)` (language-independent);
- `xxhash` / `xxhash_cbor`: xxh3-128 of the same two serializations (needs the `xxhash` package).
On the wire a hash is its low 64 bits as an unsigned int (vLLM's default
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`). How to match each vLLM generation: docs/compatibility.md, "Prefix-cache block hashes".
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cbor2

BLOCK_HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_BLOCK_HASH_ALGORITHM = "sha256"


def _digest(obj: Any, algorithm: str = "sha256") -> bytes:
    return hashlib.new(algorithm, cbor2.dumps(obj, canonical=True)).digest()


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash  # optional, as in vLLM: only needed for the xxhash algorithms
    except ImportError:
        raise ValueError(
            "the xxhash block hash algorithms need the `xxhash` package (pip install xxhash)"
        ) from None
    return xxhash.xxh3_128_digest(data)


_BLOCK_HASH_FNS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda obj: hashlib.sha256(_pickled(obj)).digest(),
    "sha256_cbor": lambda obj: hashlib.sha256(_cbor(obj)).digest(),
    "xxhash": lambda obj: _xxh3_128(_pickled(obj)),
    "xxhash_cbor": lambda obj: _xxh3_128(_cbor(obj)),
}


def block_hash_fn(algorithm: str) -> Callable[[Any], bytes]:
    """vLLM's hash function of that name; a ValueError names the known ones."""
    fn = _BLOCK_HASH_FNS.get(algorithm)
    if fn is None:
        raise ValueError(f"prefix_caching_hash_algo {algorithm!r} is not one of {BLOCK_HASH_ALGORITHMS}")
    if algorithm.startswith("xxhash"):
        fn(b"")  # fail now, at configuration, when the package is missing
    return fn


def none_hash(seed: str | None, algorithm: str = DEFAULT_BLOCK_HASH_ALGORITHM) -> bytes:
    """The parent hash of a sequence's first block: `hash_fn(seed)`, or 32 random bytes without a
    seed (vLLM's behaviour when PYTHONHASHSEED is unset: hashes are then private to the process)."""
    if seed is None:
        return os.urandom(32)
    return block_hash_fn(algorithm)(seed)


def block_hash(
    parent: bytes, token_ids: Sequence[int], extra: Any = None, algorithm: str = DEFAULT_BLOCK_HASH_ALGORITHM
) -> bytes:
    return _BLOCK_HASH_FNS[algorithm]((parent, tuple(token_ids), extra))


@dataclass(frozen=True)
class BlockKeys:
    """What besides its tokens a sequence's block hashes cover: vLLM's extra keys.

    `cache_salt` on the first block, so that requests with different salts never share a chain;
    from block `kv_key_from` on, `kv_key`, which says how the KV was computed where it is not a
    plain prefill's (a blend's options and cuts, `blend_key`), so that no plain prompt ever finds
    such a block. Blocks under either are private: no KV event publishes them (a router computes
    plain chains only)."""

    cache_salt: str | None = None
    kv_key: bytes | None = None
    kv_key_from: int = 0

    def _keyed(self, index: int) -> bool:
        return self.kv_key is not None and index >= self.kv_key_from

    def extra(self, index: int) -> tuple[str | bytes, ...] | None:
        keys: tuple[str | bytes, ...] = ()
        if index == 0 and self.cache_salt is not None:
            keys += (self.cache_salt,)
        if self._keyed(index):
            keys += (self.kv_key,)
        return keys or None

    def private(self, index: int) -> bool:
        return self.cache_salt is not None or self._keyed(index)


PLAIN = BlockKeys()


def block_hashes(
    seed: str | None, token_ids: Sequence[int], block_size: int, algorithm: str = DEFAULT_BLOCK_HASH_ALGORITHM
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`."""
    parent = none_hash(seed, algorithm)
    out: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], None, algorithm)
        out.append(parent)
    return out


def chunk_hash(
    model_name: str,
    sys_token_ids: Sequence[int],
    chunk_token_ids: Sequence[int],
    algorithm: str = "sha256",
    cache_salt: str | None = None,
) -> bytes:
    """Key of a chunk's KV in the chunk pool: it depends on the system part and the chunk only
    (and on the request's cache salt, when it has one: tenants with different salts share nothing)."""
    salt = () if cache_salt is None else (cache_salt,)
    return _digest(("chunk-v1", model_name, tuple(sys_token_ids), tuple(chunk_token_ids), *salt), algorithm)


def blend_key(options: tuple[Any, ...], part_lengths: Sequence[int], algorithm: str = "sha256") -> bytes:
    """The `kv_key` of prefix blocks holding a blend's KV: the blend options that decide it and
    where the prompt's parts (S, then each chunk) end, since the same tokens cut otherwise blend
    otherwise."""
    return _digest(("blend-v1", options, tuple(part_lengths)), algorithm)


def system_hash(
    model_name: str, sys_token_ids: Sequence[int], algorithm: str = "sha256", cache_salt: str | None = None
) -> bytes:
    """Key of the system part's own KV in the chunk pool."""
    salt = () if cache_salt is None else (cache_salt,)
    return _digest(("system-v1", model_name, tuple(sys_token_ids), *salt), algorithm)


def prompt_hashes(
    model_name: str,
    sys_token_ids: Sequence[int],
    chunks: Sequence[Sequence[int]],
    algorithm: str = "sha256",
    cache_salt: str | None = None,
) -> list[bytes]:
    """`system_hash` of S, then `chunk_hash` of each chunk, the same bytes for fewer CPU cycles:
    each digest is of the CBOR of a short array, which is an array head followed by each item's
    own CBOR, so S is encoded and hashed once and each chunk continues a copy of that hash
    (a router keys every prompt it routes; S is often most of a prompt's text)."""

    def head(items: int) -> bytes:  # CBOR's head of an array of fewer than 24 items
        return bytes([0x80 | items])

    salt = b"" if cache_salt is None else _cbor(cache_salt)
    extra = 0 if cache_salt is None else 1
    model, sys_cbor = _cbor(model_name), _cbor(tuple(sys_token_ids))
    hashes = [hashlib.new(algorithm, head(3 + extra) + _cbor("system-v1") + model + sys_cbor + salt).digest()]
    base = hashlib.new(algorithm, head(4 + extra) + _cbor("chunk-v1") + model + sys_cbor)
    for chunk in chunks:
        h = base.copy()
        h.update(_cbor(tuple(chunk)))
        h.update(salt)
        hashes.append(h.digest())
    return hashes


def to_wire(h: bytes) -> int:
    """A hash as sent in KV events: its low 64 bits, unsigned."""
    return int.from_bytes(h, "big") & (2**64 - 1)
