"""A sequence: the engine's state of one request, or of work the engine does for requests.

What a sequence is (`SequenceKind`) is fixed when it is made, but for a canonical chunk fill that
a request starts waiting for (it becomes an ordinary fill). Its core is what every sequence has:
ids, tokens, sampling params, status, blocks and timings. The rest sits in typed groups
(core/sequence_state.py): `kv_list` (its borrowed KV and positions), `reply` (what it samples and
reports), `reuse` (cached-token counts), `prefix_keys` (whether and under which keys its blocks
enter the prefix cache), and one Optional field per mode that serves it (`blend`, `fidelity`,
`fill`, `learn`). Its chunk plan is typed by stage: `chunk_plan` (what intake decided: the
prompt's parts and the chunk options), `chunks` (the entries admission pinned for a request),
`fill` (the entry a fill job computes). The stages stay apart, not one group or union: they are
written by different steps, live over different spans (a fusion request's blended joint stream
has `chunks` and `blend` but no `chunk_plan`), and several mode fields hold at once.

KV list of a sequence = `kv_list.borrowed_slots` followed by its own tokens' KV in `block_table`
(sequence_state.KVList).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chunkcache.core.sequence_state import BlendState, FidelityCheck, KVList, PrefixKeys, Reply, ReuseCounts
from chunkcache.outputs import RequestMetrics
from chunkcache.sampling import SamplingParams

if TYPE_CHECKING:
    from chunkcache.core.plan import ChunkedPrompt, ChunkPlan, FillJob, RequestChunks
    from chunkcache.engine.fusion import FusionGroup


class SequenceKind(enum.Enum):
    """What a sequence is, which decides how the engine schedules it and whether anyone reads it."""

    # A client's request: sampled, its outputs returned.
    REQUEST = "request"
    # One stream of a layout-"fusion" request (engine/fusion.py): scheduled with its group's other
    # streams; its rows are combined into the request's (which itself is never scheduled).
    FUSION_STREAM = "fusion_stream"
    # LLMEngine.add_prewarm: holds a chunked prompt's entries until they are all computed, then
    # finishes; never scheduled, generates nothing.
    PREWARM = "prewarm"
    # Computes a chunk-cache entry into pre-assigned pages; samples nothing.
    CHUNK_FILL = "chunk_fill"
    # A fill job of a canonical entry nobody waits for (chunk/manager.py): background work, run
    # on the token budget requests leave; a CHUNK_FILL once a request needs it.
    CANONICAL_FILL = "canonical_fill"
    # A fill job only prewarms wait for: background work as CANONICAL_FILL, so that a large
    # prewarm never stalls requests; a CHUNK_FILL once a request needs its entry.
    PREWARM_FILL = "prewarm_fill"
    # An exact_follow_ups job (engine._queue_exact_prefix): background work, a plain prefill into
    # KV blocks; its one sampled token is thrown away.
    PREFIX_JOB = "prefix_job"
    # An online shadow check (fidelity/shadow.py): a served chunked request's prompt re-run as a
    # plain prefill, greedy, as background work; its reply is compared with what was served and
    # never returned.
    SHADOW = "shadow"

    @property
    def is_fill(self) -> bool:
        """Computes a chunk entry into its pages (not KV blocks of its own)."""
        return self in (SequenceKind.CHUNK_FILL, SequenceKind.CANONICAL_FILL, SequenceKind.PREWARM_FILL)

    @property
    def is_background(self) -> bool:
        """Work no request waits for: scheduled on the token budget requests leave."""
        return self in (
            SequenceKind.CANONICAL_FILL,
            SequenceKind.PREWARM_FILL,
            SequenceKind.PREFIX_JOB,
            SequenceKind.SHADOW,
        )

    @property
    def yields_blocks(self) -> bool:
        """Background work in KV blocks of its own, which a waiting request may take back."""
        return self in (SequenceKind.PREFIX_JOB, SequenceKind.SHADOW)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]  # what the request reports as its prompt
    token_ids: list[int]  # own tokens: the part of the prompt computed here, then the output
    params: SamplingParams
    prompt: str | None = None
    kind: SequenceKind = SequenceKind.REQUEST
    status: Status = Status.WAITING
    num_own_prompt_tokens: int = 0
    num_computed: int = 0  # own tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.time()))
    kv_list: KVList = field(default_factory=KVList)
    reply: Reply = field(default_factory=Reply)
    reuse: ReuseCounts = field(default_factory=ReuseCounts)
    prefix_keys: PrefixKeys = field(default_factory=PrefixKeys)
    # A chunked (or separator-free candidate) request's parts and chunk options, from intake;
    # None for a plain request (or one that admission turned into one).
    chunk_plan: ChunkPlan | None = None
    # A chunked request's entries, pinned at admission (owned by the chunk manager).
    chunks: RequestChunks | None = None
    # A fill job's entry (kinds CHUNK_FILL, CANONICAL_FILL, PREWARM_FILL).
    fill: FillJob | None = None
    # Layout "offset" (or a fusion request's blended joint stream): the blend that prefills the
    # prompt; None for a plain prefill, and once dropped (preemption, a failed blend).
    blend: BlendState | None = None
    # Separator-free matching, first sight (nothing to reuse): the prompt is prefilled as usual and
    # these parts (a ChunkedPrompt) are stored in the chunk pool from its KV once it is computed.
    learn: ChunkedPrompt | None = None
    # Layout "fusion" (engine/fusion.py): the group this sequence belongs to, as the request (its
    # reply; never scheduled) or as one of its streams (scheduled, preempted and freed together).
    fusion: FusionGroup | None = None
    # A shadow check that may judge this request, or that this shadow runs (fidelity/shadow.py).
    fidelity: FidelityCheck | None = None

    def __post_init__(self) -> None:
        if not self.num_own_prompt_tokens:
            self.num_own_prompt_tokens = len(self.token_ids)

    @property
    def request(self) -> Sequence:
        """The request this sequence answers: a fusion stream's group's request, else itself."""
        if self.kind is SequenceKind.FUSION_STREAM:
            assert self.fusion is not None
            return self.fusion.request
        return self

    @property
    def counts_as_request(self) -> bool:
        """Whether a scheduled sequence is a request of its own in the load stats (a fusion
        request counts once, by its first stream)."""
        if self.kind is SequenceKind.FUSION_STREAM:
            assert self.fusion is not None
            return self is self.fusion.streams[0]
        return self.kind is SequenceKind.REQUEST

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_borrowed(self) -> int:
        slots = self.kv_list.borrowed_slots
        return 0 if slots is None else int(slots.numel())

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_own_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_own_prompt_tokens

    @property
    def context_len(self) -> int:
        """KV list length once every own token is computed."""
        return self.num_borrowed + self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def last_position(self) -> int:
        return self.kv_list.position_base + self.num_tokens - 1
