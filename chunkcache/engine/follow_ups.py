"""Follow-up questions on the same documents: read the prefix cache, not the pool.

A chunked request whose S and chunks, in this order, are in the prefix cache, as a plain prefill's
KV (`exact_prefix_reads`, on by default: a plain request's, a separator-free first sight's, an
`exact_follow_ups` job's) or (layout "offset") blended before under the same blend options
(its `kv_key` chain), reads that KV as a prefix (the scheduler matches the chain) and computes only
its question and the last chunk's tokens after its last full block: no pool entries, no blend.
Where the exact prefix is not cached and `exact_follow_ups` is on, a background job prefills it for
the next one, once the order has been seen `exact_follow_ups_sights` times (a request that read the
blended KV is a sight too).

Layout "fusion" (exact prefix only): a fusion request whose S and documents are so cached runs as
one plain prompt instead of its streams (`unfuse`, before any stream is scheduled or any entry
pinned), so its reply is the full prefill's, at a plain follow-up's cost. A separator-free request
that admission would make a fusion request (`fuse`) runs plain where the prompt before its
question is so cached: its token ids are a plain prompt's already, so the prefix cache serves it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from chunkcache.config import ChunkConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.core.plan import ChunkedPrompt
from chunkcache.core.sequence import Sequence, SequenceKind
from chunkcache.core.sequence_state import PrefixKeys
from chunkcache.engine.intake import ONE_DISCARDED_TOKEN, RequestIntake

_MAX_EXACT_JOBS = 64
# Orders (S and documents, one salt) seen fewer than `exact_follow_ups_sights` times, remembered
# by digest, least recently seen forgotten first.
_MAX_ORDERS_SEEN = 4096


class FollowUps:
    def __init__(
        self,
        config: ChunkConfig,
        blocks: BlockManager,
        generator: torch.Generator,
        intake: RequestIntake,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self._generator = generator
        # Makes a separator-free request a fusion request over its documents, and a fusion
        # request a plain one again (RequestIntake.fuse, .unfuse).
        self.intake = intake
        # Exact-prefix jobs queued since the engine last took them (`take_new_jobs`).
        self._new_jobs: list[Sequence] = []
        # Chunked requests that read an earlier request's blended KV from the prefix cache, or an
        # exact one; the exact-prefix jobs that finished, and those queued, by (salt, prompt).
        self.blended_prefix_hits = 0
        self.exact_prefix_hits = 0
        self.exact_prefix_jobs = 0
        self.jobs: dict[tuple[str | None, tuple[int, ...]], Sequence] = {}
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        # Without a prefix cache no exact prefix is registered, nor could a job's be read: both
        # options then do nothing (rather than prefill for no one). A job is only worth its
        # prefill where requests read what it leaves, so exact_follow_ups reads too.
        caching = blocks.enable_prefix_caching
        self._read = caching and (config.exact_prefix_reads or config.exact_follow_ups)
        self._queue_jobs = caching and config.exact_follow_ups

    def reads_cached_prefix(self, seq: Sequence) -> bool:
        """Whether `seq` reads its S and chunks from the prefix cache (it then runs as a plain
        prompt: its chunk plan is dropped, and under fusion its streams); queues the exact-prefix
        job where that is on and neither chain is cached."""
        plan = seq.chunk_plan
        if (
            seq.kind is SequenceKind.PREWARM
            or plan is None
            or not isinstance(plan.prompt, ChunkedPrompt)
            or plan.config.layout not in ("offset", "fusion")
        ):
            return False
        prompt = plan.prompt
        context = prompt.num_tokens - len(prompt.question_token_ids)  # S and the chunks
        need = context // self.blocks.block_size
        queue = self._queue_jobs and need > 0
        if self._read and need > 0 and self._exact_cached(seq, context):
            if seq.fusion is not None and not self.intake.unfuse(seq):
                return False  # its whole prompt does not fit as a plain one: its streams serve it
            seq.prefix_keys.make_plain()  # what it computes is exact too: plain blocks
            seq.fidelity = None  # no reuse configuration serves it: no shadow check of one
            self.exact_prefix_hits += 1
        elif (
            seq.prefix_keys.kv_key is not None
            and need > seq.prefix_keys.kv_key_from  # else no blended block: S and the first chunk fill them
            and self.blocks.cached_prefix_blocks(seq.token_ids, need, seq.prefix_keys.block_keys) >= need
        ):
            self.blended_prefix_hits += 1
            if queue:  # a repeat of its order is a sight too: else a chain hit never turns exact
                self._queue_exact_prefix(seq, seq.prompt_token_ids[:context])
        else:
            if queue:
                self._queue_exact_prefix(seq, seq.prompt_token_ids[:context])
            return False
        seq.chunk_plan = None
        seq.prefix_keys.cacheable = True
        return True

    def fuse(self, seq: Sequence, prompt: ChunkedPrompt, cfg: ChunkConfig, reserve: int) -> bool:
        """Whether to take the documents admission offers to fuse a separator-free request over
        (ChunkSteps.admit, layout "fusion"): False (the request runs as a plain prompt, prefix
        cache included) where the prompt before the question is cached exactly and exact prefixes
        are read; else the intake's answer, and where that makes a fusion request, with
        `exact_follow_ups`, the exact-prefix job for its follow-ups. The prefix is the prompt's own tokens
        before Q, not S and the documents joined: fusion's documents may drop a few tokens."""
        context = len(seq.prompt_token_ids) - len(prompt.question_token_ids)
        queue = self._queue_jobs and context >= self.blocks.block_size
        if self._read and context >= self.blocks.block_size and self._exact_cached(seq, context):
            seq.fidelity = None
            self.exact_prefix_hits += 1
            return False
        fused = self.intake.fuse(seq, prompt, cfg, reserve)
        if fused and queue:
            self._queue_exact_prefix(seq, seq.prompt_token_ids[:context])
        return fused

    def _exact_cached(self, seq: Sequence, context: int) -> bool:
        """Whether the full blocks of `seq`'s first `context` prompt tokens are in the prefix cache
        as a plain prefill's KV, under its salt."""
        need = context // self.blocks.block_size
        found = self.blocks.cached_prefix_blocks(seq.prompt_token_ids, need, seq.prefix_keys.plain_keys)
        return found >= need

    def _queue_exact_prefix(self, seq: Sequence, ids: list[int]) -> None:
        """A background job that prefills `ids` (the request's S and chunks, in this order, not in
        the prefix cache) as a plain prompt, so that its follow-ups find them. It runs on the budget
        requests leave and gives its blocks back when a request needs them (scheduler). Not where one is queued already; at most `_MAX_EXACT_JOBS` wait at once."""
        key = (seq.prefix_keys.cache_salt, tuple(ids))
        if key in self.jobs or len(self.jobs) >= _MAX_EXACT_JOBS or not self._seen_enough(key):
            return
        job = Sequence(
            request_id=f"exact-prefix-of-{seq.request_id}",  # never in the engine's requests: no output
            prompt_token_ids=list(ids),
            token_ids=list(ids),
            params=ONE_DISCARDED_TOKEN,
            kind=SequenceKind.PREFIX_JOB,
            prefix_keys=PrefixKeys(cache_salt=seq.prefix_keys.cache_salt),
        )
        job.reply.generator = self._generator
        self.jobs[key] = job
        self._new_jobs.append(job)

    def take_new_jobs(self) -> list[Sequence]:
        """The exact-prefix jobs queued since the last call, for the engine to schedule."""
        jobs, self._new_jobs = self._new_jobs, []
        return jobs

    def _seen_enough(self, key: tuple[str | None, tuple[int, ...]]) -> bool:
        """Count a sight of this order; whether it has now been seen `exact_follow_ups_sights`
        times (then forgotten: its job is queued, or a full queue drops it and counting starts
        again)."""
        need = self.config.exact_follow_ups_sights
        if need <= 1:
            return True
        digest = hashlib.blake2b(repr(key).encode(), digest_size=16).digest()
        sights = self._seen.pop(digest, 0) + 1
        if sights >= need:
            return True
        self._seen[digest] = sights
        if len(self._seen) > _MAX_ORDERS_SEEN:
            self._seen.popitem(last=False)
        return False

    def job_finished(self, job: Sequence) -> None:
        """An exact-prefix job ended: its blocks are registered, nothing else to keep."""
        self.jobs = {k: j for k, j in self.jobs.items() if j is not job}
        self.exact_prefix_jobs += job.reply.error is None
