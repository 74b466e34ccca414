"""The parts of a sequence's state that are not its core (core/sequence.py), one typed group each,
so that the request reads as ids, tokens, blocks and timings, and each mode's state sits apart,
written by the few modules that serve that mode.

`KVList`, `Reply`, `ReuseCounts` and `PrefixKeys` are every sequence's (a job's reply and counts
are never read); `BlendState` and `FidelityCheck` exist only where their mode serves the sequence
(None otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from chunkcache.hashing import BlockKeys

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from chunkcache.config import ChunkConfig
    from chunkcache.engine.blend import BlendRun
    from chunkcache.model.calibration import ContextCalibration


@dataclass
class KVList:
    """Where a sequence's own tokens sit and what they attend to besides them: its KV list is
    `borrowed_slots` (KV it reads but does not own: a chunk-cache entry, a system part) followed by
    its own tokens' KV in its blocks; own token i is at KV list index `len(borrowed_slots) + i` and
    at position `position_base + i`. Laid out by the chunk cache (chunk/assemble.py, a fill job's
    S) and fusion, read by the runner. Apart from the core because a plain request has none of it
    (no borrowed KV, position 0, exact attention)."""

    position_base: int = 0
    borrowed_slots: torch.Tensor | None = None
    # The borrowed (or blended) chunks' KV was computed apart: later tokens attend to it through
    # this calibration (model.calibration.ContextCalibration); None = exact attention.
    calibration: ContextCalibration | None = None


@dataclass
class Reply:
    """How the reply is drawn and how far it has been reported: what the sampler and detokenizer
    keep per sequence, and what its RequestOutputs are made from (engine/postprocess.py). Apart
    from the core so that the streaming bookkeeping does not crowd the request's own fields."""

    generator: torch.Generator | None = None
    # SamplingParams.json_schema: the llguidance matcher that constrains the output.
    grammar: LLMatcher | None = None
    text: str = ""
    num_sent_tokens: int = 0  # output tokens already in a RequestOutput
    sent_text_len: int = 0  # characters of `text` already in one
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Why the engine failed this sequence (finish_reason "error"); other requests go on.
    error: str | None = None
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one entry per own prompt token, None for the first.
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class ReuseCounts:
    """Prompt tokens whose KV came from a cache, or was kept by a blend, as the request's output
    reports them (RequestOutput's num_*_tokens). Written where the KV is found (admission, the
    scheduler) or blended (the runner), and zeroed where it is recomputed after all."""

    num_prefix_cached: int = 0  # own prompt tokens found in the prefix cache
    num_chunk_cached: int = 0  # prompt tokens borrowed from the chunk cache
    blend_reused_tokens: int = 0
    blend_recomputed_tokens: int = 0
    blend_fallback: bool = False  # the blend failed and the prompt was prefilled plainly


@dataclass
class PrefixKeys:
    """Whether, and under which keys, a sequence's blocks enter the prefix cache and are found in
    it (engine/scheduler.py matches, engine/engine.py registers). Apart from the core because a
    plain request keeps the defaults (cacheable, plain chain) and only the reuse modes change them:
    intake (a chunk plan, a blend's key), the runner (a blend done or failed), the follow-ups
    (a prefix found exact) and admission (a prompt turned plain).

    The hashes' extra keys are `hashing.BlockKeys`, made from the last three fields on each read
    (`block_keys`) rather than held: BlockKeys is a frozen value the block manager is handed, and
    these fields change over a request's life, each written where that mode decides it."""

    # Blocks whose KV is not plain causal attention over the tokens must never be found by hash.
    cacheable: bool = True
    # A chunked request's own prompt tokens whose KV is nevertheless exactly a plain prefill's
    # (layout "offset": S and the first chunk), registered in the prefix cache like a plain prefix.
    num_exact: int = 0
    # vLLM's cache_salt: enters the first prefix block's hash and every chunk key, so requests
    # with different salts (tenants) never share KV.
    cache_salt: str | None = None
    # How this sequence's KV from block `kv_key_from` on is computed where it is not a plain
    # prefill's (a blend's options and cuts, hashing.blend_key): its blocks are registered, and
    # found, under this extra key. None: a plain chain.
    kv_key: bytes | None = None
    kv_key_from: int = 0

    @property
    def block_keys(self) -> BlockKeys:
        """The extra keys of this sequence's block hashes, as it registers and matches them."""
        return BlockKeys(self.cache_salt, self.kv_key, self.kv_key_from)

    @property
    def plain_keys(self) -> BlockKeys:
        """The keys of a plain prefill of the same tokens under the same salt."""
        return BlockKeys(self.cache_salt)

    def make_plain(self) -> None:
        """Key its blocks as a plain prefill's, found by any prompt with these tokens (under its
        salt): the runner, once a blend fails and the prompt is prefilled plainly; the follow-ups,
        once its context is found exact in the prefix cache."""
        self.cacheable, self.kv_key, self.kv_key_from = True, None, 0

    def registrable(self, num_computed: int) -> int:
        """How many of the `num_computed` own tokens' blocks may be registered: all where
        cacheable, else only the exact prefix's (a chunked request's borrowed context is not
        a plain prefill's)."""
        return num_computed if self.cacheable else min(self.num_exact, num_computed)


@dataclass
class BlendState:
    """Layout "offset", or a fusion request's blended joint stream (`fusion_joint_blend`): the
    prompt is prefilled by blend (engine/blend.py) with `config`. Dropped (the sequence's `blend`
    set to None) on preemption or a failed blend, after which the sequence is recomputed by a plain
    prefill; kept once the blend is done, since its tokens' KV is blended. The counts it leaves are
    in `ReuseCounts`, which outlive it (a fallback is reported after the blend is gone)."""

    config: ChunkConfig
    # The blend under way, where it spans steps (its layers run in pieces of the token budget);
    # its tokens count as computed in the step that runs its last layer.
    run: BlendRun | None = None


@dataclass
class FidelityCheck:
    """An online shadow check (fidelity/shadow.py) of a chunked request served by the engine's
    reuse configuration `config` (one without chunk options of its own): set at intake on a
    request that may be drawn, and on a sampled request's shadow.

    A sampled request drawn, and its shadow, keep the log-softmax of the raw next-token
    distribution of each of their first `record_steps` tokens (engine/postprocess.py); the shadow
    appends `forced_token_ids` (the served reply) instead of its own samples, so both are read on
    the same tokens."""

    config: str  # fidelity/controller.py's name of the configuration judged
    drawn: bool = False  # the request was drawn for a check at admission
    record_steps: int = 0
    step_logprobs: list[torch.Tensor] | None = None
    forced_token_ids: list[int] | None = None
