"""What the chunk cache adds to the engine's step, behind a few calls: admitting a chunked request
(pinning its entries, scheduling the fill jobs of missing ones, or reading its documents from
the prefix cache as a follow-up), turning tier loads that ended into fill jobs, finishing
prewarms once their entries are computed, and waiting for a load when nothing else can run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from chunkcache.chunk.admission import settle_cached
from chunkcache.chunk.manager import ChunkManager
from chunkcache.chunk.separator_free import Fuse
from chunkcache.config import ChunkConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.core.sequence import Sequence, SequenceKind
from chunkcache.engine.blend import needs_stored_scores
from chunkcache.engine.follow_ups import FollowUps
from chunkcache.engine.runner import ModelRunner

logger = logging.getLogger(__name__)

# A step with nothing runnable while chunk entries load from the tiers waits this long at most.
_LOAD_WAIT_S = 0.01


class ChunkSteps:
    def __init__(
        self,
        chunks: ChunkManager,
        config: ChunkConfig,
        blocks: BlockManager,
        runner: ModelRunner,
        generator: torch.Generator,
        schedule: Callable[[Sequence], None],
        start_job: Callable[[Sequence], None],
        finish: Callable[[Sequence], None],
        fuse: Fuse,
        unfuse: Callable[[Sequence], bool],
    ) -> None:
        self.chunks = chunks
        self.runner = runner
        # schedule: queue a sequence; start_job: track and queue a fill job (it has a request id
        # the engine answers aborts and failures for); finish: end a sequence (the engine's).
        self._start_job = start_job
        self._finish = finish
        # fuse: makes a separator-free request a fusion request over its documents; unfuse: a
        # fusion request a plain one (RequestIntake.fuse, .unfuse), both asked by the follow-ups.
        self.follow_ups = FollowUps(config, blocks, generator, schedule, fuse, unfuse)
        self._prewarms: list[Sequence] = []

    def admit(self, seq: Sequence) -> None:
        """A new sequence with a chunk plan: pin its entries and start the jobs of missing ones,
        unless it reads them from the prefix cache (a follow-up). Raises when admission fails."""
        if not self.follow_ups.reads_cached_prefix(seq):
            for job in self.chunks.admit(seq, self.follow_ups.fuse):
                self._start_job(job)
        if seq.kind is SequenceKind.PREWARM:
            self._prewarms.append(seq)

    def poll(self) -> None:
        """Chunk entries whose tier load ended: misses become fill jobs, started here; jobs
        nobody waits for any more end."""
        jobs, cancel = self.chunks.poll()
        for job in jobs:
            self._start_job(job)
        for job in cancel:
            self._finish(job)

    def wait_for_loads(self) -> None:
        """Nothing to run: sleep until a tier load ends (at most _LOAD_WAIT_S), not spin."""
        if self.chunks.loads_pending:
            self.chunks.wait_for_loads(_LOAD_WAIT_S)

    def finish_prewarms(self) -> list[Sequence]:
        """Finish the prewarm requests whose entries are all computed (failed or aborted ones
        were finished where that happened)."""
        done = []
        for seq in self._prewarms:
            assert seq.chunks is not None and seq.chunk_plan is not None, "admission pinned its entries"
            if seq.is_finished or not all(e.ready for e in seq.chunks.entries):
                continue
            settle_cached(seq)
            cfg = seq.chunk_plan.config
            if cfg.layout == "offset" and needs_stored_scores(cfg):
                # Warm means ready to rank by: the first request need not measure them.
                try:
                    self.runner.measure_sensitivity(seq.chunks.entries[1:])
                except Exception:  # the first request that ranks by them measures them then
                    logger.exception("measuring the sensitivity of prewarmed documents failed")
            seq.finish_reason = "stop"
            self._finish(seq)
            done.append(seq)
        self._prewarms = [s for s in self._prewarms if not s.is_finished]
        return done

    def waiting_for(self, jobs: list[Sequence], requests: Iterable[Sequence]) -> list[Sequence]:
        """The sequences among `requests` that borrow an entry one of these fill `jobs` computes."""
        entries = [job.fill.entry for job in jobs if job.fill is not None]
        return [
            seq
            for seq in requests
            if seq.chunks is not None and any(any(e is x for x in seq.chunks.entries) for e in entries)
        ]

    def on_finish(self, seq: Sequence) -> None:
        """Release what a finished sequence held; end the fill jobs nobody waits for any more."""
        if seq.kind is SequenceKind.PREFIX_JOB:
            self.follow_ups.job_finished(seq)
        for job in self.chunks.on_finish(seq):
            self._finish(job)
