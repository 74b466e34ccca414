"""The chunk cache manager: match -> compute what is missing -> assemble.

A chunked request becomes a question sequence whose KV list is borrowed, in place, from pool
entries: [S | C1 | ... | Cn], followed by its own Q and output tokens at positions from
`s + max(len Ci)`. A missing entry is computed by a *fill job*: a prefill-only sequence whose own
pages are the entry's pool pages. S's job computes S at positions [0, s); a chunk's job borrows
S and computes Ci at [s, s + len Ci), so its KV depends on (S, Ci) only and is exactly what
chunk-isolated attention gives. Jobs run in the engine's continuous batch like any prefill; one
job per missing entry, however many requests wait for it.

An entry that cannot be cached (larger than the pool, a key collision, the pool pinned full) is
still computed: into paged KV blocks held by the one request that needs it.

With lower tiers (`tiers`, chunkcache/chunk/tiers/): a pool miss gets its pool pages and asks
them before computing, on a loader thread (the entry is *loading*; other requests' steps go on);
`poll()` collects finished loads between steps: a hit is copied into the entry's pages (promoted),
a miss becomes a fill job then. A newly computed entry is written down to the tiers at once
(write-through, in the background), and a pool eviction writes down what they do not hold yet
(demotion), so no computed entry is lost to an eviction. Whether an entry was cached for a
request (its reported cached tokens) is settled once all its entries are ready.

A plain prompt with separator-free matching on (chunk/matcher.py) is cut at admission
(chunk/separator_free.py; under layout "fusion" into exact documents) into the same parts: runs
found in existing entries are borrowed as slices of them (their KV was computed wherever the
entry was, so layout "offset" re-rotates it from there), and the gaps between them become new
chunk entries with fill jobs, as missing chunks do.

A run borrowed from inside an entry (or from an entry computed after another S) carries the
context it was learned in: the documents before it in the prompt it was first seen in. Such a
run is made *canonical*: a background fill job computes it as its own chunk entry right after
this request's S, keyed as a separator chunk with the same tokens would be, exactly the KV the
separator format gives. The request does not wait for it (it borrows the slice as it is); the
job runs only while no request is waiting or running, and registers its anchors once computed,
where the matcher prefers it (a run aligned with its entry's start) to the slice it replaces.
A request that needs such an entry before it is done promotes its job to an ordinary one.

Where it is: admission (matching, pinning, starting jobs and loads) in chunk/admission.py, the
registry of fill jobs in chunk/fill_jobs.py; this module keeps the manager, the engine's one
interface to the chunk cache, and what follows admission: a request's view of its entries laid
out once they are computed (chunk/assemble.py), release, the lower tiers' results, events and stats.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from chunkcache.chunk.admission import Admission, settle_cached
from chunkcache.chunk.assemble import assemble
from chunkcache.chunk.fill_jobs import FillJobs
from chunkcache.chunk.matcher import SpanIndex
from chunkcache.chunk.pool import ChunkPool
from chunkcache.chunk.separator_free import PlainCut, PlainPromptCutter
from chunkcache.chunk.tiers.pool_link import PoolTiers
from chunkcache.chunk.tiers.stack import TierStack
from chunkcache.config import ChunkConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.core.kv_slots import block_slots
from chunkcache.core.plan import ChunkedPrompt, Entry, PlainPrompt
from chunkcache.core.sequence import Sequence
from chunkcache.errors import InvalidRequestError, PromptTooLongError

logger = logging.getLogger(__name__)


class ChunkManager:
    """The chunk cache as the engine sees it: validate and admit requests, lay out what a sequence
    borrows once it is computed, release what it held, and report."""

    def __init__(
        self,
        config: ChunkConfig,
        model_name: str,
        blocks: BlockManager,
        pool: ChunkPool,
        device: torch.device,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        tiers: TierStack | None = None,
    ) -> None:
        self.config = config
        self.model_name = model_name
        self.blocks = blocks
        self.pool = pool
        self.device = device
        self.kv_caches = kv_caches or []
        self.tiers = tiers
        # Loads, write-through and demotion: the pool's pages <-> the tiers' copies.
        self.below = None if tiers is None else PoolTiers(tiers, pool, self.kv_caches, self._slots)
        self.fills = FillJobs(pool)
        self.index = SpanIndex(pool.holds)
        self.separator_free = {
            "requests": 0,
            "cut": 0,
            "matched_tokens": 0,
            "learned_tokens": 0,
            "canonical_jobs": 0,
            "canonical_tokens": 0,
            # Layout "fusion": prompts served as fusion requests over their documents; prompts
            # with matches that ran as a first sight instead (fewer than two documents matched,
            # or their streams did not fit); matched tokens computed anew after S (their KV was
            # not exact there); tokens between documents that no stream holds.
            "fusion": 0,
            "fusion_plain": 0,
            "fusion_computed_tokens": 0,
            "fusion_dropped_tokens": 0,
        }
        self.cutter = PlainPromptCutter(
            pool, self.index, blocks, model_name, config.hash_algorithm, self.separator_free
        )
        self.admission = Admission(
            config, model_name, pool, self.index, self.cutter, self.fills, self.below, self.separator_free
        )

    # ---- validation (any thread) -------------------------------------------------------------

    def validate(self, prompt: ChunkedPrompt, max_model_len: int, need_question: bool = True) -> None:
        if len(prompt.chunks) > self.config.max_chunks:
            raise InvalidRequestError(
                f"prompt has {len(prompt.chunks)} chunks, more than max_chunks {self.config.max_chunks}"
            )
        if need_question and not prompt.question_token_ids:
            raise InvalidRequestError("chunked prompt has an empty question after the last separator")
        s = len(prompt.sys_token_ids)
        for i, chunk in enumerate(prompt.chunks):
            if s + len(chunk) > max_model_len:
                raise PromptTooLongError(
                    f"chunk {i} is {len(chunk)} tokens long; with the system part ({s}) it exceeds "
                    f"max_model_len {max_model_len}"
                )
        paged = self.blocks.num_blocks * self.blocks.block_size
        for part in (prompt.sys_token_ids, *prompt.chunks):
            too_big_for_pool = self.pool.pages_for(len(part)) > self.pool.num_pages
            if too_big_for_pool and len(part) + len(prompt.question_token_ids) + 1 > paged:
                raise PromptTooLongError(
                    f"a chunk of {len(part)} tokens fits neither the chunk pool nor the KV cache"
                )

    # ---- engine thread -----------------------------------------------------------------------

    def propose(self, seq: Sequence) -> PlainCut | None:
        """Separator-free matching: how `seq`'s plain prompt would be cut on the pool now, and
        under layout "fusion" the documents it offers to fuse over, for the engine to decide on
        before `admit` (chunk/separator_free.py). None: `seq`'s prompt is chunked already."""
        assert seq.chunk_plan is not None, "propose() is for chunked requests"
        prompt = seq.chunk_plan.prompt
        if not isinstance(prompt, PlainPrompt):
            return None
        return self.cutter.propose(prompt, seq.chunk_plan.config)

    def admit(self, seq: Sequence, proposed: PlainCut | None = None, fused: bool = False) -> list[Sequence]:
        """Pin the request's entries (a plain prompt's as `proposed`, over the offered documents
        where the engine `fused` it); the fill jobs to schedule for the missing ones (admission.py)."""
        return self.admission.admit(seq, proposed, fused)

    # ---- lower tiers (engine thread) ---------------------------------------------------------

    def poll(self) -> tuple[list[Sequence], list[Sequence]]:
        """Settle the tier loads that ended: a hit (its KV already in its pages) is ready, a miss
        gets a fill job. Returns (new fill jobs, fill jobs nobody waits for any more)."""
        jobs: list[Sequence] = []
        cancel: list[Sequence] = []
        for entry, context, hit in [] if self.below is None else self.below.finished():
            if hit:
                self.pool.mark_ready(entry)
            elif entry.pins > 0:
                jobs.append(self.fills.start(entry, context.sys_entry, context.position_base))
            else:  # nobody waits for it any more
                self.pool.drop(entry)
            if entry.kind == "chunk":
                self.pool.stats.count(hit, entry.num_tokens)
            if context.sys_entry is not None:
                self._unpin(context.sys_entry, cancel)
        return jobs, cancel

    def wait_for_loads(self, timeout: float) -> None:
        """Sleep until a tier load ends (at most `timeout` s): for an engine with nothing else to run."""
        if self.below is not None:
            self.below.wait(timeout)

    @property
    def loads_pending(self) -> int:
        return 0 if self.below is None else len(self.below)

    def sensitivity_measured(self, entry: Entry) -> None:
        """`entry` has just measured its sensitivity (the runner does, engine/sensitivity.py): the
        tiers' copy, written when it was computed, is written again with it, so that a later load
        (after an eviction, a restart, on another replica) need not measure it again."""
        if self.below is not None and entry.ready and (entry.private or self.pool.holds(entry)):
            self.below.store(entry, replace=True)

    def learn(self, seq: Sequence, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store the parts of a first-sight plain prompt (`seq.learn`) from its computed KV
        (chunk/separator_free.py), each new entry written down to the tiers as a fill job's is."""
        self.cutter.learn(seq, kv_caches, self._slots, None if self.below is None else self.below.store)

    def lay_out(self, seq: Sequence) -> None:
        """Once the KV `seq` borrows is computed, lay out its view of it: a chunk job's S slots, a
        question's entries as its layout reads them (chunk/assemble.py). Nothing before, nothing
        twice. The engine calls it for every waiting sequence before it schedules (a sequence is
        ready to run when its view is laid out)."""
        if seq.fill is not None:
            sys_entry = seq.fill.sys_entry
            if sys_entry is not None and sys_entry.ready and seq.kv_list.borrowed_slots is None:
                seq.kv_list.borrowed_slots = self._slots(sys_entry)
            return
        state = seq.chunks
        if state is None or state.assembled or not all(e.ready for e in state.entries):
            return
        settle_cached(seq)
        parts = [self._slots(e)[a : a + n] for e, (a, n) in zip(state.entries, state.slices, strict=True)]
        assemble(seq, parts, self.device)

    def _slots(self, entry: Entry) -> torch.Tensor:
        return block_slots(entry.pages, self.pool.page_size, entry.num_tokens, self.device)

    def on_finish(self, seq: Sequence) -> list[Sequence]:
        """Release what a finished sequence held; returns fill jobs nobody waits for any more,
        for the engine to cancel (cancelling one releases its S in turn)."""
        cancel: list[Sequence] = []
        if seq.fill is not None:
            state = seq.fill
            self.fills.pop(state.entry)
            if seq.reply.finish_reason is None and seq.num_computed == seq.num_tokens:
                # A private entry (no room in the pool) is written down too: its pages are
                # paged KV blocks of the same size, read the same way.
                if self.below is not None:  # read before mark_ready can evict anything
                    self.below.store(state.entry)
                if state.entry.private:
                    state.entry.ready = True
                else:
                    self.pool.mark_ready(state.entry)
                if state.holds_entry:  # a canonical entry: found by content from now on
                    self.index.add(state.entry)
                    self.separator_free["canonical_tokens"] += state.entry.num_tokens
            if state.holds_entry:
                state.holds_entry = False
                self.fills.background_done(state.entry)
                self._unpin(state.entry, cancel)  # dropped if it never became ready
            if state.sys_entry is not None:
                self._unpin(state.sys_entry, cancel)
        elif seq.chunks is not None:
            for entry in seq.chunks.entries:
                self._unpin(entry, cancel)
            seq.chunks.entries = []
        return cancel

    def _unpin(self, entry: Entry, cancel: list[Sequence]) -> None:
        entry.pins -= 1
        if entry.pins > 0:
            return
        if entry.private and entry.pages:
            self.blocks.free(entry.pages)
            entry.pages = []
        if entry.loading:
            return  # its load settles it (poll): dropped on a miss, kept on a hit
        if not entry.ready:
            # Nobody waits for it any more: cancel its job, if it still runs, and forget it.
            job = self.fills.pop(entry)
            if job is not None:
                job.reply.finish_reason = "abort"
                cancel.append(job)
            if not entry.private and entry.pages:
                self.pool.drop(entry)

    def drain_events(self) -> list[Any]:
        events: list[Any]
        events, self.pool.events = self.pool.events, []
        if self.tiers is not None:
            events += self.tiers.drain_events()
        return events

    def state_events(self) -> list[Any]:
        """Every entry this engine can serve without computing: the pool's and the tiers'."""
        events: list[Any] = list(self.pool.state_events())
        if self.tiers is not None:
            events += self.tiers.state_events()
        return events

    def close(self) -> None:
        """Stop loading; finish the lower tiers' pending writes and close them."""
        if self.below is not None:
            self.below.close()

    def stats(self) -> dict[str, Any]:
        s = self.pool.stats
        lookups = s.hits + s.misses
        tokens = s.hit_tokens + s.miss_tokens
        return {
            "hits": s.hits,
            "misses": s.misses,
            "hit_rate": s.hits / lookups if lookups else 0.0,
            "hit_tokens": s.hit_tokens,
            "miss_tokens": s.miss_tokens,
            "token_hit_rate": s.hit_tokens / tokens if tokens else 0.0,
            "bytes": self.pool.used_bytes,
            "budget_bytes": self.pool.budget_bytes,
            "usage_ratio": self.pool.used_bytes / self.pool.budget_bytes if self.pool.budget_bytes else 0.0,
            "entries": len(self.pool),
            # Entries a request holds now (0 when idle: every request gives its pins back).
            "pinned_entries": sum(e.pins > 0 for e in self.pool.entries()),
            "evictions": s.evictions,
            "uncacheable": s.uncacheable,
            "jobs_running": len(self.fills),
            "tiers": self.tiers.stats() if self.tiers is not None else {},
            **{f"separator_free_{k}": v for k, v in self.separator_free.items()},
        }

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        for entry in self.pool.entries():
            assert entry.loading == (self.below is not None and entry in self.below), (
                "a loading entry without its load, or a load of an entry not marked loading"
            )
        self.index.check_integrity()
        self.fills.check_integrity()
