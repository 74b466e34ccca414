"""Continuous batching under one token budget per step, shared in order of urgency.

Every step spends at most `max_num_batched_tokens` tokens (vLLM V1's chunked prefill), in this
order: (1) running decodes, one token each; (2) waiting short prompts (at most
`long_prefill_token_threshold` tokens left), whole; (3) long prefills, in pieces of at most
`long_prefill_token_threshold`, the oldest `max_long_partial_prefills` only (one by default), and
waiting long prompts first come first served as those end (so that requests arriving together end
their prefills one after another, not all near the last one's end). A fusion request's first
step (its streams' questions) is short or long by its own tokens; a joint stream, chosen after it,
is then a long prefill of the request, which keeps its place (a running unit: older than any
waiting one). Counting the joint stream's possible tokens from the start, as session 48 did, made
every fusion request a long prefill, served one at a time and held back by the decode guard, though
most never join one: at 8 users over cached documents, none joining, the median first token
waited 0.93 s and the slowest 6.5 s (bench_serve, RESULTS.md);
(4) background work (canonical chunk entries, exact-prefix jobs, a prewarm's fill jobs, shadow
checks: work no request waits for) gets what is left, in pieces of the same size, only in steps
where no request prefills (on a CPU a piece's time adds to the step's, so a request that shared
its prefill steps with background work paid for it in its first token: a 1.5B request queueing
an exact-prefix job paid nearly the whole job, RESULTS.md), and at most one piece's worth a step,
beside decodes or alone (so that it makes a step no longer than a long prefill does, and a request
arriving while it runs waits for one piece at most).
So no request waits behind another's prefill for more than one step: a short prompt is admitted
in the step after it arrives, and a running stream gets its token every step. While streams
decode, long prefills and background work join a step only if the streams keep
`min_decode_share` of their decode-only rate (engine/decode_guard.py): on a CPU, where a piece
costs many decode steps, the streams are not slowed to a crawl. Background work that got nothing for
`BACKGROUND_MAX_WAIT_STEPS` steps in a row gets `BACKGROUND_STEP_TOKENS` before anything else in
the next one, so steady load slows it but never starves it.

A fusion request's streams are one unit throughout: admitted, preempted and finished together,
their prompts ending in the same step (a pair stream's extra document first: the others wait) and
each then decoding one token per step; a unit is short or long by its members' tokens together,
and takes at most one piece's worth of them per step. A blend prefill is split by layers
(engine/blend.py's `BlendRun`): a piece runs as many of its layers as one piece's worth of tokens
holds (engine/pieces.py sizes every piece). When a running request
needs a block and none is free, background work yields first, then the most recently
admitted sequence: its blocks are freed and it is recomputed later (its prefix-cached blocks
usually survive). Background work gives its blocks back instead (a yield, not a preemption), also
to a waiting request that finds no free block; an exact-prefix job resumes from the prefix cache.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from chunkcache.config import SchedulerConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.core.sequence import Sequence, Status
from chunkcache.engine.decode_guard import DecodeGuard
from chunkcache.engine.pieces import Piece, piece_for, remaining, unit_of, unit_remaining, units

# Tokens background work is guaranteed in a step once it has waited BACKGROUND_MAX_WAIT_STEPS
# steps in a row: a request pays at most this for it (32 tokens of SmolLM2: ~0.13 s on one CPU
# thread, milliseconds on a GPU), and a saturated engine still finishes its prewarms.
BACKGROUND_STEP_TOKENS = 32
BACKGROUND_MAX_WAIT_STEPS = 8


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    # Own tokens whose KV each has after this step (a blend's, all of them in its last piece).
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    budget: int = 0  # tokens this step may still take
    has_long: bool = False  # whether a piece of a long prefill runs in this step
    decodes: int = 0  # sequences given their one next token in the decode pass
    # Blends that run only some of their layers in this step (0 new tokens): id(seq) -> the layer
    # they stop before (engine/blend.py's BlendRun).
    blend_layers: dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.seqs)

    def describe(self) -> str:
        """One line for the step trace (DEBUG): what ran, by kind, and the tokens computed."""
        prefills = [(s, n) for s, n in zip(self.seqs, self.num_new_tokens, strict=True) if n > 1]
        background = sum(n for s, n in prefills if s.kind.is_background)
        requests = {
            s.fusion.request.request_id if s.fusion else s.request_id
            for s, _ in prefills
            if not s.kind.is_background
        }
        return (
            f"{len(self.seqs)} sequences, {self.decodes} decodes, {sum(self.num_new_tokens)} tokens "
            f"({sum(n for _, n in prefills) - background} prefill of {len(requests)} requests, "
            f"{background} background), {len(self.blend_layers)} blend pieces, "
            f"{len(self.preempted)} preempted, long {self.has_long}"
        )

    def add(self, unit: list[Sequence], piece: Piece, long: bool) -> None:
        for member, n in zip(unit, piece.counts, strict=True):
            if n > 0:  # a stream waiting for its pair stream's document sits this step out
                self.seqs.append(member)
                self.num_new_tokens.append(n if piece.layers is None else 0)
                if piece.layers is not None:
                    self.blend_layers[id(member)] = piece.layers
        self.budget -= piece.cost
        self.has_long = self.has_long or long


def _is_decode(seq: Sequence) -> bool:
    return not seq.kind.is_background and remaining(seq) == 1


def _is_ready(seq: Sequence) -> bool:
    """Whether the KV `seq` borrows is computed and its view laid out (the engine lays it out
    before each schedule, ChunkSteps.lay_out): a fusion stream's slots given, a chunk job's S
    computed, a question's view assembled. A plain check: it changes nothing."""
    if seq.fusion is not None:
        return seq.fusion.slots_given
    if seq.fill is not None:
        return seq.fill.sys_entry is None or seq.fill.sys_entry.ready
    return seq.chunks is None or seq.chunks.assembled


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        num_layers: int = 1,
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.max_long_partial_prefills = config.max_long_partial_prefills
        self.blocks = blocks
        self.num_layers = num_layers  # of the model: what a layer of a blend costs (engine/pieces.py)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._background_waited = 0  # steps in a row in which queued background work got nothing
        self.decode_guard = DecodeGuard(config.min_decode_share)

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
        batch = ScheduledBatch(budget=self.max_num_batched_tokens)
        short = self.long_prefill_token_threshold
        background = self.has_background_work()
        if background and self._background_waited >= BACKGROUND_MAX_WAIT_STEPS:
            self._serve_background(batch, BACKGROUND_STEP_TOKENS)
        reserved = len(batch.seqs)  # background work served first, if it was starving
        self._serve_running(batch, _is_decode)
        batch.decodes = len(batch.seqs) - reserved
        if not batch.preempted:
            self._admit(batch, lambda s: not s.kind.is_background and not self._is_long(s))
        # Long prefills and background work wait while running streams fall behind (decode_guard).
        if not batch.preempted and self.decode_guard.allows_prefill(batch.decodes > 0):
            oldest = {id(u[0]) for u in self._long_running()[: self.max_long_partial_prefills]}
            self._serve_running(batch, lambda s: not s.kind.is_background and self._may_go_on(s, oldest))
        if not batch.preempted and self.decode_guard.allows_prefill(batch.decodes > 0):
            self._admit(batch, lambda s: not s.kind.is_background and self._may_start(s))
            # Beside a request's prefill nothing (but the floor above): its first token never
            # waits for work nobody waits for. Else one piece, alone too: a step is not cut short
            # when a request arrives, so it waits for the step under way, and a step of the whole
            # budget of exact-prefix jobs (~3 s on the 1.5B) made a repeat's first token 1.8 s
            # later (bench_burst, RESULTS.md).
            prefilling = any(not s.kind.is_background for s in batch.seqs[reserved + batch.decodes :])
            if not prefilling:
                self._serve_background(batch, short)
        got = any(s.kind.is_background for s in batch.seqs)
        self._background_waited = 0 if got or not background else self._background_waited + 1
        return batch

    def step_took(self, batch: ScheduledBatch, seconds: float) -> None:
        """The engine ran `batch` in `seconds` (what the decode guard measures)."""
        guarded = batch.has_long or any(s.kind.is_background for s in batch.seqs)
        self.decode_guard.record(batch.decodes > 0, batch.decodes == len(batch.seqs), guarded, seconds)

    def _serve_running(self, batch: ScheduledBatch, wanted: Callable[[Sequence], bool]) -> None:
        """Give the running units `wanted` picks their next tokens (a preemption ends the pass)."""
        for unit in units(self.running):
            seq = unit[0]
            if batch.budget <= 0 or batch.preempted:
                return
            if seq.status != Status.RUNNING or seq in batch.seqs or not wanted(seq):
                continue
            piece = self._piece(unit, batch)
            long = self._is_long(seq)
            if piece.cost > 0 and self._grow_or_preempt(unit, piece.counts, batch):
                batch.add(unit, piece, long)

    def _admit(self, batch: ScheduledBatch, wanted: Callable[[Sequence], bool]) -> None:
        """Admit the waiting units `wanted` picks, first come first served, while the budget,
        `max_num_seqs` and free blocks allow."""
        for unit in units(list(self.waiting)):
            seq = unit[0]
            if batch.budget <= 0 or len(self.running) + len(unit) > self.max_num_seqs:
                return
            if not wanted(seq) or not _is_ready(seq) or not self._take_entry_pages(seq):
                continue
            self._match_prefix(seq)
            piece = self._piece(unit, batch)
            n = piece.cost
            long = self._is_long(seq)
            if n <= 0 or not self._grow_for_admission(unit, piece.counts, batch):
                # A waiting sequence holds no blocks: the prefix blocks it just matched go back
                # (still cached), or a running sequence could starve for them while it waits.
                for member in unit:
                    self._unadmit(member)
                if n > 0:
                    return  # no blocks: those behind it wait too
                continue
            for member in unit:
                self.waiting.remove(member)
                member.status = Status.RUNNING
                if member.metrics.first_scheduled_time is None:
                    member.metrics.first_scheduled_time = time.time()
                self.running.append(member)
            if seq.fusion is not None and seq.fusion.request.metrics.first_scheduled_time is None:
                seq.fusion.request.metrics.first_scheduled_time = time.time()
            batch.add(unit, piece, long)

    def _is_long(self, seq: Sequence) -> bool:
        """Whether `seq`'s unit is a long prefill: more than a piece of tokens left (a fusion
        request's streams together; its joint stream, once chosen, is its own work left)."""
        return unit_remaining(seq) > self.long_prefill_token_threshold

    def _limited(self, seq: Sequence) -> bool:
        """Whether `seq`'s unit is a long prefill of a request (`max_long_partial_prefills`). The
        fill jobs a request waits for are not: they are all its prefill, and run together."""
        return not seq.kind.is_background and not seq.kind.is_fill and self._is_long(seq)

    def _long_running(self) -> list[list[Sequence]]:
        """The running requests' long prefills, oldest first: the first
        `max_long_partial_prefills` of them get pieces, and no other starts while they run."""
        return [u for u in units(self.running) if self._limited(u[0])]

    def _may_go_on(self, seq: Sequence, oldest: set[int]) -> bool:
        return not self._limited(seq) or id(seq) in oldest

    def _may_start(self, seq: Sequence) -> bool:
        return not self._limited(seq) or len(self._long_running()) < self.max_long_partial_prefills

    def _serve_background(self, batch: ScheduledBatch, tokens: int) -> None:
        """Running, then waiting, background work, within `tokens` of the budget left."""
        held_back = max(0, batch.budget - tokens)
        batch.budget -= held_back
        self._serve_running(batch, lambda s: s.kind.is_background)
        if not batch.preempted:
            self._admit(batch, lambda s: s.kind.is_background)
        batch.budget += held_back

    def _grow_or_preempt(self, unit: list[Sequence], counts: list[int], batch: ScheduledBatch) -> bool:
        """Blocks for a running unit. Background work yields its own blocks; a request's come
        from background work first, else from preempting the most recently admitted request
        (possibly this very unit: then False)."""
        seq = unit[0]
        while not self._grow_all(unit, counts):
            if seq.kind.is_background:
                self._yield(seq, batch)
                return False
            # Fill jobs hold pool pages, not blocks: preempting one frees nothing.
            victims = [s for s in reversed(self.running) if not s.kind.is_fill or s is seq]
            job = next((s for s in victims if s.kind.is_background), None)
            if job is not None:
                self._yield(job, batch)
                continue
            for member in reversed(unit_of(victims[0])):
                self._preempt(member, batch)
            if seq.status != Status.RUNNING:
                return False
        return True

    def _grow_for_admission(self, unit: list[Sequence], counts: list[int], batch: ScheduledBatch) -> bool:
        """Blocks for a waiting unit; a request takes those of running background work."""
        while not self._grow_all(unit, counts):
            jobs = [s for s in reversed(self.running) if s.kind.yields_blocks]
            if unit[0].kind.is_background or not jobs:
                return False
            self._yield(jobs[0], batch)
        return True

    def _yield(self, job: Sequence, batch: ScheduledBatch) -> None:
        """Background work gives its blocks back and waits at the back (not a preemption: an
        exact-prefix job resumes from what it left in the prefix cache)."""
        self.running.remove(job)
        if job in batch.seqs:
            k = batch.seqs.index(job)
            batch.budget += batch.num_new_tokens[k]
            del batch.seqs[k], batch.num_new_tokens[k]
        self._unadmit(job)
        self.add(job)

    def _grow_all(self, unit: list[Sequence], counts: list[int]) -> bool:
        return all(self._grow(m, m.num_computed + n) for m, n in zip(unit, counts, strict=True))

    def _piece(self, unit: list[Sequence], batch: ScheduledBatch) -> Piece:
        return piece_for(
            unit, batch.budget, self.long_prefill_token_threshold, self.num_layers, batch.has_long
        )

    def _match_prefix(self, seq: Sequence) -> None:
        """Start a new sequence from its blocks in the prefix cache. Only prefix-cacheable
        requests match it: a chunked request's KV comes from the chunk pool (an "offset" one has
        no borrowed slots, yet its blend must start at 0) unless its blended prefix was found at
        admission (its `kv_key` chain), and prompt logprobs need every prompt position computed."""
        if (
            seq.block_table
            or seq.num_computed
            or not seq.prefix_keys.cacheable
            or seq.kind.is_fill
            or seq.params.prompt_logprobs is not None
        ):
            return
        # At least one prompt token is always computed: it yields the first token's logits.
        max_blocks = (seq.num_own_prompt_tokens - 1) // self.blocks.block_size
        blocks, hashes = self.blocks.match_prefix(seq.token_ids, max_blocks, seq.prefix_keys.block_keys)
        seq.block_table = blocks
        seq.block_hashes = hashes
        seq.num_computed = len(blocks) * self.blocks.block_size
        seq.reuse.num_prefix_cached = seq.num_computed

    def _take_entry_pages(self, seq: Sequence) -> bool:
        """A fill job of a private entry (one the pool could not take) computes it into KV blocks,
        taken as it is admitted (False: not enough free now) and held by the entry until its
        last reader lets go of it (chunk/manager.py). Other sequences take nothing here."""
        entry = None if seq.fill is None else seq.fill.entry
        if entry is None or not entry.private or entry.pages:
            return True
        need = self.blocks.blocks_for(entry.num_tokens)
        if need > self.blocks.num_free_blocks:
            return False
        entry.pages = self.blocks.allocate(need)
        seq.block_table = entry.pages
        return True

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

    def join(self, seq: Sequence) -> None:
        """A stream added to a running fusion group (its pair stream): it runs with the group."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        if seq.fusion is not None:  # recomputed, its streams will all yield their first rows again
            seq.fusion.first_rows = None
        if seq in batch.seqs:
            k = batch.seqs.index(seq)
            del batch.seqs[k], batch.num_new_tokens[k]
        self.release(seq)
        seq.num_computed = 0
        if seq.kv_list.borrowed_slots is None:
            # Recomputed from scratch (a plain request, or an "offset" one whose blend is lost).
            seq.reuse.num_prefix_cached = 0
            seq.reuse.num_chunk_cached = 0
            seq.kv_list.calibration = None  # the recomputed KV is exact
        seq.blend = None
        self.add(seq, front=True)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    def _unadmit(self, seq: Sequence) -> None:
        if seq.kind.is_fill:
            return  # a fill job's pages were assigned with the job, not taken here
        self.release(seq)
        seq.num_computed = 0
        if seq.kv_list.borrowed_slots is None:
            seq.reuse.num_prefix_cached = 0

    def release(self, seq: Sequence) -> None:
        """Give back the blocks a sequence owns (finish, abort, preemption)."""
        if not seq.kind.is_fill and seq.block_table:
            self.blocks.free(seq.block_table)
        if not seq.kind.is_fill:
            seq.block_table = []
            seq.block_hashes = []
        if seq.blend is not None:
            seq.blend.run = None  # a blend under way wrote into those blocks: it starts over

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        self.release(seq)
        seq.status = Status.FINISHED
