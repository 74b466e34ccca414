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
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from chunkcache.chunk.assemble import assemble
from chunkcache.chunk.matcher import Run, SpanIndex
from chunkcache.chunk.pool import ChunkPool
from chunkcache.chunk.separator_free import Fuse, PlainPromptCutter
from chunkcache.chunk.tiers.pool_link import PoolTiers
from chunkcache.chunk.tiers.stack import TierStack
from chunkcache.config import ChunkConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.core.kv_slots import block_slots
from chunkcache.core.plan import ChunkedPrompt, Entry, FillJob, PlainPrompt, RequestChunks
from chunkcache.core.sequence import Sequence, SequenceKind
from chunkcache.errors import InvalidRequestError, PromptTooLongError
from chunkcache.hashing import chunk_hash, system_hash
from chunkcache.sampling import SamplingParams

logger = logging.getLogger(__name__)
_FILL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)
# Pool pages that canonical entries still being computed may hold (pinned by their jobs): under
# steady load background jobs wait, and must not pin the whole pool meanwhile.
_MAX_BACKGROUND_SHARE = 0.25


def _fill_kind(entry: Entry, canonical: bool) -> SequenceKind:
    """Canonical entries and those only prewarms wait for are background work (they yield to
    requests, engine/scheduler.py); an entry a request waits for is an ordinary fill."""
    if canonical:
        return SequenceKind.CANONICAL_FILL
    return SequenceKind.CHUNK_FILL if entry.urgent else SequenceKind.PREWARM_FILL


@dataclass
class LoadContext:
    """What a pending tier load needs to become a fill job on a miss."""

    sys_entry: Entry | None  # pinned by the load until it ends
    position_base: int


def _cached_at_admission(entry: Entry, found: bool) -> bool | None:
    """Cached for a request arriving now: ready (a hit); unknown while loading; else computed."""
    if entry.loading:
        return None
    return found and entry.ready


class ChunkManager:
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
        self._jobs: dict[int, Sequence] = {}  # id(entry) -> the fill job computing it
        self._ids = itertools.count()
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
        self._background_pages = 0  # pool pages held by canonical entries still being computed
        self.cutter = PlainPromptCutter(
            pool, self.index, blocks, model_name, config.hash_algorithm, self.separator_free
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

    def admit(self, seq: Sequence, fuse: Fuse | None = None) -> list[Sequence]:
        """Match every part of the request; return the fill jobs to schedule for the missing ones.
        A plain prompt that separator-free matching cannot cut leaves as a plain request; under
        layout "fusion" one whose matches make two or more documents becomes a fusion request
        over them where `fuse` (the engine's) says its streams fit, else a first sight."""
        assert seq.chunk_plan is not None, "admit() is for chunked requests"
        config, prompt = seq.chunk_plan.config, seq.chunk_plan.prompt
        runs: list[Run | None] | None = None
        matched: tuple[bool, ...] = ()
        if isinstance(prompt, PlainPrompt):
            cut = self.cutter.admit(seq, prompt, config, fuse)
            if cut is None:
                return []
            prompt, runs, matched = cut
        state = RequestChunks(prompt)
        seq.chunks = state
        jobs: list[Sequence] = []
        sys_ids = prompt.sys_token_ids
        salt = seq.cache_salt
        sys_entry, _ = self._acquire(
            system_hash(self.model_name, sys_ids, self.config.hash_algorithm, salt),
            "system",
            (sys_ids,),
            len(sys_ids),
            jobs,
            None,
            0,
            urgent=seq.kind is not SequenceKind.PREWARM,
        )
        state.entries.append(sys_entry)
        state.slices.append((0, len(sys_ids)))
        state.was_cached.append(_cached_at_admission(sys_entry, True))
        for i, chunk in enumerate(prompt.chunks):
            run = runs[i] if runs is not None else None
            entry, hit = self._admit_chunk(seq, sys_entry, chunk, run, jobs)
            if runs is not None and run is None and hit is False:
                # Fusion: a matched run whose KV was not exact after S is computed anew.
                counter = "fusion_computed_tokens" if matched and matched[i] else "learned_tokens"
                self.separator_free[counter] += len(chunk)
            if hit is not None:  # a load's hit or miss is counted when it ends
                self._count(hit, len(chunk))
            state.entries.append(entry)
            state.was_cached.append(_cached_at_admission(entry, bool(hit)))
        self.settle_cached(seq)
        if config.layout == "offset":
            seq.blend = config  # own tokens: the whole prompt, at natural positions
        else:
            seq.position_base = prompt.question_position()
        return jobs

    def _admit_chunk(
        self, seq: Sequence, sys_entry: Entry, chunk: tuple[int, ...], run: Run | None, jobs: list[Sequence]
    ) -> tuple[Entry, bool | None]:
        """One chunk's entry, pinned, and its slice appended to `seq`'s chunks; whether it was found
        (`_acquire`). A separator-free `run` lends a slice of the entry it was found in."""
        state = seq.chunks
        assert state is not None
        sys_ids = state.prompt.sys_token_ids
        if run is not None:  # pinned when it was matched
            state.slices.append((run.entry_start, run.length))
            self.separator_free["matched_tokens"] += run.length
            if not run.computed_after(sys_ids):
                self._canonicalize(sys_ids, chunk, sys_entry, jobs)
            return run.entry, True
        salt = seq.cache_salt
        key = chunk_hash(self.model_name, sys_ids, chunk, self.config.hash_algorithm, salt)
        state.slices.append((0, len(chunk)))
        # Salted entries stay out of the index: it is shared by content, across tenants.
        return self._acquire(
            key,
            "chunk",
            (sys_ids, chunk),
            len(chunk),
            jobs,
            sys_entry,
            len(sys_ids),
            indexed=salt is None,
            urgent=seq.kind is not SequenceKind.PREWARM,
        )

    def _canonicalize(
        self, sys_ids: tuple[int, ...], chunk: tuple[int, ...], sys_entry: Entry, jobs: list[Sequence]
    ) -> None:
        """Start a background fill job computing `chunk` as its own entry right after `sys_ids`
        (as a separator chunk), unless that entry exists or the pool has no room for it now."""
        key = chunk_hash(self.model_name, sys_ids, chunk, self.config.hash_algorithm)
        need = self.pool.pages_for(len(chunk))
        if (
            sys_entry.private  # its paged blocks would stay held until the engine is idle
            or self.pool.has_key(key)
            or self._background_pages + need > _MAX_BACKGROUND_SHARE * self.pool.num_pages
        ):
            return
        entry = self.pool.create(key, "chunk", (sys_ids, chunk), len(chunk))
        if entry is None:
            return
        entry.pins += 1  # the job's own: nobody else waits for it
        self._background_pages += need
        jobs.append(self._fill_job(entry, sys_entry, len(sys_ids), canonical=True))
        self.separator_free["canonical_jobs"] += 1

    def _acquire(
        self,
        key: bytes,
        kind: str,
        token_ids: tuple[tuple[int, ...], ...],
        num_tokens: int,
        jobs: list[Sequence],
        sys_entry: Entry | None,
        position_base: int,
        indexed: bool = False,
        urgent: bool = True,
    ) -> tuple[Entry, bool | None]:
        """A pinned entry for `key`, and whether it was found in the pool (ready, being computed
        or being loaded); None when it is being loaded for this request (found or not is known
        when the load ends). A new entry comes with a fill job appended to `jobs`: background
        work unless some `urgent` acquirer (a request, not a prewarm) waits for it. A new
        `indexed` chunk entry of the pool registers its anchors for separator-free matching."""
        entry = self.pool.get(key, token_ids)
        found: bool | None = entry is not None
        job = None if entry is None or entry.ready else self._jobs.get(id(entry))
        if job is not None and entry is not None and urgent:
            entry.urgent = True
            if job.kind.is_background:  # a request waits for it now: an ordinary fill job
                job.kind = SequenceKind.CHUNK_FILL
        if entry is None and self.below is not None:
            # Pages first: an entry that cannot enter the pool is computed privately, not loaded.
            entry = self.pool.create(key, kind, token_ids, num_tokens)
            if entry is not None:
                if sys_entry is not None:
                    sys_entry.pins += 1
                self.below.load(entry, token_ids, LoadContext(sys_entry, position_base))
                found = None
        if entry is None:
            entry = self.pool.create(key, kind, token_ids, num_tokens)
            if entry is None:
                self.pool.stats.uncacheable += 1
                entry = Entry(key, kind, token_ids, num_tokens, private=True)
            entry.urgent = urgent
            jobs.append(self._fill_job(entry, sys_entry, position_base))
        entry.urgent = entry.urgent or urgent
        if not found and indexed and kind == "chunk" and not entry.private:
            self.index.add(entry)
        entry.pins += 1
        return entry, found

    def _fill_job(
        self, entry: Entry, sys_entry: Entry | None, position_base: int, canonical: bool = False
    ) -> Sequence:
        """The job computing `entry`; a `canonical` one pins the entry itself (no request does)."""
        token_ids = list(entry.token_ids[-1])
        job = Sequence(
            request_id=f"fill-{next(self._ids)}",
            prompt_token_ids=token_ids,
            token_ids=list(token_ids),
            params=_FILL_PARAMS,
            position_base=position_base,
            kind=_fill_kind(entry, canonical),
            block_table=entry.pages,
            fill=FillJob(entry, sys_entry, holds_entry=canonical),
        )
        if sys_entry is not None:
            sys_entry.pins += 1
        self._jobs[id(entry)] = job
        return job

    def _count(self, hit: bool, num_tokens: int) -> None:
        if hit:
            self.pool.stats.hits += 1
            self.pool.stats.hit_tokens += num_tokens
        else:
            self.pool.stats.misses += 1
            self.pool.stats.miss_tokens += num_tokens

    def settle_cached(self, seq: Sequence) -> bool:
        """Once no entry of `seq` is loading: settle which were cached and its cached-token counts
        (S's as prefix-cached, the chunks' as chunk-cached); False while a load is pending."""
        state = seq.chunks
        assert state is not None
        if any(e.loading for e in state.entries):
            return False
        state.was_cached = [
            e.from_tier if c is None else c for c, e in zip(state.was_cached, state.entries, strict=True)
        ]
        # Counted by the slice each entry lends (a separator-free match borrows part of one).
        seq.num_prefix_cached = state.slices[0][1] if state.was_cached[0] else 0
        seq.num_chunk_cached = sum(
            n for (_, n), c in zip(state.slices[1:], state.was_cached[1:], strict=True) if c
        )
        return True

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
                jobs.append(self._fill_job(entry, context.sys_entry, context.position_base))
            else:  # nobody waits for it any more
                self.pool.drop(entry)
            if entry.kind == "chunk":
                self._count(hit, entry.num_tokens)
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

    def is_ready(self, seq: Sequence) -> bool:
        """Whether the scheduler may run `seq`: a job needs its S computed (and private pages), a
        question needs every entry computed, and its view of them is laid out then (chunk/assemble.py)."""
        if seq.fill is not None:
            state = seq.fill
            if state.sys_entry is not None and not state.sys_entry.ready:
                return False
            if state.entry.private and not state.entry.pages:
                need = self.blocks.blocks_for(state.entry.num_tokens)
                if need > self.blocks.num_free_blocks:
                    return False
                state.entry.pages = self.blocks.allocate(need)
                seq.block_table = state.entry.pages
            if state.sys_entry is not None and seq.borrowed_slots is None:
                seq.borrowed_slots = self._slots(state.sys_entry)
            return True
        if seq.chunks is not None:
            state = seq.chunks
            if not all(e.ready for e in state.entries):
                return False
            if not state.assembled:
                self.settle_cached(seq)
                parts = [
                    self._slots(e)[a : a + n] for e, (a, n) in zip(state.entries, state.slices, strict=True)
                ]
                assemble(seq, parts, self.device)
        return True

    def _slots(self, entry: Entry) -> torch.Tensor:
        return block_slots(entry.pages, self.pool.page_size, entry.num_tokens, self.device)

    def on_finish(self, seq: Sequence) -> list[Sequence]:
        """Release what a finished sequence held; returns fill jobs nobody waits for any more,
        for the engine to cancel (cancelling one releases its S in turn)."""
        cancel: list[Sequence] = []
        if seq.fill is not None:
            state = seq.fill
            self._jobs.pop(id(state.entry), None)
            if seq.finish_reason is None and seq.num_computed == seq.num_tokens:
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
                self._background_pages -= self.pool.pages_for(state.entry.num_tokens)
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
            job = self._jobs.pop(id(entry), None)
            if job is not None:
                job.finish_reason = "abort"
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
            "evictions": s.evictions,
            "uncacheable": s.uncacheable,
            "jobs_running": len(self._jobs),
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
        background = 0
        for job in self._jobs.values():
            assert not job.is_finished, f"finished fill job {job.request_id} still tracked"
            assert job.fill is not None
            if job.fill.holds_entry:
                assert job.fill.entry.pins > 0, "a canonical entry's job does not pin it"
                background += self.pool.pages_for(job.fill.entry.num_tokens)
        assert background == self._background_pages, "background pages drifted"
