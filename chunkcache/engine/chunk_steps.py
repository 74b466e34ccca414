"""What the chunk cache adds to the engine's step, behind a few calls: admitting a chunked request
(pinning its entries, or reading its documents from the prefix cache as a follow-up), turning
tier loads that ended into fill jobs, saying which prewarms are done, and waiting for a load when
nothing else can run.

Every call returns what the engine is to do next (jobs to start, jobs or prewarms to finish) and
the engine does it in `step()`'s order: nothing here calls back into the engine, so a request is
followed from `LLMEngine.step()` down and back by reading return values.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from chunkcache.chunk.admission import settle_cached
from chunkcache.chunk.manager import ChunkManager
from chunkcache.config import ChunkConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.core.sequence import Sequence, SequenceKind
from chunkcache.engine.blend import needs_stored_scores
from chunkcache.engine.follow_ups import FollowUps
from chunkcache.engine.intake import RequestIntake
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
        intake: RequestIntake,
    ) -> None:
        self.chunks = chunks
        self.runner = runner
        # The intake makes a separator-free request a fusion request, and a fusion request a
        # plain one again (RequestIntake.fuse, .unfuse): the follow-ups ask it at admission.
        self.follow_ups = FollowUps(config, blocks, generator, intake)
        self._prewarms: list[Sequence] = []

    def admit(self, seq: Sequence) -> list[Sequence]:
        """A new sequence with a chunk plan: pin its entries, unless it reads them from the
        prefix cache (a follow-up). Returns the jobs to start, in order: an exact-prefix job for
        its follow-ups, then the fill jobs of its missing entries. Raises when admission fails."""
        jobs = []
        if not self.follow_ups.reads_cached_prefix(seq):
            # A plain prompt is cut first; documents it offers to fuse over are fused here if its
            # streams fit (RequestIntake.fuse, by way of the follow-ups), then admitted as decided.
            proposed = self.chunks.propose(seq)
            offer = None if proposed is None else proposed.offer
            fused = offer is not None and self.follow_ups.fuse(seq, offer.prompt, offer.config, offer.reserve)
            jobs = self.chunks.admit(seq, proposed, fused)
        if seq.kind is SequenceKind.PREWARM:
            self._prewarms.append(seq)
        return [*self.follow_ups.take_new_jobs(), *jobs]

    def poll(self) -> tuple[list[Sequence], list[Sequence]]:
        """Chunk entries whose tier load ended: (fill jobs to start for the misses, fill jobs
        nobody waits for any more, to finish). An exact-prefix job queued by an admission that
        then failed is started here too."""
        jobs, cancel = self.chunks.poll()
        return [*self.follow_ups.take_new_jobs(), *jobs], cancel

    def lay_out(self, waiting: Iterable[Sequence]) -> None:
        """Before the scheduler picks: each waiting sequence whose borrowed KV is all computed now
        gets its view of it (ChunkManager.lay_out; a fusion stream its request's, then its own
        slots), so that the scheduler's readiness is a plain check of what is laid out."""
        for seq in waiting:
            if seq.fusion is not None:
                self.chunks.lay_out(seq.fusion.request)
                seq.fusion.give_slots()
            else:
                self.chunks.lay_out(seq)

    def wait_for_loads(self) -> None:
        """Nothing to run: sleep until a tier load ends (at most _LOAD_WAIT_S), not spin."""
        if self.chunks.loads_pending:
            self.chunks.wait_for_loads(_LOAD_WAIT_S)

    def prewarms_done(self) -> list[Sequence]:
        """The prewarm requests whose entries are all computed, their finish reason set, for the
        engine to finish (failed or aborted ones were finished where that happened)."""
        done: list[Sequence] = []
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
            seq.reply.finish_reason = "stop"
            done.append(seq)
        ended = {id(s) for s in done}
        self._prewarms = [s for s in self._prewarms if not s.is_finished and id(s) not in ended]
        return done

    def waiting_for(self, jobs: list[Sequence], requests: Iterable[Sequence]) -> list[Sequence]:
        """The sequences among `requests` that borrow an entry one of these fill `jobs` computes."""
        entries = [job.fill.entry for job in jobs if job.fill is not None]
        return [
            seq
            for seq in requests
            if seq.chunks is not None and any(any(e is x for x in seq.chunks.entries) for e in entries)
        ]

    def on_finish(self, seq: Sequence) -> list[Sequence]:
        """Release what a finished sequence held; returns the fill jobs nobody waits for any
        more, for the engine to finish."""
        if seq.kind is SequenceKind.PREFIX_JOB:
            self.follow_ups.job_finished(seq)
        return self.chunks.on_finish(seq)
