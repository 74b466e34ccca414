"""LLMEngine: requests in, one `step()` at a time, RequestOutputs out.

`add_request` and `abort_request` may be called from any thread: they only validate and post to
an inbox. `step()` runs on one thread and owns every other piece of state.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from chunkcache.chunk.blend import kv_options, needs_stored_scores
from chunkcache.chunk.documents import PromptParts, parse_documents, render_with_documents
from chunkcache.chunk.manager import ChunkManager
from chunkcache.chunk.matcher import PlainPrompt
from chunkcache.chunk.parse import ChunkedPrompt, parse_chunked_prompt, tokenize_parts
from chunkcache.chunk.plan import ChunkPlan
from chunkcache.chunk.pool import ChunkPool
from chunkcache.chunk.sensitivity import neutral_passage
from chunkcache.chunk.tiers.disk import DiskTier
from chunkcache.chunk.tiers.identity import model_identity
from chunkcache.chunk.tiers.provider import TierProvider
from chunkcache.chunk.tiers.remote import RedisTier
from chunkcache.chunk.tiers.stack import TierStack
from chunkcache.config import ChunkConfig, EngineConfig, ReuseOptions
from chunkcache.curve import CurveKeys, load_public_key
from chunkcache.engine.detokenizer import Detokenizer
from chunkcache.engine.fusion import FusionGroup, fuse_rows, num_streams
from chunkcache.engine.kv_blocks import BlockManager
from chunkcache.engine.runner import ModelRunner
from chunkcache.engine.sampler import History, sample
from chunkcache.engine.scheduler import ScheduledBatch, Scheduler
from chunkcache.engine.sequence import Sequence, SequenceKind, Status
from chunkcache.engine.structured import StructuredOutputs
from chunkcache.errors import InvalidRequestError, PromptTooLongError
from chunkcache.fidelity.gate import resolve as resolve_fidelity
from chunkcache.hashing import BlockKeys, blend_key
from chunkcache.kv_events import AllBlocksCleared, KVEventPublisher, PublisherCurve
from chunkcache.malloc import keep_freed_memory
from chunkcache.model.loader import load_model
from chunkcache.outputs import CompletionOutput, RequestOutput
from chunkcache.sampling import SamplingParams
from chunkcache.threads import set_threads

logger = logging.getLogger(__name__)

_DEFAULT_KV_GB = 0.5
# Prewarm requests and exact_follow_ups jobs generate nothing anyone reads: a job is a plain
# prefill, and the one token it samples is thrown away.
_ONE_DISCARDED_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)
_MAX_EXACT_JOBS = 64
# A step with nothing runnable while chunk entries load from the tiers waits this long at most.
_LOAD_WAIT_S = 0.01
# apply_chat_template's own arguments: a request's template variables must not reach them.
_RENDER_ARGUMENTS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
     "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
     "chat_template", "tools", "documents"}
)  # fmt: skip


def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids a request names must be in the vocabulary: an id past it would be silently
    ignored (logit_bias) or never match (stop_token_ids), so the client would not get what it asked."""
    for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{name} names token id {bad}, outside the vocabulary [0, {vocab_size})", name
            )


def _check_salt(cache_salt: str | None) -> None:
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")


def _request_of(seq: Sequence) -> Sequence:
    """The request a sequence answers: a fusion stream's group's request, else itself."""
    if seq.kind is SequenceKind.FUSION_STREAM:
        assert seq.fusion is not None
        return seq.fusion.request
    return seq


def _counts_as_request(seq: Sequence) -> bool:
    """Whether a scheduled sequence is a request of its own in the load stats (a fusion request
    counts once, by its first stream)."""
    if seq.kind is SequenceKind.FUSION_STREAM:
        assert seq.fusion is not None
        return seq is seq.fusion.streams[0]
    return seq.kind is SequenceKind.REQUEST


def _reuse_summary(chunk: ChunkConfig) -> str:
    """What a chunked prompt's reuse will do, for the load log line."""
    if chunk.layout == "fusion":
        amateur = " with the no-document stream" if chunk.fusion_amateur else ""
        return f"one exact stream per document, rule {chunk.fusion_rule}{amateur}"
    if chunk.layout == "offset":
        ratios = ", ".join(map(str, chunk.blend_recompute_ratios))
        return (
            f"blend by {chunk.blend_selector}, recompute {ratios} at layers {list(chunk.blend_check_layers)}"
        )
    return "documents side by side, nothing recomputed"


def _prompt_text(prompt: str | list[int] | PromptParts) -> str | None:
    """The prompt as text, as reported back (None for token ids)."""
    if isinstance(prompt, PromptParts):
        return prompt.text()
    return prompt if isinstance(prompt, str) else None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        set_threads(config.threads)
        loaded = load_model(
            config.model, config.device, config.dtype, config.tokenizer, config.adapter, config.narrow_weights
        )
        self.spec = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        if self.device.type == "cpu":
            # Activations freed by a step stay mapped for the next one (chunkcache/malloc.py).
            keep_freed_memory()
        self.model_name = config.served_model_name or loaded.name
        # With fidelity_target, the reuse configuration the model's profile chooses (fidelity/gate.py).
        config = self.config = resolve_fidelity(config, loaded)
        self.max_model_len = self._max_model_len(config)
        config.chunk.validate(self.spec.num_layers)
        if config.chunk.enable:
            logger.info("chunked prompts: layout %s (%s)", config.chunk.layout, _reuse_summary(config.chunk))
        cache = config.cache
        bs = cache.block_size
        dtype_size = torch.tensor([], dtype=loaded.dtype).element_size()
        token_bytes = self.spec.kv_bytes_per_token(dtype_size)
        if cache.kv_cache_tokens is not None:
            num_blocks = cache.kv_cache_tokens // bs
        else:
            gb = cache.kv_cache_memory_gb or _DEFAULT_KV_GB
            num_blocks = max(1, int(gb * 2**30) // (token_bytes * bs))
        # "GPU" names the engine's main KV tier in vLLM's events (offloaded KV would be "CPU"),
        # whatever the device: a router weighs tiers, not devices.
        medium = "GPU"
        self.blocks = BlockManager(
            num_blocks,
            bs,
            cache.enable_prefix_caching,
            cache.hash_seed,
            medium,
            hash_algorithm=cache.prefix_caching_hash_algo,
        )
        pool_pages = 0
        if config.chunk.enable:
            pool_pages = int(config.chunk.cache_size_gb * 2**30) // (token_bytes * bs)
        # The passage chunk entries measure their sensitivity after, written as a document after
        # the separator (chunk/sensitivity.py).
        neutral = config.chunk.separator + neutral_passage()
        neutral_ids = tuple(self.tokenizer.encode(neutral, add_special_tokens=False))
        self.runner = ModelRunner(
            loaded,
            (num_blocks + pool_pages) * bs,
            bs,
            neutral_ids,
            compile_decode=config.compile_decode,
            committed_slots=num_blocks * bs,
        )
        self.chunks: ChunkManager | None = None
        if config.chunk.enable:
            pool = ChunkPool(num_blocks, pool_pages, bs, token_bytes * bs, config.chunk.lru_threshold, medium)
            self.chunks = ChunkManager(
                config.chunk,
                self.model_name,
                self.blocks,
                pool,
                self.device,
                self.runner.kv_caches,
                self._lower_tiers(config.chunk, loaded),
            )
            self.runner.on_measured = self.chunks.sensitivity_measured
        self.scheduler = Scheduler(
            config.scheduler,
            self.blocks,
            is_ready=self._is_ready,
        )
        self.detokenizer = Detokenizer(self.tokenizer, loaded.eos_token_ids, self.max_model_len)
        self.structured = StructuredOutputs(self.tokenizer, self.spec.vocab_size)
        self._generator = torch.Generator().manual_seed(config.seed)
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._aborts: list[str] = []
        self._requests: dict[str, Sequence] = {}
        self._prewarms: list[Sequence] = []
        self._ids_in_use: set[str] = set()
        self.publisher: KVEventPublisher | None = None
        ev = config.kv_events
        if ev.endpoint:
            topic = ev.topic or f"kv@{socket.gethostname()}-{os.getpid()}@{self.model_name}"
            curve = None
            if ev.curve_secret_key is not None:
                server_key = None if ev.curve_server_key is None else load_public_key(ev.curve_server_key)
                curve = PublisherCurve(
                    CurveKeys.load(ev.curve_secret_key), ev.curve_authorized_keys, server_key
                )
            self.publisher = KVEventPublisher(
                ev.endpoint, topic, ev.replay_endpoint, ev.buffer_steps, curve=curve, insecure=ev.insecure
            )
        self.counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "cached_tokens": 0}
        # Chunked requests that read an earlier request's blended KV from the prefix cache, or an
        # exact one (`exact_follow_ups`); the background jobs of the latter, by prompt.
        self.blended_prefix_hits = 0
        self.exact_prefix_hits = 0
        self.exact_prefix_jobs = 0
        self._exact_jobs: dict[tuple[str | None, tuple[int, ...]], Sequence] = {}

    def _is_ready(self, seq: Sequence) -> bool:
        """Whether the scheduler may run `seq`: its borrowed KV is computed (a fusion stream's
        is its request's)."""
        if self.chunks is None:
            return True
        if seq.fusion is not None:
            return seq.fusion.ready(self.chunks.is_ready)
        return self.chunks.is_ready(seq)

    def _lower_tiers(self, chunk: ChunkConfig, loaded: Any) -> TierStack | None:
        """The chunk pool's lower tiers, nearest first; None without any. On a CPU the device pool
        already is host memory, so there is no separate host-memory tier."""
        tiers: list[TierProvider] = []
        if chunk.disk_dir:
            tiers.append(DiskTier(chunk.disk_dir, int(chunk.disk_gb * 2**30)))
        if chunk.remote:
            tiers.append(RedisTier(chunk.remote))
        if not tiers:
            return None
        spec = self.spec
        layout = (spec.num_layers, spec.num_kv_heads, spec.head_dim, loaded.dtype)
        return TierStack(tiers, model_identity(loaded.model, self.tokenizer, self.model_name), layout)

    @classmethod
    def from_options(cls, model: str, **options: Any) -> LLMEngine:
        return cls(EngineConfig.from_options(model, **options))

    def _max_model_len(self, config: EngineConfig) -> int:
        limit = self.spec.max_position_embeddings
        asked = config.scheduler.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len {asked} exceeds the model's max_position_embeddings {limit}")
        return asked or limit

    # ---- requests in -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | PromptParts,
        params: SamplingParams,
        add_special_tokens: bool = True,
        chunk_options: ReuseOptions | Mapping[str, object] | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request; raises InvalidRequestError naming what is wrong.

        A `PromptParts` prompt (a chat rendered with its documents) is already cut into S, chunks
        and Q: each part is tokenized alone, as a chunked prompt's parts are.

        `chunk_options` overrides the engine's chunk layout and blend options for this request
        (ReuseOptions, or a mapping of its names: chunk_layout, blend_recompute_ratios, ...). Requests share cached KV only
        with requests of the same `cache_salt` (vLLM's field; None shares with None).
        """
        _check_salt(cache_salt)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        try:
            params.validate()
        except ValueError as e:
            # SamplingParams' messages start with the field's name.
            raise InvalidRequestError(str(e), param=str(e).split(" ", 1)[0]) from None
        if params.logprobs is not None and params.logprobs > self.spec.vocab_size:
            raise InvalidRequestError(f"logprobs {params.logprobs} exceeds the vocabulary size", "logprobs")
        _check_token_ids(params, self.spec.vocab_size)
        chunk_config = self._chunk_config(chunk_options)
        try:
            seq = self._make_sequence(
                request_id, prompt, params, add_special_tokens, chunk_config, cache_salt
            )
        except InvalidRequestError as e:
            e.param = e.param or "prompt"  # the prompt's checks (chunk parsing included) name no field
            raise
        self._post(seq)

    def _post(self, seq: Sequence) -> None:
        with self._lock:
            if seq.request_id in self._ids_in_use:
                raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
            self._ids_in_use.add(seq.request_id)
            self._inbox.append(seq)

    def add_prewarm(
        self,
        request_id: str,
        prompt: str | None = None,
        system: str | None = None,
        documents: list[str] | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        max_tokens: int | None = None,
    ) -> None:
        """Compute and cache a system part and its documents without generating: either a chunked
        `prompt` (its question is ignored) or `system` and `documents`. The request finishes, with
        no tokens, once every entry is in the pool (and handed to the lower tiers); its output
        counts the tokens that were already cached. Raises InvalidRequestError naming what is wrong,
        PromptTooLongError if all its parts hold more than `max_tokens` tokens (None: no limit)."""
        _check_salt(cache_salt)
        if self.chunks is None:
            raise InvalidRequestError("the chunk cache is disabled: there is nothing to prewarm")
        chunked = self._prewarm_prompt(prompt, system, documents, add_special_tokens)
        total = len(chunked.sys_token_ids) + sum(map(len, chunked.chunks))
        if max_tokens is not None and total > max_tokens:
            raise PromptTooLongError(
                f"prewarm of {total} tokens is more than this server takes at once ({max_tokens}, "
                "--max-prewarm-tokens); split it into several calls",
                "prompt" if prompt is not None else "documents",
            )
        self.chunks.validate(chunked, self.max_model_len, need_question=False)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=chunked.all_token_ids(),
            token_ids=[],
            params=_ONE_DISCARDED_TOKEN,
            prompt=prompt,
            kind=SequenceKind.PREWARM,
            cache_salt=cache_salt,
            chunk_plan=ChunkPlan(chunked, self.config.chunk),
            prefix_cacheable=False,
        )
        self._post(seq)

    def _prewarm_prompt(
        self, prompt: str | None, system: str | None, documents: list[str] | None, add_special_tokens: bool
    ) -> ChunkedPrompt:
        if prompt is not None:
            if system is not None or documents is not None:
                raise InvalidRequestError("give either a chunked prompt or system and documents, not both")
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt must be a string", "prompt")
            sep = self.config.chunk.separator
            chunked = parse_chunked_prompt(prompt, sep, self.tokenizer, add_special_tokens)
            if chunked is None:
                raise InvalidRequestError(
                    f"prompt is not a chunked prompt: it needs the separator {sep!r} at least twice", "prompt"
                )
            return ChunkedPrompt(chunked.sys_token_ids, chunked.chunks, ())
        if not isinstance(system, str):
            raise InvalidRequestError("system must be a string (it may be empty)", "system")
        if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
            raise InvalidRequestError("documents must be a list of strings", "documents")
        sys_ids = tuple(self.tokenizer.encode(system, add_special_tokens=add_special_tokens))
        chunks = tuple(
            c for c in (tuple(self.tokenizer.encode(d, add_special_tokens=False)) for d in documents) if c
        )
        if not chunks:
            raise InvalidRequestError("documents holds no document with any token", "documents")
        return ChunkedPrompt(sys_ids, chunks, ())

    def _chunk_config(self, options: ReuseOptions | Mapping[str, object] | None) -> ChunkConfig:
        try:
            if options is not None and not isinstance(options, ReuseOptions):
                options = ReuseOptions.from_mapping(options)
            if options is None or not options.given():
                return self.config.chunk
            if self.chunks is not None:
                return self.config.chunk.with_request_options(options, self.spec.num_layers)
        except (TypeError, ValueError) as e:
            # ChunkConfig's messages start with the option's name.
            raise InvalidRequestError(str(e), param=str(e).split(" ", 1)[0]) from None
        raise InvalidRequestError(
            f"chunk options {sorted(options.given())} given, but the chunk cache is disabled"
        )

    def _tokenize(
        self, prompt: str | list[int] | PromptParts, add_special_tokens: bool, chunk_config: ChunkConfig
    ) -> tuple[list[int], ChunkedPrompt | None]:
        if isinstance(prompt, PromptParts):
            if self.chunks is None:
                return self._tokenize(prompt.text(), add_special_tokens, chunk_config)
            chunked = tokenize_parts(
                prompt.system, prompt.chunks, prompt.question, self.tokenizer, add_special_tokens
            )
            return chunked.all_token_ids(), chunked
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", "prompt")
            if self.chunks is not None:
                chunked = parse_chunked_prompt(
                    prompt, chunk_config.separator, self.tokenizer, add_special_tokens
                )
                if chunked is not None:
                    return chunked.all_token_ids(), chunked
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)), None
        if isinstance(prompt, list | tuple):
            vocab = self.spec.vocab_size
            bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"token id {bad!r} is outside the vocabulary [0, {vocab})", "prompt"
                )
            return list(prompt), None
        raise InvalidRequestError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt"
        )

    def _make_sequence(
        self,
        request_id: str,
        prompt: str | list[int] | PromptParts,
        params: SamplingParams,
        add_special_tokens: bool,
        chunk_config: ChunkConfig,
        cache_salt: str | None = None,
    ) -> Sequence:
        token_ids, chunked = self._tokenize(prompt, add_special_tokens, chunk_config)
        if not token_ids:
            raise InvalidRequestError("prompt is empty (no tokens)", "prompt")
        offset = chunk_config.layout == "offset"
        if chunked is not None and chunk_config.layout == "fusion" and len(chunked.chunks) < 2:
            chunked = None  # one document: its one stream is the plain prompt, exact as it is
        if (
            chunked is not None
            and offset
            and chunked.num_tokens - len(chunked.question_token_ids) - len(chunked.sys_token_ids)
            < chunk_config.blend_min_tokens
        ):
            chunked = None  # too little to reuse: a plain prefill is as fast
        # Separator-free matching: a plain prompt is cut at admission, where the pool is known.
        plain = None
        if (
            chunked is None
            and self.chunks is not None
            and chunk_config.separator_free
            and offset
            and params.prompt_logprobs is None
            and cache_salt is None
        ):
            plain = PlainPrompt(tuple(token_ids))
        if chunked is not None and params.prompt_logprobs is not None:
            raise InvalidRequestError(
                "prompt logprobs are not available for chunked prompts (their chunks' KV is reused, "
                "not computed in this request)"
            )
        if chunked is not None:
            assert self.chunks is not None
            self.chunks.validate(chunked, self.max_model_len)
        isolated = chunked is not None and not offset
        prompt_len = (
            chunked.question_position() + len(chunked.question_token_ids) if isolated else len(token_ids)
        )
        if prompt_len > self.max_model_len:
            raise PromptTooLongError(
                f"prompt is {prompt_len} tokens long, more than max_model_len {self.max_model_len}"
            )
        if params.max_tokens is not None and prompt_len + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}",
                "max_tokens",
            )
        # Isolated: the request computes only Q (and its output); the rest is borrowed.
        own = list(chunked.question_token_ids) if isolated else token_ids
        if self.blocks.blocks_for(len(own) + 1) > self.blocks.num_blocks:
            raise PromptTooLongError(
                f"prompt needs {self.blocks.blocks_for(len(own) + 1)} KV blocks, "
                f"the cache has {self.blocks.num_blocks}"
            )
        copies = 1
        if chunked is not None and chunk_config.layout == "fusion":
            copies = num_streams(chunked, chunk_config, self.config.scheduler)
        if copies * self.blocks.blocks_for(len(own) + 1) > self.blocks.num_blocks:
            raise PromptTooLongError(
                f"prompt needs {copies} x {self.blocks.blocks_for(len(own) + 1)} KV blocks (one share per "
                f"stream), the cache has {self.blocks.num_blocks}"
            )
        params = self._fit_kv_cache(params, len(own), prompt_len, copies)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            token_ids=list(own),
            params=params,
            prompt=_prompt_text(prompt),
            cache_salt=cache_salt,
        )
        seq.generator = (
            torch.Generator().manual_seed(params.seed) if params.seed is not None else self._generator
        )
        if params.json_schema is not None:
            seq.grammar = self.structured.matcher(params.json_schema)
        reused = chunked if chunked is not None else plain
        if reused is not None:
            seq.chunk_plan = ChunkPlan(reused, chunk_config)
            seq.prefix_cacheable = False
        if copies > 1:
            assert chunked is not None
            FusionGroup.create(seq, chunked, chunk_config)
        if chunked is not None and offset and chunked.chunks and self.blocks.enable_prefix_caching:
            options = kv_options(chunk_config)
            if options is not None:
                parts = [len(chunked.sys_token_ids), *map(len, chunked.chunks)]
                seq.kv_key = blend_key(options, parts, chunk_config.hash_algorithm)
                # S and the first chunk hold a plain prefill's KV (the runner's exact prefix):
                # their blocks keep plain hashes, which any prompt with that prefix may find.
                seq.kv_key_from = (parts[0] + parts[1]) // self.blocks.block_size
        return seq

    def _reads_cached_prefix(self, seq: Sequence) -> bool:
        """Whether a chunked "offset" request's S and chunks, in this order, are in the prefix
        cache: as a plain prefill's KV (an `exact_follow_ups` job's), or blended before under the
        same blend options (its `kv_key` chain). It then reads that KV as a prefix (the scheduler
        matches the chain) and computes only its question and the last chunk's tokens after its
        last full block: no pool entries, no blend. Where neither is cached and `exact_follow_ups`
        is on, the job that prefills the exact prefix is queued (`_queue_exact_prefix`)."""
        plan = seq.chunk_plan
        if (
            seq.kind is SequenceKind.PREWARM
            or plan is None
            or not isinstance(plan.prompt, ChunkedPrompt)
            or plan.config.layout != "offset"
        ):
            return False
        prompt = plan.prompt
        context = prompt.num_tokens - len(prompt.question_token_ids)  # S and the chunks
        need = context // self.blocks.block_size
        exact = self.config.chunk.exact_follow_ups and need > 0
        if exact and self.blocks.cached_prefix_blocks(seq.token_ids, need, BlockKeys(seq.cache_salt)) >= need:
            seq.kv_key, seq.kv_key_from = None, 0  # what it computes is exact too: plain blocks
            self.exact_prefix_hits += 1
        elif (
            seq.kv_key is not None
            and need > seq.kv_key_from  # else no blended block: S and the first chunk fill them
            and self.blocks.cached_prefix_blocks(seq.token_ids, need, seq.block_keys) >= need
        ):
            self.blended_prefix_hits += 1
        else:
            if exact:
                self._queue_exact_prefix(seq, seq.token_ids[:context])
            return False
        seq.chunk_plan = None
        seq.prefix_cacheable = True
        return True

    def _queue_exact_prefix(self, seq: Sequence, ids: list[int]) -> None:
        """A background job that prefills `ids` (the request's S and chunks, in this order, not in
        the prefix cache) as a plain prompt, so that its follow-ups find them. It runs on the budget
        requests leave and gives its blocks back when a request needs them (scheduler). Not where one is queued already; at most `_MAX_EXACT_JOBS` wait at once."""
        key = (seq.cache_salt, tuple(ids))
        if key in self._exact_jobs or len(self._exact_jobs) >= _MAX_EXACT_JOBS:
            return
        job = Sequence(
            request_id=f"exact-prefix-of-{seq.request_id}",  # never in _requests: no output
            prompt_token_ids=list(ids),
            token_ids=list(ids),
            params=_ONE_DISCARDED_TOKEN,
            kind=SequenceKind.PREFIX_JOB,
            cache_salt=seq.cache_salt,
        )
        job.generator = self._generator
        self._exact_jobs[key] = job
        self.scheduler.add(job)

    def _fit_kv_cache(
        self, params: SamplingParams, own_tokens: int, prompt_len: int, copies: int = 1
    ) -> SamplingParams:
        """A request must fit the whole paged KV cache alone, or preemption could never let it
        finish: an explicit max_tokens beyond that is refused; an open one (None) is capped there,
        as it is capped at max_model_len otherwise. A fusion request's `copies` streams each get
        an equal share of it."""
        capacity = self.blocks.num_blocks // copies * self.blocks.block_size
        room = capacity - own_tokens
        if params.max_tokens is not None:
            if params.max_tokens > room:
                raise InvalidRequestError(
                    f"max_tokens ({params.max_tokens}) plus the {own_tokens} prompt tokens computed here "
                    f"exceed the KV cache of {capacity} tokens: max_tokens may be at most {room} "
                    "for this prompt",
                    "max_tokens",
                )
            return params
        if room < self.max_model_len - prompt_len:
            return dataclasses.replace(params, max_tokens=room)
        return params

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            pending = bool(self._inbox or self._aborts)
        # list() copies in one step under the GIL: safe against the step thread adding requests.
        # A tier load nobody waits for any more still ends in a step (its entry is settled).
        loading = self.chunks is not None and self.chunks.loads_pending > 0
        return pending or loading or any(not s.kind.is_fill for s in list(self._requests.values()))

    def has_background_work(self) -> bool:
        """Whether work nobody waits for is queued (canonical chunk entries, chunk/manager.py;
        exact-prefix jobs): steps run it on the budget requests leave. Call from the stepping
        thread."""
        return self.scheduler.has_background_work()

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        finished_now = self._drain_inbox()
        self._poll_chunk_loads()
        finished_now += self._finish_prewarms()
        batch = self.scheduler.schedule()
        if not batch and self.chunks is not None and self.chunks.loads_pending:
            self.chunks.wait_for_loads(_LOAD_WAIT_S)  # nothing to run until a load ends: sleep, not spin
        if batch:
            try:
                started = time.perf_counter()
                logits, rows = self.runner.run(batch)
                self.scheduler.step_took(batch, time.perf_counter() - started)
                self._postprocess(batch, logits, rows)
            except Exception as e:
                # One bad request must not stop the engine: fail this batch's requests (their KV
                # is in an unknown state), free what they held, and go on with the others.
                logger.exception("step failed; failing the %d sequences of its batch", len(batch))
                finished_now += self._fail_batch(batch, f"{type(e).__name__}: {e}")
        finished_now += self._finish_prewarms()
        outputs = self._collect_outputs(batch, finished_now)
        self._publish_events()
        return outputs

    def _fail(self, seq: Sequence, message: str) -> None:
        if seq.is_finished:
            return
        seq.finish_reason, seq.stop_reason, seq.error = "error", None, message
        self._finish(seq)

    def _fail_batch(self, batch: ScheduledBatch, message: str) -> list[Sequence]:
        """Fail every request of `batch`, and every request waiting for a fill job of it."""
        # A fusion stream's failure is its request's (which finishes all its streams).
        failed = list({id(r): r for r in (_request_of(s) for s in batch.seqs if not s.kind.is_fill)}.values())
        jobs = [s for s in batch.seqs if s.fill is not None]
        entries = [job.fill.entry for job in jobs if job.fill is not None]
        for seq in list(self._requests.values()):
            state = seq.chunks
            if seq in failed or state is None:
                continue
            if any(any(e is x for x in state.entries) for e in entries):
                failed.append(seq)
        for seq in failed:
            self._fail(seq, f"the engine failed on this request's batch: {message}")
        for job in jobs:  # jobs still wanted by a request outside the batch are not left half done
            self._fail(job, message)
        return failed

    def _drain_inbox(self) -> list[Sequence]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            # Registered under the lock: has_unfinished_requests never sees a request nowhere.
            for seq in inbox:
                self._requests[seq.request_id] = seq
        failed = []
        for seq in inbox:
            self.counters["requests"] += 1
            try:
                if (
                    self.chunks is not None
                    and seq.chunk_plan is not None
                    and not self._reads_cached_prefix(seq)
                ):
                    for job in self.chunks.admit(seq):
                        self._requests[job.request_id] = job
                        self.scheduler.add(job)
            except Exception as e:
                logger.exception("admitting %s failed", seq.request_id)
                self._fail(seq, f"admission failed: {type(e).__name__}: {e}")
                failed.append(seq)
                continue
            if seq.kind is SequenceKind.PREWARM:
                self._prewarms.append(seq)
            elif seq.fusion is not None:
                for stream in seq.fusion.streams:
                    self.scheduler.add(stream)
            else:
                self.scheduler.add(seq)
        aborted = failed
        for request_id in aborts:
            seq = self._requests.get(request_id)
            if seq is None or seq.is_finished or seq.kind.is_fill:
                continue
            seq.finish_reason = "abort"
            self._finish(seq)
            aborted.append(seq)
        return aborted

    def _poll_chunk_loads(self) -> None:
        """Chunk entries whose tier load ended: misses become fill jobs, scheduled here."""
        if self.chunks is None:
            return
        jobs, cancel = self.chunks.poll()
        for job in jobs:
            self._requests[job.request_id] = job
            self.scheduler.add(job)
        for job in cancel:
            self._finish(job)

    def _finish_prewarms(self) -> list[Sequence]:
        """Finish the prewarm requests whose entries are all computed (failed or aborted ones
        were finished where that happened)."""
        done = []
        for seq in self._prewarms:
            assert seq.chunks is not None and seq.chunk_plan is not None, "admission pinned its entries"
            if not seq.is_finished and all(e.ready for e in seq.chunks.entries):
                self.chunks.settle_cached(seq)  # type: ignore[union-attr]
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

    def _postprocess(self, batch: ScheduledBatch, logits: torch.Tensor, rows: list[int]) -> None:
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed += n
            if seq.learn is not None and seq.num_computed >= seq.num_own_prompt_tokens:
                assert self.chunks is not None
                self.chunks.learn(seq, self.runner.kv_caches)
            registrable = (
                seq.num_computed if seq.prefix_cacheable else min(seq.exact_prefix, seq.num_computed)
            )
            if registrable and not seq.kind.is_fill:
                self.blocks.register_full_blocks(
                    seq.block_table, seq.token_ids, seq.block_hashes, registrable, seq.block_keys
                )
            if seq.kind.is_fill and seq.num_computed == seq.num_tokens:
                self._finish(seq)
        if not rows:
            return
        # A fusion request's streams' rows become one row, its combined distribution.
        logits, seqs = fuse_rows(logits, [batch.seqs[r] for r in rows])
        histories = [History(s.prompt_token_ids, s.output_token_ids, s.grammar) for s in seqs]
        sampled = sample(
            logits,
            [s.params for s in seqs],
            [s.generator for s in seqs],
            histories,
            self.detokenizer.eos_token_ids,
        )
        now = time.time()
        for seq, s in zip(seqs, sampled, strict=True):
            if s.error is not None:
                self._fail(seq, s.error)
                continue
            seq.token_ids.append(s.token_id)
            if seq.fusion is not None:
                seq.fusion.append(s.token_id)
            if s.logprobs is not None:
                seq.output_logprobs.append(s.logprobs)
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            self.detokenizer.update(seq)
            if seq.finish_reason is not None:
                self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if seq.fusion is not None:  # a fusion request: its streams' blocks go back with it
            for stream in seq.fusion.streams:
                self.scheduler.finish(stream)
        seq.metrics.finished_time = time.time()
        if seq.kind is SequenceKind.PREFIX_JOB:  # its blocks are registered: nothing else to keep
            self._exact_jobs = {k: j for k, j in self._exact_jobs.items() if j is not seq}
            self.exact_prefix_jobs += seq.error is None
        if self.chunks is not None:
            for job in self.chunks.on_finish(seq):
                self._finish(job)
        if seq.kind.is_fill:
            self._requests.pop(seq.request_id, None)

    def _collect_outputs(self, batch: ScheduledBatch, finished_now: list[Sequence]) -> list[RequestOutput]:
        outputs = []
        # A fusion request's streams stand for it; each request once.
        for seq in {id(r): r for r in map(_request_of, [*batch.seqs, *finished_now])}.values():
            if seq.kind.is_fill or self._requests.get(seq.request_id) is not seq:
                continue
            new_tokens = seq.output_token_ids[seq.num_sent_tokens :]
            if not new_tokens and not seq.is_finished:
                continue
            outputs.append(self._make_output(seq))
            if seq.is_finished:
                del self._requests[seq.request_id]
                with self._lock:
                    self._ids_in_use.discard(seq.request_id)
                self.counters["prompt_tokens"] += len(seq.prompt_token_ids)
                self.counters["generated_tokens"] += seq.num_output_tokens
                self.counters["cached_tokens"] += seq.num_prefix_cached + seq.num_chunk_cached
        return outputs

    def _make_output(self, seq: Sequence) -> RequestOutput:
        new_tokens = seq.output_token_ids[seq.num_sent_tokens :]
        seq.num_sent_tokens = seq.num_output_tokens
        # While running, hold back text that could still turn out to be the start of a stop string.
        hold = 0 if seq.is_finished or not seq.params.stop else max(map(len, seq.params.stop)) - 1
        visible = max(seq.sent_text_len, len(seq.text) - hold)
        new_text = seq.text[seq.sent_text_len : visible]
        seq.sent_text_len = visible
        cached = seq.num_prefix_cached + seq.num_chunk_cached
        completion = CompletionOutput(
            index=0,
            text=seq.text,
            token_ids=list(seq.output_token_ids),
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=list(seq.prompt_token_ids),
            outputs=[completion],
            finished=seq.is_finished,
            metrics=seq.metrics,
            num_cached_tokens=cached,
            num_prefix_cached_tokens=seq.num_prefix_cached,
            num_chunk_cached_tokens=seq.num_chunk_cached,
            num_computed_tokens=len(seq.prompt_token_ids) - cached,
            num_blend_reused_tokens=seq.blend_reused_tokens,
            num_blend_recomputed_tokens=seq.blend_recomputed_tokens,
            blend_fallback=seq.blend_fallback,
            new_token_ids=new_tokens,
            new_text=new_text,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None,
            error=seq.error,
        )

    def _publish_events(self) -> None:
        events: list[Any] = self.blocks.events
        if self.chunks is not None:
            events = events + self.chunks.drain_events()
        self.blocks.events = []
        if self.publisher is not None and events:
            self.publisher.publish(events)

    # ---- introspection -----------------------------------------------------------------------

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: Any = None,
    ) -> str | PromptParts:
        """The chat rendered by the model's template. `chat_template_kwargs` are the template's own
        variables (e.g. `enable_thinking`); they cannot override the rendering arguments. `tools`
        (OpenAI's function definitions) go to templates that define tool use. `documents` (a list
        of strings or {title, text} dicts) make the result PromptParts, one chunk per document
        (chunk/documents.py); more than max_chunks of them is refused."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise InvalidRequestError(f"messages[{i}] must have a string 'role' and a string 'content'")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("the model's tokenizer has no chat template")
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(set(extra) & _RENDER_ARGUMENTS)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}")

        def render(msgs: list[dict[str, Any]], docs: list[dict[str, str]] | None) -> str:
            if docs is not None:
                extra["documents"] = docs
            else:
                extra.pop("documents", None)
            try:
                return self.tokenizer.apply_chat_template(
                    msgs,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tools=tools,
                    **extra,
                )
            except Exception as e:  # template errors are the client's messages being wrong
                raise InvalidRequestError(f"chat template failed on these messages: {e}") from None

        if documents is None:
            return render(messages, None)
        docs = parse_documents(documents, self.config.chunk.max_chunks)
        return render_with_documents(render, messages, docs, self.config.chunk.documents_format)

    def reset_prefix_cache(self) -> bool:
        ok = self.blocks.reset_prefix_cache()
        if ok and self.publisher is not None:
            self.publisher.publish([AllBlocksCleared()])
        return ok

    def reset_chunk_cache(self) -> int:
        """Evict every chunk pool entry no request holds (written down to the lower tiers first,
        where there are any); returns how many. Call between steps."""
        return 0 if self.chunks is None else self.chunks.pool.evict_all()

    def republish_state(self) -> int | None:
        """Publish the whole cache state (AllBlocksCleared, then every cached block and chunk), for
        a router whose index lost it (Redis restarted, a gap replay could not fill). Returns the
        number of events published, None without a publisher. Call between steps."""
        if self.publisher is None:
            return None
        events: list[Any] = [AllBlocksCleared(), *self.blocks.state_events()]
        if self.chunks is not None:
            events += self.chunks.state_events()
        self.publisher.publish(events)
        return len(events)

    def chunk_cache_stats(self) -> dict[str, Any] | None:
        if self.chunks is None:
            return None
        r = self.runner
        return {
            **self.chunks.stats(),
            "blend_reused_tokens": r.blend_reused_tokens,
            "blend_recomputed_tokens": r.blend_recomputed_tokens,
            "blend_fallbacks": r.blend_fallbacks,
            "blended_prefix_hits": self.blended_prefix_hits,
            "exact_prefix_hits": self.exact_prefix_hits,
            "exact_prefix_jobs": self.exact_prefix_jobs,
        }

    def stats(self) -> dict[str, Any]:
        return {
            # Requests only: fill and exact-prefix jobs are the engine's own work, a fusion
            # request's streams one request (a load-aware router reads these).
            "num_waiting": sum(map(_counts_as_request, self.scheduler.waiting)) + len(self._inbox),
            "num_running": sum(map(_counts_as_request, self.scheduler.running)),
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_free": self.blocks.num_free_blocks,
            "kv_usage": self.blocks.usage(),
            "prefix_cache_blocks": self.blocks.num_cached_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "chunk_cache": self.chunk_cache_stats(),
            **self.counters,
        }

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        if self.chunks is not None:
            self.chunks.check_integrity()
        for seq in self.scheduler.running:
            assert seq.status == Status.RUNNING, f"{seq.request_id} in running with status {seq.status}"
        for seq in self._requests.values():
            if seq.fusion is not None:
                seq.fusion.check_integrity()

    def flush_chunk_tiers(self) -> None:
        """Wait until every entry computed so far is written to the lower tiers."""
        if self.chunks is not None and self.chunks.tiers is not None:
            self.chunks.tiers.flush()

    def close(self) -> None:
        """Finish the lower tiers' writes and close them; close the event publisher."""
        if self.chunks is not None:
            self.chunks.close()
            # The tiers' last events (their writes just finished) still go out.
            self._publish_events()
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
