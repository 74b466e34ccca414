"""Separator-free matching at admission: a plain prompt cut into the chunked-prompt parts.

The chunk manager's half that decides *what* a plain prompt is made of (chunk/matcher.py finds
the runs; this turns them into S, chunks and Q on the pool as it is now, or says the prompt runs
as a plain prefill); the manager then borrows and computes those parts as for any chunked prompt.
Apart from chunk/manager.py so that each reads in one sitting (docs/chunk-cache.md "separator_free").

Under layout "fusion" every stream must be exact, so a prompt's matches are cut again
(matcher.fusion_documents): only runs computed right after this S are borrowed; the other matched
pieces are computed after S for this request, and the request becomes a fusion request over the
documents where its streams fit. That is the engine's to say (RequestIntake.fuse), so admission of
a plain prompt is two calls with the engine's answer between them: `propose` (the cut, and the
documents it offers to fuse over) and `admit` (the parts served, given whether it was fused).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from chunkcache.chunk.matcher import FusionDocuments, Plan, Run, SpanIndex, fusion_documents, plan
from chunkcache.chunk.pool import ChunkPool
from chunkcache.config import ChunkConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.core.kv_slots import block_slots
from chunkcache.core.plan import ChunkedPrompt, ChunkPlan, Entry, PlainPrompt
from chunkcache.core.sequence import Sequence
from chunkcache.hashing import chunk_hash, system_hash

# A prompt whose matches cover less of its span than this runs as a first sight. Its gaps would
# be fill-job prefills and the blend recomputes every token before its check layer and a share
# after it: a prompt with no match at all, cut so, took 1.6-1.8x a plain prefill
# (bench_separator_free); a mostly new one is not worth it either.
_MIN_REUSED_SHARE = 0.25
_NO_INDEX = SpanIndex(lambda entry: False)

Admitted = tuple[ChunkedPrompt, list[Run | None], tuple[bool, ...]]


@dataclass(frozen=True)
class FusionOffer:
    """Layout "fusion": the documents a separator-free request's matches make, offered to the
    engine, which makes it a fusion request over them if its streams fit (RequestIntake.fuse)."""

    prompt: ChunkedPrompt  # S, the documents, Q
    config: ChunkConfig
    reserve: int  # KV blocks its S and computed documents may take (should the pool refuse them)
    documents: FusionDocuments


@dataclass(frozen=True)
class PlainCut:
    """How a plain prompt would be served on the pool as it is now (`PlainPromptCutter.propose`):
    its plan (None: a plain request) and, under layout "fusion" with matches, whether it is a
    fusion candidate and the documents offered (None: too few matched, it runs as a first sight)."""

    plan: Plan | None
    fusion_candidate: bool = False
    offer: FusionOffer | None = None


class PlainPromptCutter:
    """Cuts plain prompts on the pool's span index; counts what it did in `counters` (the
    manager's `separator_free` stats)."""

    def __init__(
        self,
        pool: ChunkPool,
        index: SpanIndex,
        blocks: BlockManager,
        model_name: str,
        hash_algorithm: str,
        counters: dict[str, int],
    ) -> None:
        self.pool, self.index, self.blocks = pool, index, blocks
        self.model_name, self.hash_algorithm = model_name, hash_algorithm
        self.counters = counters

    def propose(self, prompt: PlainPrompt, config: ChunkConfig) -> PlainCut:
        """How a plain prompt would be cut now; under layout "fusion", the documents its matches
        make, offered to the engine (`admit` is told whether it took them). Changes nothing."""
        self.counters["requests"] += 1
        cut = self.cut(prompt.token_ids, config)
        if cut is None or config.layout != "fusion" or not any(run for _, _, run in cut.parts):
            return PlainCut(cut)
        docs = fusion_documents(prompt.token_ids, cut, self.index, config.separator_free_min_tokens)
        if docs is None:
            return PlainCut(cut, fusion_candidate=True)
        parts = self.parts(prompt.token_ids, docs.plan)[0]
        return PlainCut(cut, True, FusionOffer(parts, config, self.private_worst(docs.plan), docs))

    def admit(
        self, seq: Sequence, prompt: PlainPrompt, config: ChunkConfig, proposed: PlainCut, fused: bool
    ) -> Admitted | None:
        """The parts `seq`'s plain prompt is served as (`proposed`, over the documents offered
        where the engine `fused` it), each chunk's run (None: computed) and, under fusion, which
        chunks were matched; their runs' entries pinned. None: it runs as a plain request (its
        `learn` set where a first sight stores its parts afterwards)."""
        cut = proposed.plan
        if cut is None:
            seq.chunk_plan = None
            seq.prefix_keys.cacheable = True
            return None
        matched: tuple[bool, ...] = ()
        if proposed.fusion_candidate:
            cut, matched = self._fusion_cut(prompt.token_ids, config, proposed.offer, fused)
        if not matched and (cut is None or not any(run for _, _, run in cut.parts)):
            # First sight: nothing to borrow. A plain prefill computes exactly the KV its
            # parts would get (S, then the span after S), so it runs as one, prefix cache
            # included, and its parts are stored from its KV afterwards (`learn`).
            seq.chunk_plan = None
            seq.prefix_keys.cacheable = True
            seq.learn = None if cut is None else self.parts(prompt.token_ids, cut)[0]
            return None
        chunked, runs = self.parts(prompt.token_ids, cut)
        seq.chunk_plan = ChunkPlan(chunked, config)
        # Pinned before anything is created: a new entry's pages may come from evicting an
        # unpinned entry, which must not be one this request is about to borrow from.
        # Borrowing counts as a use for the LRU order too (matching by content does not).
        for run in runs:
            if run is not None:
                run.entry.pins += 1
                self.pool.get(run.entry.key, run.entry.token_ids)
        return chunked, runs, matched

    def _fusion_cut(
        self, token_ids: tuple[int, ...], config: ChunkConfig, offer: FusionOffer | None, fused: bool
    ) -> tuple[Plan | None, tuple[bool, ...]]:
        """Layout "fusion": the plan of the documents offered (matcher.fusion_documents) where the
        engine `fused` the request over them, and which were matched; else (fewer than two
        matched, streams that do not fit) a first sight's plan."""
        if offer is not None and fused:
            self.counters["fusion"] += 1
            self.counters["fusion_dropped_tokens"] += offer.documents.dropped
            return offer.documents.plan, offer.documents.matched
        self.counters["fusion_plain"] += 1
        return self.plan(token_ids, config, _NO_INDEX), ()

    def plan(
        self, token_ids: tuple[int, ...] | list[int], config: ChunkConfig, index: SpanIndex | None = None
    ) -> Plan | None:
        """How admission cuts a plain prompt now (matcher.plan on this pool, or on `index`); a
        prompt whose matches cover too little of its span is planned as a first sight (one gap,
        nothing borrowed)."""

        def system_end(lo: int, hi: int) -> int:
            # The shortest S already in the pool that the prompt extends (its documents' canonical
            # entries are keyed by it), else the whole shared prefix.
            for end in sorted({e.num_tokens for e in self.pool.entries() if e.kind == "system"}):
                if lo < end <= hi:
                    sys_ids = tuple(token_ids[:end])
                    key = system_hash(self.model_name, sys_ids, self.hash_algorithm)
                    if self.pool.has_key(key) and self.pool.get(key, (sys_ids,)) is not None:
                        return end
            return hi

        index = self.index if index is None else index
        cut = plan(token_ids, index, config.separator_free_min_tokens, config.max_chunks, system_end)
        if cut is None:
            return None
        reused = sum(b - a for a, b, run in cut.parts if run is not None)
        if 0 < reused < _MIN_REUSED_SHARE * (cut.q_start - cut.sys_end):
            # Too little to borrow to pay for computing the rest as chunks and blending: a first
            # sight (a plain prefill, stored afterwards) instead.
            cut = plan(token_ids, _NO_INDEX, config.separator_free_min_tokens, config.max_chunks)
        return cut

    def cut(self, token_ids: tuple[int, ...], config: ChunkConfig) -> Plan | None:
        """A plain prompt's plan: S, chunks (matched runs or gaps) and Q; None when there is
        nothing to reuse or learn, or when computing its gaps in paged blocks (should the pool
        refuse them) could not fit beside the prompt itself."""
        cut = self.plan(token_ids, config)
        if cut is None:
            return None
        # Under fusion the request holds its streams' blocks, not the prompt's: checked there.
        worst = 0 if config.layout == "fusion" else self.blocks.blocks_for(len(token_ids) + 1)
        worst += self.private_worst(cut)
        if worst > self.blocks.num_blocks or cut.q_start - cut.sys_end < config.blend_min_tokens:
            return None
        self.counters["cut"] += 1
        return cut

    def private_worst(self, cut: Plan) -> int:
        """KV blocks a plan's S and computed chunks take should the pool refuse them all."""
        gaps = [b - a for a, b, run in cut.parts if run is None]
        return self.blocks.blocks_for(cut.sys_end) + sum(self.blocks.blocks_for(g) for g in gaps)

    @staticmethod
    def parts(token_ids: tuple[int, ...], cut: Plan) -> tuple[ChunkedPrompt, list[Run | None]]:
        """A plan's S, chunks and Q as token ids, and each chunk's run (None: computed)."""
        prompt = ChunkedPrompt(
            tuple(token_ids[: cut.sys_end]),
            tuple(tuple(token_ids[a:b]) for a, b, _ in cut.parts),
            tuple(token_ids[cut.q_start :]),
        )
        return prompt, [run for _, _, run in cut.parts]

    def learn(
        self,
        seq: Sequence,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slots: Callable[[Entry], torch.Tensor],
        store: Callable[[Entry], None] | None,
    ) -> None:
        """Store the parts of a first-sight plain prompt (`seq.learn`) from its computed KV: S as a
        system entry and each gap as a chunk entry computed after S, as fill jobs would compute
        them (`slots`: an entry's KV slots; `store`: write one down to the tiers). Parts already
        in the pool, or that the pool cannot take now, are skipped."""
        prompt = seq.learn
        assert prompt is not None
        seq.learn = None
        sys_ids, algorithm = prompt.sys_token_ids, self.hash_algorithm
        device = kv_caches[0][0].device
        own = block_slots(seq.block_table, self.blocks.block_size, seq.num_own_prompt_tokens, device)
        parts = [(system_hash(self.model_name, sys_ids, algorithm), "system", (sys_ids,), 0)]
        at = len(sys_ids)
        for chunk in prompt.chunks:
            parts.append(
                (chunk_hash(self.model_name, sys_ids, chunk, algorithm), "chunk", (sys_ids, chunk), at)
            )
            at += len(chunk)
        for key, kind, token_ids, start in parts:
            n = len(token_ids[-1])
            entry = None if self.pool.has_key(key) else self.pool.create(key, kind, token_ids, n)
            if entry is None:
                continue
            dst, src = slots(entry), own[start : start + n]
            for k_cache, v_cache in kv_caches:
                k_cache[dst] = k_cache[src]
                v_cache[dst] = v_cache[src]
            if store is not None:  # written down as a fill job's entry is
                store(entry)
            self.pool.mark_ready(entry)
            if kind == "chunk":
                self.index.add(entry)
                self.counters["learned_tokens"] += n
