"""Fill jobs: the prefill-only sequences that compute a missing entry into its own pages (the
chunk manager's docstring tells how), and the one registry of them.

Apart from the manager because three of its paths meet here and nowhere else: admission starts a
job for an entry or joins the one already running (`of`), a finished or abandoned request's
release cancels a job nobody waits for any more (`pop`), and canonical entries' background jobs
may hold only a share of the pool (`room_for_background`), counted as they start and end.
"""

from __future__ import annotations

import itertools

from chunkcache.chunk.pool import ChunkPool
from chunkcache.core.plan import Entry, FillJob
from chunkcache.core.sequence import Sequence, SequenceKind
from chunkcache.core.sequence_state import KVList
from chunkcache.sampling import SamplingParams

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


class FillJobs:
    """The running fill jobs, by the entry each computes."""

    def __init__(self, pool: ChunkPool) -> None:
        self.pool = pool
        self._jobs: dict[int, Sequence] = {}  # id(entry) -> the fill job computing it
        self._ids = itertools.count()
        self.background_pages = 0  # pool pages held by canonical entries still being computed

    def __len__(self) -> int:
        return len(self._jobs)

    def start(
        self, entry: Entry, sys_entry: Entry | None, position_base: int, canonical: bool = False
    ) -> Sequence:
        """The job computing `entry`; a `canonical` one pins the entry itself (no request does)
        and counts its pages as background work until it ends (`background_done`)."""
        token_ids = list(entry.token_ids[-1])
        job = Sequence(
            request_id=f"fill-{next(self._ids)}",
            prompt_token_ids=token_ids,
            token_ids=list(token_ids),
            params=_FILL_PARAMS,
            kv_list=KVList(position_base=position_base),
            kind=_fill_kind(entry, canonical),
            block_table=entry.pages,
            fill=FillJob(entry, sys_entry, holds_entry=canonical),
        )
        if canonical:
            self.background_pages += self.pool.pages_for(entry.num_tokens)
        if sys_entry is not None:
            sys_entry.pins += 1
        self._jobs[id(entry)] = job
        return job

    def of(self, entry: Entry) -> Sequence | None:
        """The job computing `entry`, if one runs."""
        return self._jobs.get(id(entry))

    def pop(self, entry: Entry) -> Sequence | None:
        """Forget the job computing `entry` (it ended, or is to be cancelled); None if none runs."""
        return self._jobs.pop(id(entry), None)

    def room_for_background(self, num_tokens: int) -> bool:
        """Whether a canonical entry of `num_tokens` may start computing now."""
        need = self.pool.pages_for(num_tokens)
        return self.background_pages + need <= _MAX_BACKGROUND_SHARE * self.pool.num_pages

    def background_done(self, entry: Entry) -> None:
        self.background_pages -= self.pool.pages_for(entry.num_tokens)

    def check_integrity(self) -> None:
        background = 0
        for job in self._jobs.values():
            assert not job.is_finished, f"finished fill job {job.request_id} still tracked"
            assert job.fill is not None
            if job.fill.holds_entry:
                assert job.fill.entry.pins > 0, "a canonical entry's job does not pin it"
                background += self.pool.pages_for(job.fill.entry.num_tokens)
        assert background == self.background_pages, "background pages drifted"
