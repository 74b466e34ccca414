"""Request intake (vLLM v1's processor): a request as given -> a validated Sequence and its plan.

Tokenizing, rendering a chat, checking every field against the model and the cache, deciding how
the chunk cache serves the prompt (`Sequence.chunk_plan`), and building the sequence (its fusion
streams, its blend key) all happen here, on the caller's thread, before the request reaches the
step loop: a bad request is refused with an InvalidRequestError naming its field, and the loop
only ever sees sequences that can run. Intake reads only what is fixed after start (the config,
the tokenizer, the model's shape, the caches' sizes). A chat is rendered into a prompt before
it gets here (chat.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import torch

from chunkcache.chunk.documents import PromptParts
from chunkcache.chunk.parse import parse_chunked_prompt, tokenize_parts
from chunkcache.config import ChunkConfig, EngineConfig, ReuseOptions
from chunkcache.core.plan import ChunkedPrompt, ChunkPlan, PlainPrompt
from chunkcache.core.sequence import Sequence, SequenceKind
from chunkcache.core.sequence_state import FidelityCheck, PrefixKeys
from chunkcache.engine.blend import kv_options
from chunkcache.engine.build import EngineParts
from chunkcache.engine.excerpt import SpanTable
from chunkcache.engine.fusion import FusionGroup, fits_one_batch, pair_tokens, stream_count
from chunkcache.engine.kv_fit import KVFit
from chunkcache.engine.structured import StructuredOutputs
from chunkcache.errors import InvalidRequestError, PromptTooLongError
from chunkcache.fidelity.shadow import DEFAULT_CONFIG
from chunkcache.hashing import blend_key
from chunkcache.sampling import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int] | PromptParts
# Prewarm requests and exact_follow_ups jobs generate nothing anyone reads: a job is a plain
# prefill, and the one token it samples is thrown away.
ONE_DISCARDED_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


class RequestIntake:
    def __init__(self, config: EngineConfig, parts: EngineParts, generator: torch.Generator) -> None:
        self.config = config
        self.tokenizer = parts.tokenizer
        self.spec = parts.spec
        # The span table (~0.8 s for a 151k-token vocabulary) is built at load where the engine's
        # own options read excerpts, so that no request waits for it; else at first use.
        self._spans: SpanTable | None = None
        if config.chunk.enable:
            self.span_table(config.chunk)
        self.blocks = parts.blocks
        self.chunks = parts.chunks
        self.max_model_len = parts.max_model_len
        self.fit = KVFit(parts.blocks, parts.max_model_len)
        self.structured = StructuredOutputs(self.tokenizer, self.spec.vocab_size)
        self._generator = generator
        # With a fidelity profile, the configuration requests without chunk options of their own
        # get (it moves: fidelity/controller.py); else the engine's chunk options.
        self.controller = parts.controller
        # Whether chunked requests served by the engine's configuration are marked for shadow
        # checks (fidelity/shadow.py).
        self.shadowed = config.chunk.enable and config.fidelity.effective_sample_rate > 0

    def default_reuse(self) -> tuple[str, ChunkConfig]:
        """The name and chunk options of the configuration a request that gives none gets (read
        once per request, as one object: the controller moves between requests, on the step
        thread, while intake runs on others)."""
        if self.controller is None:
            return DEFAULT_CONFIG, self.config.chunk
        rung = self.controller.current
        return rung.name, rung.chunk

    # ---- requests ----------------------------------------------------------------------------

    def request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        add_special_tokens: bool,
        chunk_options: ReuseOptions | Mapping[str, object] | None,
        cache_salt: str | None,
    ) -> Sequence:
        """A request's sequence (LLMEngine.add_request); InvalidRequestError names what is wrong."""
        _check_salt(cache_salt)
        self._check_params(params)
        name, default = self.default_reuse()
        chunk_config = self.chunk_config(chunk_options, default)
        try:
            seq = self.make_sequence(request_id, prompt, params, add_special_tokens, chunk_config, cache_salt)
        except InvalidRequestError as e:
            e.param = e.param or "prompt"  # the prompt's checks (chunk parsing included) name no field
            raise
        plan = seq.chunk_plan
        own = chunk_options is not None and (
            not isinstance(chunk_options, ReuseOptions) or chunk_options.given()
        )
        if self.shadowed and not own and plan is not None and isinstance(plan.prompt, ChunkedPrompt):
            seq.fidelity = FidelityCheck(name)
        return seq

    def _check_params(self, params: SamplingParams) -> None:
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

    def chunk_config(
        self, options: ReuseOptions | Mapping[str, object] | None, default: ChunkConfig | None = None
    ) -> ChunkConfig:
        """`default` (the engine's chunk options, or the controller's configuration) where the
        request gives none, else the engine's with the request's own merged in, checked for the
        model."""
        try:
            if options is not None and not isinstance(options, ReuseOptions):
                options = ReuseOptions.from_mapping(options)
            if options is None or not options.given():
                return default if default is not None else self.default_reuse()[1]
            if self.chunks is not None:
                return self.config.chunk.with_request_options(options, self.spec.num_layers)
        except (TypeError, ValueError) as e:
            # ChunkConfig's messages start with the option's name.
            raise InvalidRequestError(str(e), param=str(e).split(" ", 1)[0]) from None
        raise InvalidRequestError(
            f"chunk options {sorted(options.given())} given, but the chunk cache is disabled"
        )

    def make_sequence(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        add_special_tokens: bool,
        chunk_config: ChunkConfig,
        cache_salt: str | None = None,
    ) -> Sequence:
        token_ids, chunked = self._tokenize(prompt, add_special_tokens, chunk_config)
        if not token_ids:
            raise InvalidRequestError("prompt is empty (no tokens)", "prompt")
        chunked = self._worth_reusing(chunked, chunk_config)
        plain = self._separator_free_candidate(token_ids, chunked, chunk_config, params, cache_salt)
        if chunked is not None:
            if params.prompt_logprobs is not None:
                raise InvalidRequestError(
                    "prompt logprobs are not available for chunked prompts (their chunks' KV is reused, "
                    "not computed in this request)"
                )
            assert self.chunks is not None
            self.chunks.validate(chunked, self.max_model_len)
        isolated = chunked is not None and chunk_config.layout != "offset"
        # Isolated: the request computes only Q (and its output); the rest is borrowed.
        own = list(chunked.question_token_ids) if isolated else token_ids  # type: ignore[union-attr]
        prompt_len = chunked.question_position() + len(own) if isolated else len(token_ids)  # type: ignore[union-attr]
        self.fit.check_length(params, prompt_len)
        copies, extra = 1, 0
        if _fused(chunked, chunk_config):
            copies = stream_count(chunked, chunk_config)  # type: ignore[arg-type]
            extra = pair_tokens(chunked, chunk_config)  # type: ignore[arg-type]  # the joint stream's documents
        self.fit.check_blocks(len(own), copies, extra)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            token_ids=list(own),
            params=self.fit.fit_params(params, len(own), prompt_len, copies, extra),
            prompt=_prompt_text(prompt),
            prefix_keys=PrefixKeys(cache_salt=cache_salt),
        )
        seq.reply.generator = (
            torch.Generator().manual_seed(params.seed) if params.seed is not None else self._generator
        )
        if params.json_schema is not None:
            seq.reply.grammar = self.structured.matcher(params.json_schema)
        reused = chunked if chunked is not None else plain
        if reused is not None:
            seq.chunk_plan = ChunkPlan(reused, chunk_config)
            seq.prefix_keys.cacheable = False
        if copies > 1:
            FusionGroup.create(seq, chunked, chunk_config, self.span_table(chunk_config))  # type: ignore[arg-type]
        if chunked is not None and chunk_config.layout == "offset":
            self._set_blend_key(seq, chunked, chunk_config)
        return seq

    def _worth_reusing(self, chunked: ChunkedPrompt | None, cfg: ChunkConfig) -> ChunkedPrompt | None:
        """The chunked prompt, or None where a plain prefill serves it as well."""
        if chunked is None:
            return None
        if cfg.layout == "fusion" and len(chunked.chunks) < 2:
            return None  # one document: its one stream is the plain prompt, exact as it is
        if cfg.layout == "fusion" and not fits_one_batch(
            streams := stream_count(chunked, cfg), self.config.scheduler
        ):
            limits = self.config.scheduler
            logger.info(
                "%d documents make %d fusion streams, more than one batch holds (max_num_seqs %d, "
                "max_num_batched_tokens %d): served as a plain prefill",
                len(chunked.chunks),
                streams,
                limits.max_num_seqs,
                limits.max_num_batched_tokens,
            )
            return None
        context = chunked.num_tokens - len(chunked.question_token_ids) - len(chunked.sys_token_ids)
        if cfg.layout == "offset" and context < cfg.blend_min_tokens:
            return None  # too little to reuse: a plain prefill is as fast
        return chunked

    def _separator_free_candidate(
        self,
        token_ids: list[int],
        chunked: ChunkedPrompt | None,
        cfg: ChunkConfig,
        params: SamplingParams,
        cache_salt: str | None,
    ) -> PlainPrompt | None:
        """Separator-free matching: a plain prompt is cut at admission, where the pool is known."""
        on = chunked is None and self.chunks is not None and cfg.separator_free and cfg.layout != "isolated"
        if on and params.prompt_logprobs is None and cache_salt is None:
            return PlainPrompt(tuple(token_ids), params.max_tokens)
        return None

    def fuse(self, seq: Sequence, prompt: ChunkedPrompt, cfg: ChunkConfig, reserve: int) -> bool:
        """Admission (ChunkSteps.admit, on the step thread, between ChunkManager.propose and
        .admit): make a separator-free request, cut into documents, a fusion request over them
        (its own tokens Q, one stream per document), if its streams fit one batch and, with its
        max_tokens (an open one capped for them, as for a chunked prompt), the KV cache beside
        `reserve` blocks (its entries, should the pool refuse them); False leaves it untouched (it
        runs as a plain prefill)."""
        assert seq.chunk_plan is not None and isinstance(seq.chunk_plan.prompt, PlainPrompt)
        requested = seq.chunk_plan.prompt.max_tokens
        copies = stream_count(prompt, cfg)
        if not fits_one_batch(copies, self.config.scheduler):
            return False
        own, extra = len(prompt.question_token_ids), pair_tokens(prompt, cfg)
        room = self.fit.room(own, copies, extra, reserve)
        if room < 1 or (requested is not None and requested > room):
            return False
        open_room = self.max_model_len - len(seq.prompt_token_ids)
        max_tokens = requested if requested is not None or room >= open_room else room
        seq.params = dataclasses.replace(seq.params, max_tokens=max_tokens)
        seq.token_ids = list(prompt.question_token_ids)
        seq.num_own_prompt_tokens = own
        FusionGroup.create(seq, prompt, cfg, self.span_table(cfg))
        return True

    def span_table(self, cfg: ChunkConfig) -> SpanTable | None:
        """The tokenizer's span table where `cfg` reads joint-stream excerpts (built at first use)."""
        if not cfg.fusion_joint_excerpt or cfg.fusion_joint_blend:
            return None
        if self._spans is None:
            self._spans = SpanTable.of(self.tokenizer, self.spec.vocab_size)
        return self._spans

    def unfuse(self, seq: Sequence) -> bool:
        """Admission (FollowUps, on the step thread): make a fusion request whose S and documents
        the prefix cache holds exactly a plain request over its whole prompt (the cached prefix
        read, the rest computed), its streams dropped before they are scheduled or hold anything.
        False, leaving it untouched, where that prompt with its max_tokens (an open one capped as
        for any plain prompt; one capped for the streams kept) does not fit max_model_len or the
        KV cache: its streams, each shorter, serve it."""
        assert seq.fusion is not None
        full = len(seq.prompt_token_ids)
        requested = seq.params.max_tokens
        room = self.fit.room(full, 1, 0)
        if room < 1 or (requested is not None and requested > room):
            return False
        if full + (requested or 1) > self.max_model_len:
            return False
        if requested is None and room < self.max_model_len - full:
            seq.params = dataclasses.replace(seq.params, max_tokens=room)
        seq.fusion = None
        seq.token_ids = list(seq.prompt_token_ids)
        seq.num_own_prompt_tokens = full
        return True

    def _set_blend_key(self, seq: Sequence, chunked: ChunkedPrompt, cfg: ChunkConfig) -> None:
        """Layout "offset": the key its blended blocks are registered (and found) under."""
        options = kv_options(cfg)
        if not chunked.chunks or not self.blocks.enable_prefix_caching or options is None:
            return
        parts = [len(chunked.sys_token_ids), *map(len, chunked.chunks)]
        seq.prefix_keys.kv_key = blend_key(options, parts, cfg.hash_algorithm)
        # S and the first chunk hold a plain prefill's KV (the runner's exact prefix): their
        # blocks keep plain hashes, which any prompt with that prefix may find.
        seq.prefix_keys.kv_key_from = (parts[0] + parts[1]) // self.blocks.block_size

    def _tokenize(
        self, prompt: Prompt, add_special_tokens: bool, chunk_config: ChunkConfig
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

    # ---- prewarm -----------------------------------------------------------------------------

    def prewarm(
        self,
        request_id: str,
        prompt: str | None,
        system: str | None,
        documents: list[str] | None,
        cache_salt: str | None,
        add_special_tokens: bool,
        max_tokens: int | None,
    ) -> Sequence:
        """A prewarm's sequence (LLMEngine.add_prewarm): its chunked prompt's entries, no question."""
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
        return Sequence(
            request_id=request_id,
            prompt_token_ids=chunked.all_token_ids(),
            token_ids=[],
            params=ONE_DISCARDED_TOKEN,
            prompt=prompt,
            kind=SequenceKind.PREWARM,
            chunk_plan=ChunkPlan(chunked, self.default_reuse()[1]),
            prefix_keys=PrefixKeys(cacheable=False, cache_salt=cache_salt),
        )

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


def _fused(chunked: ChunkedPrompt | None, cfg: ChunkConfig) -> bool:
    return chunked is not None and cfg.layout == "fusion"


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


def _prompt_text(prompt: Prompt) -> str | None:
    """The prompt as text, as reported back (None for token ids)."""
    if isinstance(prompt, PromptParts):
        return prompt.text()
    return prompt if isinstance(prompt, str) else None
