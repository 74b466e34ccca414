"""Continuous batching with a token budget (vLLM V1 style).

Each step gives every running sequence its next tokens (one for a decode, a slice of the prompt
for a prefill, so long prompts are prefilled in chunks), then admits waiting sequences first come
first served while the budget, `max_num_seqs` and free KV blocks allow. A fusion request's
streams are one unit throughout: each gets the same number of tokens in the same step. When a running sequence
needs a block and none is free, the most recently admitted sequence is preempted: its blocks are
freed and it is recomputed later (its prefix-cached blocks usually survive).

Background sequences (a chunk cache's canonical entries, which no request waits for) get tokens
only in a step where no other sequence is waiting or running: they never share a batch with a
request, so they cost a request at most the one step it arrives during.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from chunkcache.config import SchedulerConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.core.sequence import Sequence, SequenceKind, Status

# Tokens per step of an exact-prefix job (idle work): bounds how long a request arriving during
# one waits for it: 32 tokens of SmolLM2 take ~0.13 s on one CPU thread (steps of 256 delayed the
# demo's second request by 0.6 s, of 64 by 0.27 s), milliseconds on a GPU.
BACKGROUND_STEP_TOKENS = 32


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


def _unit(seq: Sequence) -> list[Sequence]:
    """What is scheduled together with `seq`: a fusion request's streams (engine/fusion.py) are
    admitted, given tokens and preempted as one, so that they stay in step; else `seq` alone."""
    return seq.fusion.streams if seq.fusion is not None else [seq]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        is_ready: Callable[[Sequence], bool],
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.blocks = blocks
        # The chunk manager decides when a sequence's borrowed KV exists (fill jobs done).
        self.is_ready = is_ready
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = Status.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_background_work(self) -> bool:
        return any(s.kind.is_background for s in self.running) or any(
            s.kind.is_background for s in self.waiting
        )

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted_any = False
        foreground = any(not s.kind.is_background for s in self.running) or any(
            not s.kind.is_background for s in self.waiting
        )
        if foreground:
            # An exact-prefix job (engine._queue_exact_prefix) gives its KV blocks back when a
            # request comes: what it computed is in the prefix cache, where it resumes from.
            for seq in [s for s in self.running if s.kind is SequenceKind.PREFIX_JOB]:
                self.running.remove(seq)
                self._unadmit(seq)
                self.add(seq)
        done: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            if id(seq) in done:
                continue
            unit = _unit(seq)
            done.update(map(id, unit))
            n = 0 if seq.kind.is_background and foreground else self._num_new_tokens(seq, budget // len(unit))
            if n <= 0:
                continue
            if not self._grow_all(unit, seq.num_computed + n):
                # Free blocks by preempting from the back; possibly this very unit.
                while not self._grow_all(unit, seq.num_computed + n):
                    # Fill jobs hold pool pages, not blocks: preempting one frees nothing.
                    victim = next(s for s in reversed(self.running) if not s.kind.is_fill or s is seq)
                    for member in reversed(_unit(victim)):
                        self._preempt(member, batch)
                    preempted_any = True
                    if seq.status != Status.RUNNING:
                        break
                if seq.status != Status.RUNNING:
                    break
            self._add_to_batch(batch, unit, n)
            budget -= n * len(unit)
        if preempted_any:
            return batch
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            unit = _unit(seq)
            for member in unit[1:]:  # a group waits as a whole, its first stream first
                self.waiting.remove(member)
            if (seq.kind.is_background and foreground) or not self.is_ready(seq):
                skipped.extend(unit)
                continue
            # Only prefix-cacheable requests match the prefix cache: a chunked request's KV comes
            # from the chunk pool (an "offset" one has no borrowed slots, yet its blend must start
            # at 0) unless its blended prefix was found at admission (its `kv_key` chain), and
            # prompt logprobs need every prompt position computed.
            if (
                not seq.block_table
                and seq.num_computed == 0
                and seq.prefix_cacheable
                and not seq.kind.is_fill
                and seq.params.prompt_logprobs is None
            ):
                self._match_prefix(seq)
            n = self._num_new_tokens(seq, budget // len(unit))
            fits = n > 0 and len(self.running) + len(unit) <= self.max_num_seqs
            if not fits or not self._grow_all(unit, seq.num_computed + n):
                # A waiting sequence holds no blocks: the prefix blocks it just matched go back
                # (still cached), or a running sequence could starve for them while it waits.
                for member in reversed(unit):
                    self._unadmit(member)
                    self.waiting.appendleft(member)
                break
            for member in unit:
                member.status = Status.RUNNING
                if member.metrics.first_scheduled_time is None:
                    member.metrics.first_scheduled_time = time.time()
                self.running.append(member)
            if seq.fusion is not None and seq.fusion.request.metrics.first_scheduled_time is None:
                seq.fusion.request.metrics.first_scheduled_time = time.time()
            self._add_to_batch(batch, unit, n)
            budget -= n * len(unit)
        self.waiting.extendleft(reversed(skipped))
        return batch

    @staticmethod
    def _add_to_batch(batch: ScheduledBatch, unit: list[Sequence], n: int) -> None:
        for member in unit:
            batch.seqs.append(member)
            batch.num_new_tokens.append(n)

    def _grow_all(self, unit: list[Sequence], num_tokens: int) -> bool:
        return all(self._grow(member, num_tokens) for member in unit)

    @staticmethod
    def _num_new_tokens(seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed
        # A blend prefill cannot be split; it computes a small share of its tokens anyway.
        if seq.blend is not None and seq.num_computed == 0:
            return remaining
        if seq.kind is SequenceKind.PREFIX_JOB:
            # An exact-prefix job in short steps: a request arriving meanwhile waits one of them.
            return min(remaining, budget, BACKGROUND_STEP_TOKENS)
        return min(remaining, budget)

    def _match_prefix(self, seq: Sequence) -> None:
        # At least one prompt token is always computed: it yields the first token's logits.
        max_blocks = (seq.num_own_prompt_tokens - 1) // self.blocks.block_size
        blocks, hashes = self.blocks.match_prefix(seq.token_ids, max_blocks, seq.block_keys)
        seq.block_table = blocks
        seq.block_hashes = hashes
        seq.num_computed = len(blocks) * self.blocks.block_size
        seq.num_prefix_cached = seq.num_computed

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the sequence own enough blocks for `num_tokens` own tokens."""
        if seq.kind.is_fill:
            return True  # its pages were assigned when the job was made
        need = self.blocks.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.blocks.num_free_blocks:
            return False
        seq.block_table.extend(self.blocks.allocate(need))
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        if seq in batch.seqs:
            k = batch.seqs.index(seq)
            del batch.seqs[k], batch.num_new_tokens[k]
        self.release(seq)
        seq.num_computed = 0
        if seq.borrowed_slots is None:
            # Recomputed from scratch (a plain request, or an "offset" one whose blend is lost).
            seq.num_prefix_cached = 0
            seq.num_chunk_cached = 0
            seq.calibration = None  # the recomputed KV is exact
        seq.blend = None
        self.add(seq, front=True)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    def _unadmit(self, seq: Sequence) -> None:
        if seq.kind.is_fill:
            return  # a fill job's pages were assigned with the job, not taken here
        self.release(seq)
        seq.num_computed = 0
        if seq.borrowed_slots is None:
            seq.num_prefix_cached = 0

    def release(self, seq: Sequence) -> None:
        """Give back the blocks a sequence owns (finish, abort, preemption)."""
        if not seq.kind.is_fill and seq.block_table:
            self.blocks.free(seq.block_table)
        if not seq.kind.is_fill:
            seq.block_table = []
            seq.block_hashes = []

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        self.release(seq)
        seq.status = Status.FINISHED
