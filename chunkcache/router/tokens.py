"""The router's token processor: its own block keys, the engine-hash -> key mapping, prompt parsing.

Router keys are chained 64-bit blake2b digests over 16-token blocks, seeded by a fixed router
constant. They depend on token content only, never on an engine's hash seed or algorithm: engine
hashes from `BlockStored` events are translated through the event's `token_ids` (llm-d's design),
so an engine started with another PYTHONHASHSEED, or a vLLM replica, still maps onto the same keys.
blake2b rather than the engines' sha256-over-CBOR because the router hashes every block of every
event and every request: it is ~10x cheaper here, and only routers (which all share this code)
ever compare these keys.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkcache.chunk.documents import (
    PromptParts,
    parse_documents,
    render_with_documents,
)
from chunkcache.chunk.parse import parse_chunked_prompt, tokenize_parts
from chunkcache.config import DEFAULT_DOCUMENTS_FORMAT
from chunkcache.errors import ModelLoadError
from chunkcache.hashing import prompt_hashes, to_wire
from chunkcache.kv_events import BlockStored
from chunkcache.model.gguf_tokenizer import load_gguf_tokenizer_without_torch
from chunkcache.model.source import find_gguf
from chunkcache.router.word_encoder import WordEncoder

ROUTER_BLOCK_SIZE = 16
_ROUTER_SEED = b"chunkcache-router-keys-v1"


def _digest64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = array("I", token_ids)  # raises OverflowError for ids outside [0, 2**32)
    if sys.byteorder == "big":
        arr.byteswap()  # keys must not depend on the router's machine: routers can share Redis
    return arr.tobytes()


class BlockKeyer:
    """Chained router keys over full blocks of `block_size` tokens."""

    def __init__(self, block_size: int = ROUTER_BLOCK_SIZE) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self._root = _digest64(_ROUTER_SEED)
        self._lora_roots: dict[str, int] = {}

    def root(self, lora: str | None = None) -> int:
        """Parent key of a sequence's first block; a LoRA adapter gets its own chain."""
        if lora is None:
            return self._root
        root = self._lora_roots.get(lora)
        if root is None:
            root = self._lora_roots[lora] = _digest64(_ROUTER_SEED + b"\0lora\0" + lora.encode())
        return root

    def chain(self, parent: int, token_ids: Sequence[int]) -> list[int]:
        """Keys of every full block of `token_ids`, continuing the chain from `parent`."""
        data = _token_bytes(token_ids)
        step = 4 * self.block_size
        end = (len(token_ids) // self.block_size) * step
        blake = hashlib.blake2b
        prev = parent.to_bytes(8, "big")
        digests: list[bytes] = []
        append = digests.append
        for off in range(0, end, step):
            prev = blake(prev + data[off : off + step], digest_size=8).digest()
            append(prev)
        # One C-level conversion of all digests to ints instead of one call per block.
        return list(struct.unpack(f">{len(digests)}Q", b"".join(digests)))

    def request_keys(
        self, token_ids: Sequence[int], lora: str | None = None, cache_salt: str | None = None
    ) -> list[int]:
        root = self.root(lora)
        if cache_salt is not None:
            # A salted request's chain is its own. Engines never publish salted blocks (that
            # would tell who cached what), so these keys match nothing: no prefix credit.
            root = _digest64(root.to_bytes(8, "big") + b"\0salt\0" + cache_salt.encode())
        return self.chain(root, token_ids)


def _lora_of(event: BlockStored) -> str | None:
    if event.lora_name is not None:
        return event.lora_name
    return None if event.lora_id is None else f"#lora-id-{event.lora_id}"


class EngineKeyMap:
    """One pod's mapping engine block hash -> router key(s), so that a child's parent resolves and a
    `BlockRemoved` (which carries hashes only) finds the keys to drop.

    The mapping is a pure function of content, so keeping an entry too long is never wrong; dropping
    one too early is (the block's removal could not be mapped), hence entries leave only on removal,
    with a refcount for blocks stored more than once (several tiers, several KV groups), plus a
    generous capacity bound against an engine that never sends removals.
    """

    def __init__(self, keyer: BlockKeyer, capacity: int = 1 << 21) -> None:
        self.keyer = keyer
        self.capacity = capacity
        # An int when an engine block is one router block (the common case: saves a tuple per block).
        self._keys: dict[int, int | tuple[int, ...]] = {}
        self._extra_refs: dict[int, int] = {}
        self.unresolved_blocks = 0
        self.forgotten_blocks = 0

    def __len__(self) -> int:
        return len(self._keys)

    def stored(self, event: BlockStored) -> list[int]:
        """Router keys of the event's blocks; [] when the parent is unknown (we joined late, or the
        parent's mapping was lost): the chain cannot be rebuilt without the parent's key."""
        kbs = self.keyer.block_size
        n = len(event.block_hashes)
        if event.block_size <= 0 or event.block_size % kbs:
            raise ValueError(f"engine block_size {event.block_size} is not a multiple of the router's {kbs}")
        if len(event.token_ids) != n * event.block_size:
            raise ValueError(
                f"BlockStored has {n} blocks of {event.block_size} but {len(event.token_ids)} token ids"
            )
        if event.parent_block_hash is None:
            parent = self.keyer.root(_lora_of(event))
        else:
            known = self._keys.get(event.parent_block_hash)
            if known is None:
                self.unresolved_blocks += n
                return []
            parent = known if isinstance(known, int) else known[-1]
        keys = self.keyer.chain(parent, event.token_ids)
        ratio = event.block_size // kbs
        table = self._keys
        # Blocks stored again (another tier, another KV group) gain a ref; rewriting their entry
        # is harmless since it maps the same content to the same keys.
        for h in table.keys() & event.block_hashes:
            self._extra_refs[h] = self._extra_refs.get(h, 0) + 1
        if ratio == 1:
            table.update(zip(event.block_hashes, keys, strict=True))
        else:
            groups = (tuple(keys[i : i + ratio]) for i in range(0, len(keys), ratio))
            table.update(zip(event.block_hashes, groups, strict=True))
        while len(table) > self.capacity:
            oldest = next(iter(table))
            del table[oldest]
            self._extra_refs.pop(oldest, None)
            self.forgotten_blocks += 1
        return keys

    def removed(self, block_hashes: Sequence[int]) -> list[int]:
        """Router keys of removed blocks (unknown hashes are skipped)."""
        out: list[int] = []
        table = self._keys
        for h in block_hashes:
            known = table.get(h)
            if known is None:
                continue
            refs = self._extra_refs.get(h)
            if refs:
                if refs == 1:
                    del self._extra_refs[h]
                else:
                    self._extra_refs[h] = refs - 1
            else:
                del table[h]
            if isinstance(known, int):
                out.append(known)
            else:
                out.extend(known)
        return out

    def clear(self) -> None:
        self._keys.clear()
        self._extra_refs.clear()


class CachedEncoder:
    """`tokenizer.encode` remembered for long texts, least recently used first out once the
    remembered texts pass `capacity_tokens` tokens. A RAG router sees the same documents again
    and again, and tokenizing them is most of its per-request work (~6 ms for 8k tokens with a
    real BPE, against ~1 ms for keys and scores); the ids are those the tokenizer gave, so the
    keys cannot change. Thread-safe (the router tokenizes on a thread pool)."""

    def __init__(self, tokenizer: Any, capacity_tokens: int = 1 << 21, min_chars: int = 256) -> None:
        self.tokenizer = tokenizer
        self.capacity_tokens = capacity_tokens
        self.min_chars = min_chars
        self._ids: OrderedDict[tuple[str, bool], array[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> Sequence[int]:
        if len(text) < self.min_chars:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        key = (text, add_special_tokens)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
                self.hits += 1
                return ids
        ids = array("Q", self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        with self._lock:
            self.misses += 1
            if len(ids) <= self.capacity_tokens and key not in self._ids:
                self._ids[key] = ids
                self._tokens += len(ids)
                while self._tokens > self.capacity_tokens:
                    self._tokens -= len(self._ids.popitem(last=False)[1])
        return ids

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def num_tokens(self) -> int:
        return self._tokens


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt as the router scores it. For a chunked prompt the prefix is the system part S and
    `chunks` are the chunk token ids: an engine keeps the KV of both in its chunk pool (S as an
    entry of its own, published like a chunk), found in any order; otherwise the prefix is the
    whole prompt, scored against the engines' prefix caches. `token_ids` is the whole prompt as
    an engine tokenizes it (for a chunked one: S, the chunks and Q, each tokenized on its own)."""

    prefix_token_ids: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...] = ()
    num_tokens: int = 0
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PromptKeys:
    block_keys: list[int]
    chunk_keys: list[int]
    chunk_tokens: list[int]
    num_tokens: int


def load_router_tokenizer(path: Path) -> Any:
    """The tokenizer at `path` (see `PromptProcessor.from_pretrained`); a ModelLoadError in one line
    when there is none, never transformers' traceback."""
    if not path.exists():
        raise ModelLoadError(f"tokenizer {str(path)!r}: no such file or directory")
    gguf = find_gguf(path)
    if gguf is not None:
        return load_gguf_tokenizer_without_torch(gguf)
    if path.is_dir() and not any(path.glob("tokenizer*")):
        raise ModelLoadError(f"{path} holds neither a tokenizer (tokenizer.json, ...) nor a .gguf file")
    from transformers import AutoTokenizer  # heavy import, only where a tokenizer is loaded

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # no tokenizer files, a broken one, a converter that is not installed
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"could not load a tokenizer from {path}: {message}") from e


class PromptProcessor:
    """Tokenizes prompts exactly as an engine does (docs/design.md §2) and turns them into index keys."""

    def __init__(
        self,
        tokenizer: Any,
        model_name: str,
        keyer: BlockKeyer | None = None,
        separator: str = " # # ",
        chunk_hash_algorithm: str = "sha256",
        enable_chunks: bool = True,
        documents_format: str = DEFAULT_DOCUMENTS_FORMAT,
        token_cache_tokens: int = 1 << 21,
        word_encoder: bool = True,
    ) -> None:
        self.documents_format = documents_format
        self.tokenizer = tokenizer
        # The tokenizer's ids, by pre-token from a cache for ASCII text when the tokenizer is one
        # WordEncoder reproduces exactly (word_encoder.py); the tokenizer itself otherwise.
        self.encoder: Any = (WordEncoder.for_tokenizer(tokenizer) if word_encoder else None) or tokenizer
        # The parts of chunked prompts (documents) recur: their ids are remembered.
        self.parts = CachedEncoder(self.encoder, token_cache_tokens)
        self.model_name = model_name
        self.keyer = keyer or BlockKeyer()
        self.separator = separator
        self.chunk_hash_algorithm = chunk_hash_algorithm
        self.enable_chunks = enable_chunks

    @classmethod
    def from_pretrained(cls, path: str, model_name: str, **kwargs: Any) -> PromptProcessor:
        """With the tokenizer of `path`: a tokenizer or checkpoint directory, or a GGUF file (or a
        directory holding one), whose metadata is the tokenizer (read without torch)."""
        return cls(load_router_tokenizer(Path(path).expanduser()), model_name, **kwargs)

    def render_chat(
        self, messages: list[dict[str, Any]], documents: Any = None, **template_kwargs: Any
    ) -> str | PromptParts:
        """The chat as an engine renders it; with `documents`, cut into parts as an engine cuts it
        (ValueError for documents an engine would refuse, but for their number: the router does
        not know the engines' max_chunks)."""

        def render(msgs: list[dict[str, Any]], docs: list[dict[str, str]] | None) -> str:
            extra = template_kwargs if docs is None else {**template_kwargs, "documents": docs}
            return self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True, **extra
            )

        if documents is None:
            return render(messages, None)
        docs = parse_documents(documents, max_documents=len(documents) if isinstance(documents, list) else 0)
        return render_with_documents(render, messages, docs, self.documents_format)

    def tokenize(
        self, prompt: str | Sequence[int] | PromptParts, rendered_chat: bool = False
    ) -> TokenizedPrompt:
        if isinstance(prompt, PromptParts):
            if not self.enable_chunks:
                return self.tokenize(prompt.text(), rendered_chat)
            chunked = tokenize_parts(
                prompt.system, prompt.chunks, prompt.question, self.parts, not rendered_chat
            )
            return TokenizedPrompt(chunked.sys_token_ids, chunked.chunks, chunked.num_tokens)
        if not isinstance(prompt, str):
            ids = tuple(int(t) for t in prompt)
            return TokenizedPrompt(ids, (), len(ids), ids)
        # A rendered chat is tokenized without special tokens, as the engine does (its template
        # writes the BOS): adding another would shift every block and miss the engine's cache.
        special = not rendered_chat
        if self.enable_chunks:
            chunked = parse_chunked_prompt(prompt, self.separator, self.parts, add_special_tokens=special)
            if chunked is not None:
                return TokenizedPrompt(
                    chunked.sys_token_ids, chunked.chunks, chunked.num_tokens, tuple(chunked.all_token_ids())
                )
        ids = tuple(self.encoder.encode(prompt, add_special_tokens=special))
        return TokenizedPrompt(ids, (), len(ids), ids)

    def keys(
        self,
        prompt: TokenizedPrompt,
        lora: str | None = None,
        cache_salt: str | None = None,
        chunked_block_keys: bool = True,
    ) -> PromptKeys:
        """Index keys of a prompt; a `cache_salt` keys it as engines do (its own chunk keys).

        A chunked prompt gets block keys too, over its whole token list: what a prefix router
        sees. An engine registers S and the first chunk of a layout-"offset" request in its
        prefix cache (their KV is a plain prefill's), and a plain request may have cached more.
        A router that scores chunked prompts by their chunks alone (`cache_aware`: an engine
        serves them from its chunk pool) does not need those: `chunked_block_keys=False`."""
        ids = prompt.token_ids or prompt.prefix_token_ids
        if not prompt.chunks:
            return PromptKeys(self.keyer.request_keys(ids, lora, cache_salt), [], [], prompt.num_tokens)
        block_keys = self.keyer.request_keys(ids, lora, cache_salt) if chunked_block_keys else []
        sys_ids = prompt.prefix_token_ids
        hashes = prompt_hashes(self.model_name, sys_ids, prompt.chunks, self.chunk_hash_algorithm, cache_salt)
        chunk_keys = [to_wire(h) for h in hashes]
        chunk_tokens = [len(sys_ids), *map(len, prompt.chunks)]
        return PromptKeys(block_keys, chunk_keys, chunk_tokens, prompt.num_tokens)
