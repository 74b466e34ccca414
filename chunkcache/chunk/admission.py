"""Admission of a chunked request: each part (S, then every chunk) matched in the pool and pinned,
a fill job started for each missing one, a tier load for each the lower tiers may hold. The
manager (chunk/manager.py) keeps what follows admission: readiness, release, the tiers' results.

A plain prompt is cut first (chunk/separator_free.py): a run borrowed from inside an entry lends
a slice of it, and one that was computed after another S is made canonical, as the manager's
docstring tells. Whether each entry was cached for the request is known at once for a hit or a
miss, and once its load ends for a loading one (`settle_cached`).
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkcache.chunk.fill_jobs import FillJobs
from chunkcache.chunk.matcher import Run, SpanIndex
from chunkcache.chunk.pool import ChunkPool
from chunkcache.chunk.separator_free import PlainCut, PlainPromptCutter
from chunkcache.chunk.tiers.pool_link import PoolTiers
from chunkcache.config import ChunkConfig
from chunkcache.core.plan import Entry, PlainPrompt, RequestChunks
from chunkcache.core.sequence import Sequence, SequenceKind
from chunkcache.core.sequence_state import BlendState
from chunkcache.hashing import chunk_hash, system_hash


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


def settle_cached(seq: Sequence) -> bool:
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
    seq.reuse.num_prefix_cached = state.slices[0][1] if state.was_cached[0] else 0
    seq.reuse.num_chunk_cached = sum(
        n for (_, n), c in zip(state.slices[1:], state.was_cached[1:], strict=True) if c
    )
    return True


@dataclass
class Admission:
    """Matches, pins and starts the computing of a request's entries (the engine thread's); its
    parts are the manager's."""

    config: ChunkConfig
    model_name: str
    pool: ChunkPool
    index: SpanIndex
    cutter: PlainPromptCutter
    fills: FillJobs
    below: PoolTiers | None
    separator_free: dict[str, int]  # the manager's counters (stats)

    def admit(self, seq: Sequence, proposed: PlainCut | None = None, fused: bool = False) -> list[Sequence]:
        """Match every part of the request; return the fill jobs to schedule for the missing ones.
        A plain prompt is served as `proposed` (ChunkManager.propose's cut); one that separator-free
        matching cannot cut leaves as a plain request; under layout "fusion" one whose matches
        make two or more documents runs over them where the engine `fused` it (its streams fit),
        else as a first sight."""
        assert seq.chunk_plan is not None, "admit() is for chunked requests"
        config, prompt = seq.chunk_plan.config, seq.chunk_plan.prompt
        runs: list[Run | None] | None = None
        matched: tuple[bool, ...] = ()
        if isinstance(prompt, PlainPrompt):
            assert proposed is not None, "a plain prompt is admitted as ChunkManager.propose cut it"
            cut = self.cutter.admit(seq, prompt, config, proposed, fused)
            if cut is None:
                return []
            prompt, runs, matched = cut
        state = RequestChunks(prompt)
        seq.chunks = state
        jobs: list[Sequence] = []
        sys_ids = prompt.sys_token_ids
        salt = seq.prefix_keys.cache_salt
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
                self.pool.stats.count(hit, len(chunk))
            state.entries.append(entry)
            state.was_cached.append(_cached_at_admission(entry, bool(hit)))
        settle_cached(seq)
        if config.layout == "offset":
            seq.blend = BlendState(config)  # own tokens: the whole prompt, at natural positions
        else:
            seq.kv_list.position_base = prompt.question_position()
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
        salt = seq.prefix_keys.cache_salt
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
        if (
            sys_entry.private  # its paged blocks would stay held until the engine is idle
            or self.pool.has_key(key)
            or not self.fills.room_for_background(len(chunk))
        ):
            return
        entry = self.pool.create(key, "chunk", (sys_ids, chunk), len(chunk))
        if entry is None:
            return
        entry.pins += 1  # the job's own: nobody else waits for it
        jobs.append(self.fills.start(entry, sys_entry, len(sys_ids), canonical=True))
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
        job = None if entry is None or entry.ready else self.fills.of(entry)
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
            jobs.append(self.fills.start(entry, sys_entry, position_base))
        entry.urgent = entry.urgent or urgent
        if not found and indexed and kind == "chunk" and not entry.private:
            self.index.add(entry)
        entry.pins += 1
        return entry, found
