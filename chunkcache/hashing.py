"""Content hashes shared by the engine, the KV events and the router.

Block hashes are vLLM-compatible (DESIGN.md §1): `sha256(cbor2.dumps((parent, tuple(tokens), extra),
canonical=True))`, chained from `NONE_HASH = sha256(cbor2.dumps(seed))`. On the wire a hash is its
low 64 bits as an unsigned int.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import cbor2


def _digest(obj: Any, algorithm: str = "sha256") -> bytes:
    return hashlib.new(algorithm, cbor2.dumps(obj, canonical=True)).digest()


def none_hash(seed: str) -> bytes:
    """The parent hash of a sequence's first block."""
    return _digest(seed)


def block_hash(parent: bytes, token_ids: Sequence[int], extra: Any = None) -> bytes:
    return _digest((parent, tuple(token_ids), extra))


def first_block_extra(cache_salt: str | None) -> tuple[str, ...] | None:
    """The extra keys of a sequence's first block: its cache salt, as vLLM puts it there, so that
    requests with different salts never share a chain."""
    return None if cache_salt is None else (cache_salt,)


def block_hashes(seed: str, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`."""
    parent = none_hash(seed)
    out: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
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


def system_hash(
    model_name: str, sys_token_ids: Sequence[int], algorithm: str = "sha256", cache_salt: str | None = None
) -> bytes:
    """Key of the system part's own KV in the chunk pool."""
    salt = () if cache_salt is None else (cache_salt,)
    return _digest(("system-v1", model_name, tuple(sys_token_ids), *salt), algorithm)


def to_wire(h: bytes) -> int:
    """A hash as sent in KV events: its low 64 bits, unsigned."""
    return int.from_bytes(h, "big") & (2**64 - 1)
