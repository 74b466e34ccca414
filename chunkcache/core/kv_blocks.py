"""Paged KV blocks with prefix caching (vLLM-compatible block hashes, docs/design.md §1).

Contract:
- A block is either in use (ref count > 0, held by one or more sequences) or free (ref 0, in the
  free queue). Every block id in [first_block, first_block + num_blocks) is in exactly one state.
- A full block of a sequence whose tokens are all computed may be registered under its chained
  hash; a hash maps to at most one block. Freed registered blocks keep their KV and stay findable
  until the allocator reuses them, least recently freed first (unregistered ones go first).
- `match_prefix` takes references on the longest chain of registered blocks of a token list.
- A block whose KV is not a plain prefill's (a blend's) is registered under a chain whose extra
  keys say how it was computed (`hashing.BlockKeys`): only a request that would compute the same
  KV finds it.
- Registration and eviction are reported as KV events (BlockStored / BlockRemoved) in `events`,
  which the engine drains once per step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from chunkcache.hashing import (
    DEFAULT_BLOCK_HASH_ALGORITHM,
    PLAIN,
    BlockKeys,
    block_hash,
    block_hash_fn,
    none_hash,
    to_wire,
)
from chunkcache.kv_events import FULL_ATTENTION, BlockRemoved, BlockStored

# This engine's one KV cache group: every layer is full attention (vLLM's group 0 of that kind).
KV_CACHE_GROUP = 0


class OutOfBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        hash_seed: str | None,
        medium: str,
        first_block: int = 0,
        hash_algorithm: str = DEFAULT_BLOCK_HASH_ALGORITHM,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        block_hash_fn(hash_algorithm)  # a clear error for an unknown or uninstalled algorithm
        self.hash_algorithm = hash_algorithm
        self.root_hash = none_hash(hash_seed, hash_algorithm)
        self.medium = medium
        self.first_block = first_block
        self._ref = dict.fromkeys(range(first_block, first_block + num_blocks), 0)
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        # Hashes of salted chains: never published, so that no event tells who cached what.
        self._private: set[bytes] = set()
        # Published blocks: hash -> (parent hash, its BlockStored), to re-publish the whole state.
        self._stored: dict[bytes, tuple[bytes | None, BlockStored]] = {}
        # Free blocks, front = next to reuse.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in self._ref)
        self.events: list[BlockStored | BlockRemoved] = []
        self.hits = 0
        self.queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        # Reverse order: a sequence's tail blocks are reused before its head, whose hash chain
        # is worth more (every later block of the chain depends on it).
        for block in reversed(blocks):
            self._ref[block] -= 1
            assert self._ref[block] >= 0, f"block {block} freed twice"
            if self._ref[block] == 0:
                self._free[block] = None
                if block not in self._hash_of:
                    self._free.move_to_end(block, last=False)

    def _chain(
        self, token_ids: Sequence[int], max_blocks: int, keys: BlockKeys
    ) -> Iterator[tuple[bytes, int]]:
        """(hash, block) of the longest cached chain of `token_ids`'s first `max_blocks` full
        blocks."""
        parent = self.root_hash
        bs = self.block_size
        for i in range(min(max_blocks, len(token_ids) // bs)):
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs], keys.extra(i), self.hash_algorithm)
            block = self._block_of.get(h)
            if block is None:
                return
            yield h, block
            parent = h

    def cached_prefix_blocks(self, token_ids: Sequence[int], max_blocks: int, keys: BlockKeys = PLAIN) -> int:
        """How many leading full blocks `match_prefix` would find now; takes no references."""
        if not self.enable_prefix_caching:
            return 0
        return sum(1 for _ in self._chain(token_ids, max_blocks, keys))

    def match_prefix(
        self, token_ids: Sequence[int], max_blocks: int, keys: BlockKeys = PLAIN
    ) -> tuple[list[int], list[bytes]]:
        """Referenced blocks and their hashes for the longest cached chain of `token_ids`'s full
        blocks, of chains with the same `keys` only."""
        if not self.enable_prefix_caching:
            return [], []
        blocks: list[int] = []
        hashes: list[bytes] = []
        for h, block in self._chain(token_ids, max_blocks, keys):
            blocks.append(block)
            hashes.append(h)
        self.queries += min(max_blocks, len(token_ids) // self.block_size, len(blocks) + 1)
        self.hits += len(blocks)
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
        return blocks, hashes

    def register_full_blocks(
        self,
        blocks: Sequence[int],
        token_ids: Sequence[int],
        hashes: list[bytes],
        num_tokens: int,
        keys: BlockKeys = PLAIN,
    ) -> None:
        """Hash and register the sequence's full blocks among its first `num_tokens` computed tokens.

        `hashes` is the sequence's chain so far; it is extended in place. Private blocks
        (`BlockKeys.private`) are registered without an event.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else self.root_hash
            tokens = token_ids[i * bs : (i + 1) * bs]
            h = block_hash(parent, tokens, keys.extra(i), self.hash_algorithm)
            hashes.append(h)
            block = blocks[i]
            if h in self._block_of or block in self._hash_of:
                continue  # the same content is cached elsewhere already
            self._block_of[h] = block
            self._hash_of[block] = h
            if keys.private(i):
                self._private.add(h)
                continue
            event = BlockStored(
                block_hashes=[to_wire(h)],
                parent_block_hash=to_wire(parent) if hashes[:-1] else None,
                token_ids=list(tokens),
                block_size=bs,
                lora_id=None,
                medium=self.medium,
                group_idx=KV_CACHE_GROUP,
                kv_cache_spec_kind=FULL_ATTENTION,
            )
            self._stored[h] = (parent if hashes[:-1] else None, event)
            self.events.append(event)

    def _evict(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            if h in self._private:
                self._private.discard(h)
            else:
                del self._stored[h]
                self.events.append(
                    BlockRemoved(block_hashes=[to_wire(h)], medium=self.medium, group_idx=KV_CACHE_GROUP)
                )

    def reset_prefix_cache(self) -> bool:
        """Forget every registered free block (the caller publishes AllBlocksCleared)."""
        if any(self._ref[b] for b in self._hash_of):
            return False
        self._block_of.clear()
        self._hash_of.clear()
        self._private.clear()
        self._stored.clear()
        return True

    def state_events(self) -> list[BlockStored]:
        """A BlockStored for every published block still cached, each parent before its
        children: what a subscriber that lost its state needs to rebuild it."""
        out: list[BlockStored] = []
        done: set[bytes] = set()
        for h in self._stored:
            chain: list[bytes] = []
            node: bytes | None = h
            while node is not None and node in self._stored and node not in done:
                chain.append(node)
                node = self._stored[node][0]
            for link in reversed(chain):
                done.add(link)
                out.append(self._stored[link][1])
        return out

    def check_integrity(self) -> None:
        for block, ref in self._ref.items():
            assert ref >= 0, f"block {block} has ref count {ref}"
            assert (ref == 0) == (block in self._free), f"block {block}: ref {ref} vs free queue"
        assert len(self._free) + sum(1 for r in self._ref.values() if r > 0) == self.num_blocks
        for h, block in self._block_of.items():
            assert self._hash_of.get(block) == h, f"hash maps disagree for block {block}"
        assert len(self._hash_of) == len(self._block_of)
        assert self._private <= self._block_of.keys(), "a private hash outlived its block"
        assert self._stored.keys() == self._block_of.keys() - self._private, "published blocks disagree"
