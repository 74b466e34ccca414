"""The interface every lower tier implements, and the one byte format they all store.

Contract of a `TierProvider` (a byte store of encoded entries, keyed by a hex string):
- `store(key, blob)` keeps `blob` under `key` (replacing what was there), or returns False and
  keeps nothing (over budget, writes stopped, backend down). It never raises for an
  environmental failure; it logs and counts.
- `load(key)` returns the bytes last stored under `key`, or None. It never raises for an
  environmental failure either; a caller that finds the bytes corrupt calls `evict(key)`.
- `contains(key)` is a cheap membership test with the same failure rule.
- `evict(key)` removes the entry (no error when absent).
- `stats()` is a flat dict of numbers: at least `entries` and `bytes` where the tier can know them.
- `check_integrity()` asserts the tier's own bookkeeping (index vs. what it holds).
- `names()` lists the entries a tier holds when it can know them cheaply (a local index), else
  None; a tier that evicts on its own calls `on_evict(name)` for each entry it pushes out.
`store` is called from the stack's writer thread, everything else from the engine thread:
providers guard their own state.

Entry format (`encode`/`decode`): a safetensors file holding `k` and `v`, each
[layers, tokens, kv_heads, head_dim] in the engine's dtype, and, once the entry measured it, its
`sensitivity` [tokens] in float32 (engine/sensitivity.py), with string metadata: the format tag,
the model identity, the pool key, the entry kind, the token ids it was computed from, and a
blake2b checksum of the tensor bytes, verified on every decode.
"""

from __future__ import annotations

import hashlib
import json
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = "chunkcache-kv-v1"


class CorruptEntry(ValueError):
    """Stored bytes that do not decode, or whose checksum does not match."""


@dataclass
class StoredKV:
    """One pool entry's KV off the device: what a lower tier keeps."""

    model: str  # the engine's model identity (model_identity): other models never load it
    key: bytes  # the pool key
    kind: str  # "system" | "chunk"
    token_ids: tuple[tuple[int, ...], ...]  # what the key was computed from, compared on load
    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim], on the CPU
    v: torch.Tensor
    sensitivity: torch.Tensor | None = None  # [tokens] float32, where the entry measured it

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (0 if self.sensitivity is None else self.sensitivity.nbytes)


def tier_key(model: str, key: bytes, num_tokens: int) -> str:
    """The name of an entry in every tier: the model identity's first 64 bits, the entry's token
    count and the pool key (the full identity and the token ids are compared on load; the rest
    stays readable, so a tier's index alone can announce its entries in events)."""
    return f"{model[:16]}-{num_tokens}-{key.hex()}"


def parse_tier_key(name: str) -> tuple[str, int, bytes] | None:
    """(model prefix, token count, pool key) of a tier key; None for a name that is not one."""
    parts = name.split("-")
    if len(parts) != 3 or len(parts[0]) != 16:
        return None
    try:
        return parts[0], int(parts[1]), bytes.fromhex(parts[2])
    except ValueError:
        return None


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(tensors):
        h.update(tensors[name].contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def encode(kv: StoredKV) -> bytes:
    tensors = {"k": kv.k.contiguous(), "v": kv.v.contiguous()}
    if kv.sensitivity is not None:
        tensors["sensitivity"] = kv.sensitivity.contiguous()
    metadata = {
        "format": FORMAT,
        "model": kv.model,
        "key": kv.key.hex(),
        "kind": kv.kind,
        "token_ids": json.dumps([list(t) for t in kv.token_ids]),
        "checksum": _checksum(tensors),
    }
    return st_save(tensors, metadata)


def decode(blob: bytes) -> StoredKV:
    """The entry in `blob`; CorruptEntry when it is truncated, malformed or fails its checksum."""
    try:
        (header_len,) = struct.unpack("<Q", blob[:8])
        metadata: dict[str, Any] = json.loads(blob[8 : 8 + header_len]).get("__metadata__") or {}
        tensors = st_load(blob)
    except Exception as e:  # safetensors, json and struct each raise their own kind
        raise CorruptEntry(f"undecodable entry: {type(e).__name__}: {e}") from None
    if metadata.get("format") != FORMAT or set(tensors) - {"sensitivity"} != {"k", "v"}:
        raise CorruptEntry(f"not a {FORMAT} entry")
    if _checksum(tensors) != metadata.get("checksum"):
        raise CorruptEntry("checksum mismatch")
    try:
        token_ids = tuple(tuple(int(t) for t in part) for part in json.loads(metadata["token_ids"]))
        key = bytes.fromhex(metadata["key"])
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptEntry(f"bad metadata: {e}") from None
    return StoredKV(
        metadata.get("model", ""),
        key,
        metadata.get("kind", ""),
        token_ids,
        tensors["k"],
        tensors["v"],
        tensors.get("sensitivity"),
    )


class TierProvider(ABC):
    """A lower tier: see the module docstring for the contract."""

    #: The tier's name in events, stats and metrics: vLLM's `medium` ("CPU", "DISK", "REMOTE").
    medium: str
    #: Set by the stack: told the name of each entry the tier evicts by itself.
    on_evict: Callable[[str], None] | None = None

    @abstractmethod
    def store(self, key: str, blob: bytes) -> bool: ...

    @abstractmethod
    def load(self, key: str) -> bytes | None: ...

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def evict(self, key: str) -> None: ...

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def check_integrity(self) -> None: ...

    def names(self) -> list[str] | None:
        """The names of the entries held, where a local index knows them; None elsewhere."""
        return None

    def close(self) -> None:
        """Release connections or files; the default holds none."""
        return None
