"""A sequence: the engine's state of one request (or of one chunk-cache fill job).

KV list of a sequence = `borrowed_slots` (KV it reads but does not own: a chunk-cache entry, a
system part) followed by its own tokens' KV in `block_table`. Own token i sits at KV list index
`len(borrowed_slots) + i` and at position `position_base + i`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from chunkcache.hashing import BlockKeys
from chunkcache.outputs import RequestMetrics
from chunkcache.sampling import SamplingParams

if TYPE_CHECKING:
    from chunkcache.engine.fusion import FusionGroup


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]  # what the request reports as its prompt
    token_ids: list[int]  # own tokens: the part of the prompt computed here, then the output
    params: SamplingParams
    prompt: str | None = None
    position_base: int = 0
    borrowed_slots: torch.Tensor | None = None
    # Fill jobs compute a chunk-cache entry into pre-assigned pages and sample nothing.
    is_fill: bool = False
    # Background work (a canonical chunk entry or a prewarm's entry nobody else waits for, an
    # exact-prefix job): scheduled on the token budget requests leave (engine/scheduler.py).
    background: bool = False
    # Prewarm requests (LLMEngine.add_prewarm) hold a chunked prompt's entries until they are all
    # computed, then finish: they never reach the scheduler and generate nothing.
    is_prewarm: bool = False
    status: Status = Status.WAITING
    num_own_prompt_tokens: int = 0
    num_computed: int = 0  # own tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_prefix_cached: int = 0  # own prompt tokens found in the prefix cache
    num_chunk_cached: int = 0  # prompt tokens borrowed from the chunk cache
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one entry per own prompt token, None for the first.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # SamplingParams.json_schema: the llguidance matcher that constrains the output.
    grammar: Any = None
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Why the engine failed this request (finish_reason "error"); other requests go on.
    error: str | None = None
    text: str = ""
    num_sent_tokens: int = 0
    sent_text_len: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.time()))
    # Chunk-cache bookkeeping owned by the chunk manager (entries pinned, jobs awaited).
    chunk_state: Any = None
    # The chunk options of a chunked request (the engine's, or the request's own).
    chunk_config: Any = None
    # Layout "offset": the prompt is prefilled by blend, in one piece. Cleared on preemption,
    # after which the request is recomputed by a plain prefill.
    blend: Any = None
    blend_reused_tokens: int = 0
    blend_recomputed_tokens: int = 0
    blend_fallback: bool = False
    # The chunks' entries in the KV list were computed apart: later tokens attend to them through
    # this calibration (model.calibration.ContextCalibration); None = exact attention.
    calibration: Any = None
    # Separator-free matching, first sight (nothing to reuse): the prompt is prefilled as usual and
    # these parts (a ChunkedPrompt) are stored in the chunk pool from its KV once it is computed.
    learn: Any = None
    # Blocks whose KV is not plain causal attention over the tokens must never be found by hash.
    prefix_cacheable: bool = True
    # A chunked request's own prompt tokens whose KV is nevertheless exactly a plain prefill's
    # (layout "offset": S and the first chunk), registered in the prefix cache like a plain prefix.
    exact_prefix: int = 0
    # vLLM's cache_salt: enters the first prefix block's hash and every chunk key, so requests
    # with different salts (tenants) never share KV.
    cache_salt: str | None = None
    # How this sequence's KV from block `kv_key_from` on is computed where it is not a plain
    # prefill's (a blend's options and cuts, hashing.blend_key): its blocks are registered, and
    # found, under this extra key. None: a plain chain.
    kv_key: bytes | None = None
    kv_key_from: int = 0
    # Layout "fusion" (engine/fusion.py): the group this sequence belongs to, as the request (its
    # reply; never scheduled) or as one of its streams (scheduled, preempted and freed together).
    fusion: FusionGroup | None = None

    def __post_init__(self) -> None:
        if not self.num_own_prompt_tokens:
            self.num_own_prompt_tokens = len(self.token_ids)

    @property
    def is_prefix_job(self) -> bool:
        """An exact_follow_ups job (engine._queue_exact_prefix): background work that is a plain
        prefill into KV blocks, unlike a chunk entry's fill job."""
        return self.background and not self.is_fill

    @property
    def block_keys(self) -> BlockKeys:
        return BlockKeys(self.cache_salt, self.kv_key, self.kv_key_from)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_borrowed(self) -> int:
        return 0 if self.borrowed_slots is None else int(self.borrowed_slots.numel())

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
        return self.position_base + self.num_tokens - 1
