"""The one frozen configuration tree of an engine.

Values discovered at run time (the model's shape, the number of KV blocks that fit) live in state
objects (`model.loader.ModelSpec`, `core.kv_blocks.BlockManager`), never in a mutated config.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chunkcache import envs
from chunkcache.hashing import BLOCK_HASH_ALGORITHMS, block_hash_fn
from chunkcache.model.catalog import GENERIC_DEFAULTS, identify  # pure data: loads no torch

CHUNK_LAYOUTS = ("isolated", "offset", "fusion")
# How layout "fusion" combines its streams' next-token distributions (engine/fusion.py).
FUSION_RULES = ("max_confidence", "product", "contrastive")
# Layout "fusion"'s joint stream S + Ci + ... + Ck + Q over the documents whose streams find Q most
# likely (the pair stream, k = 2, unless `fusion_max_joint` allows more): none, one more expert
# under the rule, or the only document stream (engine/fusion.py).
FUSION_PAIRS = ("none", "expert", "lead")
BLEND_SELECTORS = ("k_deviation", "v_deviation", "threshold", "query_attention", "stored_deviation")
BLEND_UNITS = ("token", "chunk")
# Selectors that rank by how the fresh KV at the check layer differs from the cached KV.
_FRESH_KV_SELECTORS = ("k_deviation", "v_deviation", "threshold")
HASH_ALGORITHMS = ("sha256", "sha512", "blake2b", "sha3_256")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# How the projections hold their weights (model/quant.py, whose WEIGHTS is this same tuple).
WEIGHTS = ("dense", "native", "int8", "auto")
# How a chat request's documents are written into the conversation (chunk/documents.py).
# `{title}` is the document's title and a newline, or nothing for a document without a title.
DEFAULT_DOCUMENTS_FORMAT = "{title}{text}\n\n"


def check_documents_format(documents_format: str) -> None:
    """ValueError unless the format names {text} and only {title} and {text}."""
    if "{text}" not in documents_format:
        raise ValueError(f"documents_format must contain {{text}}, got {documents_format!r}")
    try:
        documents_format.format(title="", text="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"documents_format {documents_format!r} may only use {{title}} and {{text}}: {e}"
        ) from None


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache and prefix caching."""

    block_size: int = 16
    # KV budget: a number of tokens wins over a memory size; neither = a default of 0.5 GiB.
    # Committed when the engine starts (ModelRunner: its pages mapped before the first request).
    kv_cache_tokens: int | None = None
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True
    # Seed of the first block's parent hash; PYTHONHASHSEED sets it. None = 32 random bytes per
    # process, as current vLLM does without PYTHONHASHSEED (chunkcache/hashing.py).
    hash_seed: str | None = None
    # vLLM's --prefix-caching-hash-algo: sha256 (pickle; vLLM's default), sha256_cbor, xxhash, xxhash_cbor.
    prefix_caching_hash_algo: str = "sha256"

    def validate(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        block_hash_fn(self.prefix_caching_hash_algo)
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens must hold at least one block ({self.block_size}), got {self.kv_cache_tokens}"
            )
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # A prefill longer than this runs in pieces of at most this many tokens per step, after the
    # step's decodes and short prompts (vLLM's option of the same name). Default by measurement
    # (benchmarks/RESULTS.md "bench_mixed_load"): a short request beside a long prompt waits about
    # two pieces, so smaller pieces answer it sooner, while below 256 the long prompt itself slows.
    long_prefill_token_threshold: int = 256
    # Long prefills computed at once (vLLM V0's option of the same name): the oldest run, the
    # others wait, first come first served; short prompts still pass them. With every long prefill
    # a piece per step, requests arriving together all ended their prefills near the last one's
    # end, worse than serving them one after another (benchmarks/RESULTS.md "bench_burst").
    max_long_partial_prefills: int = 1
    # While streams decode, long prefills and background work run only while the streams' decode
    # rate is at least this share of their rate in decode-only steps (engine/decode_guard.py);
    # 0 = off. The issue 35 target: 0.5.
    min_decode_share: float = 0.5
    # None = the model's max_position_embeddings.
    max_model_len: int | None = None

    def validate(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if not 0 <= self.min_decode_share < 1:
            raise ValueError(f"min_decode_share must be in [0, 1), got {self.min_decode_share}")
        if self.max_long_partial_prefills <= 0:
            raise ValueError(f"max_long_partial_prefills must be > 0, got {self.max_long_partial_prefills}")
        if self.long_prefill_token_threshold <= 0:
            raise ValueError(
                f"long_prefill_token_threshold must be > 0, got {self.long_prefill_token_threshold}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")


@dataclass(frozen=True)
class ChunkConfig:
    """Chunked prompts `S SEP C1 SEP ... SEP Cn SEP Q` (docs/design.md §2-3)."""

    enable: bool = True
    separator: str = " # # "
    cache_size_gb: float = 2.0
    lru_threshold: float = 0.9
    hash_algorithm: str = "sha256"
    # "isolated": chunks share one position range, Q sees them as computed (exact, no recompute).
    # "offset": chunks at their natural positions (cached K re-rotated), then blend.
    # The defaults read from `GENERIC_DEFAULTS` (layout, fusion's rule, amateur, pair stream and
    # streams; weights and int8 activations below) depend on the model: they are written, with
    # why, in model/catalog.py, beside each known model's own.
    layout: str = GENERIC_DEFAULTS["chunk_layout"]
    # "fusion": one stream per chunk, S + Ci + Q, each exactly the KV the pool holds (only Q is
    # computed), decoded together; each step their next-token distributions are combined into
    # one by `fusion_rule` (engine/fusion.py) and the token chosen is appended to every stream.
    # "max_confidence": the stream with the highest top probability decides; "product": a
    # product of experts weighted by each stream's relevance (softmax over the streams of the
    # mean log-likelihood it gives Q's tokens); "contrastive": PCED (arXiv 2601.08670): each
    # stream contrasted with the no-document stream, (1 + beta) log p_i - beta log p_0, the
    # stream with the highest top score plus gamma x relevance decides.
    fusion_rule: str = GENERIC_DEFAULTS["fusion_rule"]
    # Add the no-document stream S + Q (PCED's amateur): the contrast of "contrastive" (which
    # needs it), one more expert (the model's own knowledge) under the other rules.
    fusion_amateur: bool = GENERIC_DEFAULTS["fusion_amateur"]
    # "contrastive": beta (the contrast's strength) and gamma (the relevance's weight). beta 0.1
    # by a quick sweep on SmolLM2's tune questions: a stronger contrast, or no relevance, answered
    # fewer right (benchmarks/RESULTS.md "bench_fidelity").
    fusion_contrast_weight: float = 0.1
    fusion_relevance_weight: float = 2.5
    # A question that needs two documents has no stream that sees both: after the first step
    # (every stream's Q computed, so its relevance known) "expert" adds the exact stream
    # S + Ci + Cj + Q over the two most relevant documents (Ci read from the pool, Cj + Q
    # computed: |Cj| more prefill tokens, before the first token) as one more expert of the rule;
    # "lead" makes it the only document stream the rule reads (the others still run, unread).
    fusion_pair: str = GENERIC_DEFAULTS["fusion_pair"]
    # The pair stream joins only when the two most relevant documents are close: their streams'
    # relevance (mean log-likelihood of Q's tokens, nats) differ by at most this. A question about
    # one document names it, so its stream stands out and the request decodes on without the pair
    # (no document prefilled); a question about two names both. 100: always (a mean
    # log-likelihood gap of 100 nats per token does not occur).
    fusion_pair_margin: float = GENERIC_DEFAULTS["fusion_pair_margin"]
    # The joint stream's most documents: it reads every document whose relevance is within
    # `fusion_pair_margin` of the most relevant one's, the most relevant first, up to this many
    # (>= 2; 2 is the pair stream). Each document beyond the first is prefilled in the stream
    # (|Cj| tokens before the first token), so k costs k - 1 documents' prefill.
    fusion_max_joint: int = GENERIC_DEFAULTS["fusion_max_joint"]
    # At most this many document streams decode past the first step (0: all): after it, every
    # stream's relevance is known and only the most relevant ones go on (the others' KV blocks and
    # decode rows are freed), so a prompt of 16-32 documents decodes like one of a few.
    fusion_max_streams: int = GENERIC_DEFAULTS["fusion_max_streams"]
    # The joint stream's documents after the first are not prefilled but blended (layout offset's
    # mechanism, the blend_* options): their cached KV re-rotated to their place, the share the
    # selector picks recomputed, S and the first document exact. Cheaper than prefilling them, but
    # it lost answers on alike documents (benchmarks/RESULTS.md "bench_rag_shape"), so it is off.
    # Only under fusion_pair "lead" (the joint stream computes no relevance of its own for "expert").
    fusion_joint_blend: bool = False
    # The joint stream reads at most this many tokens of each document after its first (0: all of
    # them): the document's first span and the lines (or sentences) that share the question's words
    # (engine/excerpt.py), computed exactly after the first. Its prefill shrinks from |Cj| to this
    # per document; what an excerpt leaves out only the joint stream misses. Not read where
    # `fusion_joint_blend` blends the whole documents instead.
    fusion_joint_excerpt: int = GENERIC_DEFAULTS["fusion_joint_excerpt"]
    # Lower tiers under the pool (chunkcache/chunk/tiers/): a local directory of safetensors files
    # within `disk_gb`, and a Redis shared by replicas (`redis://host:port/db`). None = no tier.
    disk_dir: str | None = None
    disk_gb: float = 10.0
    remote: str | None = None
    # More chunks than this in one prompt is rejected: each chunk is a pool entry and a job.
    max_chunks: int = 256
    # Blend (layout "offset"): at check layer j keep the share ratios[j] of all chunk tokens
    # with the largest score, chosen among the tokens kept so far. The selector scores: the
    # deviation each chunk entry measured once and stored (`stored_deviation`, known before layer
    # 0, so the others never run); or, measured at the check layer (>= 1), the fresh K's or V's
    # deviation from the cached one (`k_deviation`, `v_deviation`, CacheBlend), or the
    # attention the question pays (`query_attention`).
    # Default by measurement (benchmarks/RESULTS.md "bench_fidelity"): k_deviation at 15% at layer
    # 1. stored_deviation before layer 0 kept no more of full prefill's answers on the held-out half,
    # faster warm, but measuring a new document's score costs its first request about one more
    # prefill of it (RESULTS.md "bench_sensitivity").
    blend_check_layers: tuple[int, ...] = (1,)
    blend_recompute_ratios: tuple[float, ...] = (0.15,)
    blend_selector: str = "k_deviation"
    # "token": recompute the selected tokens; "chunk": whole chunks, ranked by their summed
    # selector score, as many as fit in the same token budget (ratio x chunk tokens).
    blend_unit: str = "token"
    # Selector "threshold": keep tokens whose |K_fresh - K_cached|^2 / |K_cached|^2 exceeds it.
    blend_threshold: float = 0.1
    # EPIC: the first k tokens of every chunk are always recomputed (combinable with a selector).
    blend_boundary_tokens: int = 0
    # Requests with fewer chunk tokens than this get a plain prefill instead of a blend.
    blend_min_tokens: int = 0
    # APE (Yang et al. 2025), both layouts: the tokens after the chunks attend to the chunks with
    # temperature T and the chunks' total attention multiplied by s (model.calibration
    # .ContextCalibration). 1.0 and 1.0 are exact attention and cost nothing.
    calibration_temperature: float = 1.0
    calibration_scale: float = 1.0
    # How a chat request's `documents` are written into the conversation when its chat template
    # does not render documents itself (chunk/documents.py): `{title}` is the title and a newline
    # (or nothing), `{text}` the text. Each formatted document is one chunk.
    documents_format: str = DEFAULT_DOCUMENTS_FORMAT
    # Separator-free matching (chunk/matcher.py, layouts "offset" and "fusion"; under "fusion" a
    # prompt with two or more matched documents gets one exact stream each, docs/chunk-cache.md
    # "Separator-free matching under fusion"): a plain prompt is searched
    # for spans that are cached chunks, found by content-defined anchors and verified token by
    # token; matched runs of at least `separator_free_min_tokens` are reused, the rest is computed
    # and cached, so that later prompts find it. Off by default, by measurement (benchmarks/
    # RESULTS.md "bench_separator_free"): it reuses reordered documents' KV, much faster warm, but
    # keeps far fewer than the 95% of full prefill's answers the defaults are chosen by, while a
    # plain prompt is exact without it.
    separator_free: bool = False
    separator_free_min_tokens: int = 32
    # Layouts "offset" and "fusion": after a chunked request, a background job (on spare budget)
    # prefills its S and documents in that order as a plain prompt into the prefix cache; a later
    # request with the same S and documents in the same order (a follow-up question, a repeated
    # query) reads that exact KV and is answered as a full prefill would answer it, computing only
    # its question (under fusion: one plain sequence, no streams; engine/follow_ups.py). On by
    # default since session 50 (benchmarks/RESULTS.md "bench_llamacpp": the 1.5B's same-order RAG
    # 0.40x -> 1.16x llama.cpp, random orders unchanged, no job queued for an order seen once);
    # off before, when the job still ran beside requests' prefills and made a repeated order's
    # next requests slower (benchmarks/history/RESULTS-narrative.md "exact_follow_ups on by
    # default (sights 2)?"). The job never runs beside a request's prefill (engine/scheduler.py);
    # a repeated order is exact from its third request (sights 2). Offline, `LLM.generate` waits for
    # the jobs. Tools that run a full-prefill reference beside reuse modes in one engine keep it
    # off whatever the user sets (fidelity/measure.py ENGINE_OPTIONS): the reference would leave an
    # exact prefix. Without prefix caching it does nothing.
    exact_follow_ups: bool = True
    # Layouts "offset" and "fusion": a chunked request whose S and documents, in this order, are in
    # the prefix cache as a plain prefill's KV (a plain request's, a separator-free first sight's,
    # an exact_follow_ups job's) runs as that plain prompt: it computes only its question and is
    # answered as a full prefill answers it, never dearer than the reuse it replaces (issue 56: an
    # exact repeat costs no more than a prefix cache). On by default; exact_follow_ups implies it.
    # Tools that measure reuse modes beside a full prefill in one engine turn it off
    # (fidelity/measure.py ENGINE_OPTIONS): the full prefill would leave the exact prefix.
    exact_prefix_reads: bool = True
    # How many requests must show an order (S and documents in this order, one salt) before its
    # job is queued: 1, the first; 2, a repeat, so that a workload whose orders never repeat
    # (random retrieval) pays no job and its jobs evict nothing, while a repeated order is exact
    # from its third request on.
    exact_follow_ups_sights: int = 2

    def validate(self, num_layers: int | None = None) -> None:
        if not self.separator:
            raise ValueError("chunk_separator must not be empty")
        if not math.isfinite(self.cache_size_gb) or self.cache_size_gb < 0:
            raise ValueError(f"chunk_cache_size_gb must be >= 0, got {self.cache_size_gb}")
        if not 0.0 < self.lru_threshold <= 1.0:
            raise ValueError(f"chunk_cache_lru_threshold must be in (0, 1], got {self.lru_threshold}")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(
                f"chunk_cache_hash_algorithm {self.hash_algorithm!r} is not one of {HASH_ALGORITHMS}"
            )
        if self.layout not in CHUNK_LAYOUTS:
            raise ValueError(f"chunk_layout {self.layout!r} is not one of {CHUNK_LAYOUTS}")
        if self.max_chunks <= 0:
            raise ValueError(f"max_chunks must be > 0, got {self.max_chunks}")
        if not math.isfinite(self.disk_gb) or self.disk_gb <= 0:
            raise ValueError(f"chunk_cache_disk_gb must be > 0, got {self.disk_gb}")
        if self.remote is not None and not self.remote.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"chunk_cache_remote must be a redis://host:port/db URL, got {self.remote!r}")
        check_documents_format(self.documents_format)
        self._validate_fusion()
        sights = self.exact_follow_ups_sights
        if isinstance(sights, bool) or not isinstance(sights, int) or sights < 1:
            raise ValueError(
                f"exact_follow_ups_sights must be an integer >= 1, got {self.exact_follow_ups_sights!r}"
            )
        if self.separator_free_min_tokens < 1:
            raise ValueError(f"separator_free_min_tokens must be >= 1, got {self.separator_free_min_tokens}")
        self._validate_blend(num_layers)
        self._validate_calibration()

    def _validate_fusion(self) -> None:
        if self.fusion_rule not in FUSION_RULES:
            raise ValueError(f"fusion_rule {self.fusion_rule!r} is not one of {FUSION_RULES}")
        if not isinstance(self.fusion_amateur, bool):
            raise ValueError(f"fusion_amateur must be true or false, got {self.fusion_amateur!r}")
        if self.fusion_pair not in FUSION_PAIRS:
            raise ValueError(f"fusion_pair {self.fusion_pair!r} is not one of {FUSION_PAIRS}")
        if self.fusion_rule == "contrastive" and not self.fusion_amateur:
            raise ValueError("fusion_amateur must be true for fusion_rule 'contrastive' (its contrast)")
        for name in ("fusion_contrast_weight", "fusion_relevance_weight", "fusion_pair_margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 100:
                raise ValueError(f"{name} must be a number in [0, 100], got {value!r}")
        if not isinstance(self.fusion_joint_blend, bool):
            raise ValueError(f"fusion_joint_blend must be true or false, got {self.fusion_joint_blend!r}")
        if self.fusion_joint_blend and self.fusion_pair == "expert":
            raise ValueError("fusion_joint_blend needs fusion_pair 'lead' (or 'none'), not 'expert'")
        for name, low, high in (
            ("fusion_max_joint", 2, 1024),
            ("fusion_max_streams", 0, 1024),
            ("fusion_joint_excerpt", 0, 1 << 20),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")

    def _validate_blend(self, num_layers: int | None) -> None:
        """Blend's options, group by group in a fixed order (the first failing check is the error a
        request's 400 names): check layers, their ratios, the selector (whose layer-0 rule reads
        both), the amounts. Each group relies on the ones before it (a layer at least, one ratio
        per layer), so the order is part of the behaviour."""
        layers, ratios = tuple(self.blend_check_layers), tuple(self.blend_recompute_ratios)
        self._validate_blend_layers(layers, num_layers)
        self._validate_blend_ratios(layers, ratios)
        self._validate_blend_selector(layers, ratios)
        self._validate_blend_amounts()

    def _validate_blend_layers(self, layers: tuple[int, ...], num_layers: int | None) -> None:
        """The check layers: at least one, increasing, and inside the model where this config
        blends (layout offset, or fusion's blended joint stream; `num_layers` None: not known yet)."""
        if not layers:
            raise ValueError("blend_check_layers must name at least one layer")
        if any(not isinstance(x, int) or x < 0 for x in layers) or list(layers) != sorted(set(layers)):
            raise ValueError(
                f"blend_check_layers must be increasing non-negative integers, got {list(layers)}"
            )
        blends = self.layout == "offset" or (self.layout == "fusion" and self.fusion_joint_blend)
        if num_layers is not None and blends and layers[-1] >= num_layers:
            raise ValueError(
                f"blend_check_layers {list(layers)} out of range: the model has {num_layers} layers"
            )

    @staticmethod
    def _validate_blend_ratios(layers: tuple[int, ...], ratios: tuple[float, ...]) -> None:
        """One ratio per check layer, each a share, none above the one before: each check layer
        keeps a share of the tokens the previous one kept (gradual filtering)."""
        if len(ratios) != len(layers):
            raise ValueError(
                f"blend_recompute_ratios {list(ratios)} must give one ratio per check layer {list(layers)}"
            )
        if any(not 0.0 <= r <= 1.0 for r in ratios):
            raise ValueError(f"blend_recompute_ratios must be in [0, 1], got {list(ratios)}")
        if list(ratios) != sorted(ratios, reverse=True):
            raise ValueError(
                f"blend_recompute_ratios must not increase (gradual filtering), got {list(ratios)}"
            )

    def _validate_blend_selector(self, layers: tuple[int, ...], ratios: tuple[float, ...]) -> None:
        """The selector and the unit it ranks, and the one place they meet the layers: a selector
        comparing fresh and cached KV has nothing to compare at layer 0 (they differ by rounding
        only), so it may not choose there."""
        if self.blend_selector not in BLEND_SELECTORS:
            raise ValueError(f"blend_selector {self.blend_selector!r} is not one of {BLEND_SELECTORS}")
        if self.blend_unit not in BLEND_UNITS:
            raise ValueError(f"blend_unit {self.blend_unit!r} is not one of {BLEND_UNITS}")
        if self.blend_unit == "chunk" and self.blend_selector == "threshold":
            raise ValueError("blend_unit 'chunk' needs a ranking selector, not 'threshold'")
        chooses = self.blend_selector == "threshold" or 0.0 < ratios[0] < 1.0
        if layers[0] == 0 and self.blend_selector in _FRESH_KV_SELECTORS and chooses:
            raise ValueError(
                f"blend_selector {self.blend_selector!r} compares fresh and cached KV, which at check "
                "layer 0 differ by rounding only: give blend_check_layers from 1, or blend_selector "
                "'stored_deviation'"
            )

    def _validate_blend_amounts(self) -> None:
        """The threshold and token counts. Plain checks in order, not a table of conditions: a
        table would compare every value before raising, so a value of the wrong type (a
        TypeError) could pre-empt an earlier option's ValueError."""
        if not math.isfinite(self.blend_threshold) or self.blend_threshold < 0:
            raise ValueError(f"blend_threshold must be a finite number >= 0, got {self.blend_threshold}")
        if self.blend_boundary_tokens < 0:
            raise ValueError(f"blend_boundary_tokens must be >= 0, got {self.blend_boundary_tokens}")
        if self.blend_min_tokens < 0:
            raise ValueError(f"blend_min_tokens must be >= 0, got {self.blend_min_tokens}")

    def _validate_calibration(self) -> None:
        """APE's temperature and scale (both layouts): positive and finite, 1.0 being exact."""
        for name in ("calibration_temperature", "calibration_scale"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value}")

    def with_request_options(self, options: ReuseOptions, num_layers: int | None) -> ChunkConfig:
        """This config with a request's own chunk options, validated for the model."""
        fields = {REQUEST_CHUNK_OPTIONS[name]: value for name, value in options.given().items()}
        merged = dataclasses.replace(self, **fields)
        merged.validate(num_layers)
        return merged


@dataclass(frozen=True)
class ReuseOptions:
    """The chunk options one request may set for itself; None = the engine's (ChunkConfig's).

    Declared once, here: the server's protocol derives its extension fields from these (same
    names, same types), `LLM.generate(chunk_options=...)` and `LLMEngine.add_request` take them,
    and `ChunkConfig.with_request_options` merges them into the ChunkConfig that the chunk
    manager, the runner's blend and fusion read. Values are checked there, by ChunkConfig.validate,
    whose messages start with the option's name (the field a 400 names).
    """

    chunk_layout: str | None = None
    blend_check_layers: tuple[int, ...] | None = None
    blend_recompute_ratios: tuple[float, ...] | None = None
    blend_selector: str | None = None
    blend_unit: str | None = None
    blend_threshold: float | None = None
    blend_boundary_tokens: int | None = None
    blend_min_tokens: int | None = None
    calibration_temperature: float | None = None
    calibration_scale: float | None = None
    separator_free: bool | None = None
    separator_free_min_tokens: int | None = None
    fusion_rule: str | None = None
    fusion_amateur: bool | None = None
    fusion_contrast_weight: float | None = None
    fusion_relevance_weight: float | None = None
    fusion_pair: str | None = None
    fusion_pair_margin: float | None = None
    fusion_max_joint: int | None = None
    fusion_max_streams: int | None = None
    fusion_joint_blend: bool | None = None
    fusion_joint_excerpt: int | None = None

    @classmethod
    def from_mapping(cls, options: Mapping[str, object]) -> ReuseOptions:
        """From flat names (a dict of the offline API, a benchmark's mode); lists become tuples.
        An unknown name is a ValueError naming it."""
        unknown = sorted(set(options) - set(REQUEST_CHUNK_OPTIONS))
        if unknown:
            raise ValueError(
                f"unknown per-request chunk option {unknown[0]!r}; known: {sorted(REQUEST_CHUNK_OPTIONS)}"
            )
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
        return cls(**values)  # type: ignore[arg-type]

    def given(self) -> dict[str, object]:
        """The options this request sets (not None), by name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def to_mapping(self) -> dict[str, object]:
        """The options set, tuples as lists: what `from_mapping` reads back (a profile's JSON)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.given().items()}

    @classmethod
    def checked(cls, options: Mapping[str, object]) -> ReuseOptions:
        """`from_mapping`, with each value's type checked and the values checked as ChunkConfig
        checks them over its defaults (the model's depth is not known: check layers out of range
        are found when the engine merges them). For options read from a file (a fidelity profile),
        so that a malformed one is an error at start, not when a request first uses it. A
        ValueError names the field."""
        hints = typing.get_type_hints(cls)
        for name, value in options.items():
            if name in hints and value is not None and not _has_type(value, hints[name]):
                raise ValueError(f"{name} must be {_type_name(hints[name])}, got {value!r}")
        reuse = cls.from_mapping(options)
        ChunkConfig().with_request_options(reuse, None)
        return reuse


def _has_type(value: object, tp: Any) -> bool:
    """Whether a JSON-read `value` fits a ReuseOptions field's type (`X | None`; X a scalar or
    tuple[X, ...], given as a list); an int is a float, a bool is neither."""
    (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        return isinstance(value, list | tuple) and all(_has_type(v, item | None) for v in value)
    if isinstance(value, bool) or tp is bool:
        return tp is bool and isinstance(value, bool)
    return isinstance(value, int | float) and math.isfinite(value) if tp is float else isinstance(value, tp)


def _type_name(tp: Any) -> str:
    (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is tuple:
        return {int: "a list of integers", float: "a list of numbers"}[typing.get_args(tp)[0]]
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]


# ReuseOptions name -> the ChunkConfig field it overrides (the same name, but for the layout).
REQUEST_CHUNK_OPTIONS: dict[str, str] = {
    f.name: "layout" if f.name == "chunk_layout" else f.name for f in dataclasses.fields(ReuseOptions)
}


@dataclass(frozen=True)
class KVEventsConfig:
    """Publishing cache changes in vLLM's KV event wire format (docs/design.md §4). Off by default."""

    endpoint: str | None = None
    # None = `kv@<instance>@<model>`, resolved at run time.
    topic: str | None = None
    replay_endpoint: str | None = None
    # How many published batches the replay socket can serve.
    buffer_steps: int = 10_000
    # ZMQ CURVE (chunkcache/curve.py): this engine's secret certificate file; the directory of
    # public keys (*.key) allowed to connect to its bound sockets (the routers); the router's
    # public key file when the PUB socket connects to a router.
    curve_secret_key: str | None = None
    curve_authorized_keys: str | None = None
    curve_server_key: str | None = None
    # Bind the endpoints on non-loopback addresses without CURVE (kv_sockets.guarded_bind_endpoint).
    insecure: bool = False

    def validate(self) -> None:
        curve = (self.curve_authorized_keys, self.curve_server_key)
        if self.curve_secret_key is None and any(k is not None for k in curve):
            raise ValueError(
                "kv_events_curve_* keys need kv_events_curve_secret_key (this engine's certificate)"
            )


@dataclass(frozen=True)
class FidelityConfig:
    """The fidelity gate (chunkcache/fidelity/gate.py): with a target, the engine reads the model's
    profile (written by `chunkcache calibrate`) at start and serves chunked prompts with the
    fastest reuse configuration that kept at least `target` of full prefill's replies/answers."""

    # Share of full prefill's replies/answers to keep, in (0, 1]; None = the gate is off.
    target: float | None = None
    # A profile file, or a folder of profiles named by model identity; None = envs.fidelity_dir().
    profile: str | None = None
    # Share of chunked requests served by the engine's configuration that are re-run as a full
    # prefill in background time and compared (fidelity/shadow.py), in [0, 1]; None = 0.01 with a
    # target, else 0 (`effective_sample_rate`).
    sample_rate: float | None = None
    # A sampled reply (temperature > 0) is compared by its next-token distributions over its first
    # this many tokens, the shadow teacher-forced on the served reply (a greedy one token by token).
    distribution_steps: int = 4
    # Shadow checks the controller (fidelity/controller.py) judges a configuration by, and waits
    # for after each move: no move comes sooner than this many checks of the new configuration.
    window: int = 20
    # The controller steps back towards speed only while agreement >= target + margin.
    margin: float = 0.02
    # The most share of the engine's step CPU time shadow checks may take, in (0, 1]: a drawn
    # request is not checked while their share is above it. A check costs a full prefill, so at a
    # fixed rate its share grows with reuse's speed-up (~8% at 0.01 on warm SmolLM2 prompts).
    max_share: float = 0.05

    @property
    def effective_sample_rate(self) -> float:
        if self.sample_rate is not None:
            return float(self.sample_rate)
        return 0.01 if self.target is not None else 0.0

    def validate(self) -> None:
        """The gate's shares, then the shadow checks' settings, then the profile (read only by a
        gate): in this order, the first failing check is the error."""
        self._validate_shares()
        self._validate_checks()
        if self.profile is not None and self.target is None:
            raise ValueError(
                "fidelity_profile is read only with fidelity_target (the share of full prefill's "
                "answers to keep, e.g. 0.95)"
            )

    def _validate_shares(self) -> None:
        """What the gate keeps and how much of the traffic it re-runs: fractions, or None (off,
        or the default rate)."""
        t = self.target
        if t is not None and not (_finite_number(t) and 0 < t <= 1):
            raise ValueError(f"fidelity_target must be a fraction in (0, 1], got {t!r}")
        r = self.sample_rate
        if r is not None and not (_finite_number(r) and 0 <= r <= 1):
            raise ValueError(f"fidelity_sample_rate must be a fraction in [0, 1], got {r!r}")

    def _validate_checks(self) -> None:
        """How shadow checks compare and how the controller judges them: counts and shares, each
        given (no None)."""
        k = self.distribution_steps
        if not (_integer(k) and 1 <= k <= 64):
            raise ValueError(f"fidelity_distribution_steps must be an integer in [1, 64], got {k!r}")
        if not (_integer(self.window) and self.window >= 1):
            raise ValueError(f"fidelity_window must be an integer >= 1, got {self.window!r}")
        m = self.margin
        if not (_finite_number(m) and 0 <= m < 1):
            raise ValueError(f"fidelity_margin must be in [0, 1), got {m!r}")
        c = self.max_share
        if not (_finite_number(c) and 0 < c <= 1):
            raise ValueError(f"fidelity_max_share must be a fraction in (0, 1], got {c!r}")


def _finite_number(value: object) -> bool:
    """An int or a float, finite, and not a bool (true is no number in a config file). Checked in
    this order, so a value of another type is never compared."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _integer(value: object) -> bool:
    """An int that is not a bool."""
    return not isinstance(value, bool) and isinstance(value, int)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    served_model_name: str | None = None
    # A tokenizer directory (or hub id) to use instead of the checkpoint's own (GGUF metadata included).
    tokenizer: str | None = None
    # A LoRA adapter directory in peft's format, merged into the weights at load (model/adapter.py);
    # e.g. the reuse adapter of training/reuse_adapter.py.
    adapter: str | None = None
    # torch's and the C kernels' CPU threads; None = the physical cores this process may use,
    # capped by its cgroup CPU quota (threads.py).
    threads: int | None = None
    # CPU float32: projections packed for oneDNN also keep a plain layout for decode steps of
    # 1-3 sequences, where the packed kernel is slow (model/linear.py); up to 2x weight memory.
    narrow_weights: bool = True
    # One-sequence decode steps run through torch.compile (LlamaForCausalLM.compile_decode): faster
    # batch-1 decode on CPU, more where its 1-row products are fused loops (timed per projection
    # kind at start; up to one more copy of the projections), answers kept (benchmarks/RESULTS.md
    # "bench_engine", "bench_llamacpp"); compiled at engine start (tens of seconds, longer for the
    # 1.5B) and needs a C++ compiler there. Off by default for that start-up cost, the 1.5B's too:
    # its default reuse decodes a RAG request's fusion streams as a batch, which the one-sequence
    # graph does not serve.
    compile_decode: bool = False
    # CPU: dense (the checkpoint's weights in `dtype`), native (a GGUF's own quantized weights,
    # 4-bit codes kept as they are), int8 (per output channel); model/quant.py. auto: per
    # projection kind, native unless dense measures >10% faster at both 1 and 128 rows at load
    # (model/weight_forms.py). Its default depends on the model (model/catalog.py).
    weights: str = GENERIC_DEFAULTS["weights"]
    # CPU, quantized weights (native, int8, auto's native kinds) served by qkernel: a decode
    # step's products (every sequence of a batch, as its 1-row step) round the activations to
    # int8 per block of 32 (llama.cpp's Q8_0) and sum integer products, and native Q6_K and Q4_K tensors are
    # held as the file's blocks (model/kernels/quant_blocks.py);
    # off keeps float32 activations (model/kernels/qkernel.py). Its default depends on the model
    # (model/catalog.py).
    int8_activations: bool = GENERIC_DEFAULTS["int8_activations"]
    # CPU: refuse to start where the C kernels (model/kernels/build.py) cannot be built or loaded, naming
    # why, instead of serving with torch's slower kernels (a WARNING says what that costs). For
    # production replicas whose speed was measured with the kernels.
    require_kernels: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    fidelity: FidelityConfig = field(default_factory=FidelityConfig)

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights {self.weights!r} is not one of {', '.join(WEIGHTS)}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be > 0, got {self.threads}")
        self.cache.validate()
        self.scheduler.validate()
        self.chunk.validate()
        self.kv_events.validate()
        self.fidelity.validate()

    @classmethod
    def from_options(cls, model: str, use_env: bool = True, **options: Any) -> EngineConfig:
        """Build the tree from flat option names (`LLM(model, max_num_seqs=8, ...)`, CLI flags).

        The environment (envs.py) fills options not given explicitly, and a known model's own
        chunk and engine defaults (model/catalog.py) those the environment does not; an unknown
        option is an error.
        """
        merged: dict[str, Any] = dict(_model_defaults(model))
        given = envs.env_options() if use_env else {}
        given.update({k: tuple(v) if isinstance(v, list) else v for k, v in options.items() if v is not None})
        _check_gate_conflicts(given)
        merged.update(given)
        top: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for name, value in merged.items():
            if name in _TOP_LEVEL:
                top[name] = value
            elif name in _FLAT_TO_SECTION:
                section, field_name = _FLAT_TO_SECTION[name]
                parts[section][field_name] = value
            else:
                raise TypeError(f"unknown engine option {name!r}; known options: {sorted(option_names())}")
        config = cls(model=model, **top, **{s: _SECTIONS[s](**kw) for s, kw in parts.items()})
        config.validate()
        return config


def _check_gate_conflicts(given: dict[str, Any]) -> None:
    """With fidelity_target the profile chooses the reuse options: setting them too is ambiguous."""
    if given.get("fidelity_target") is None:
        return
    chosen = sorted(k for k in given if k in REQUEST_CHUNK_OPTIONS and not k.startswith("separator_free"))
    if chosen:
        raise ValueError(
            f"fidelity_target chooses the reuse configuration from the model's profile: do not also "
            f"set {', '.join(chosen)} (requests may still set them per request)"
        )


def _model_defaults(model: str) -> tuple[tuple[str, Any], ...]:
    """The chunk and engine options measured best for a known model (by short name or file), where
    they differ from `GENERIC_DEFAULTS` (the fields' own defaults), else none."""
    known = identify(model)
    return known.chunk_defaults + known.engine_defaults if known is not None else ()


_SECTIONS: dict[str, type] = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "chunk": ChunkConfig,
    "kv_events": KVEventsConfig,
    "fidelity": FidelityConfig,
}
_TOP_LEVEL = (
    "device",
    "dtype",
    "seed",
    "served_model_name",
    "tokenizer",
    "adapter",
    "threads",
    "narrow_weights",
    "compile_decode",
    "weights",
    "int8_activations",
    "require_kernels",
)
# ChunkConfig fields whose flat option name is the field's own (blend, calibration, fusion options).
_SAME_NAME_PREFIXES = ("blend_", "calibration_", "separator_free", "fusion_")

# Flat option name -> (section, field). Chunk and event options carry a prefix so that the flat
# names read well on a command line (`--chunk-cache-size-gb`, `--kv-events-endpoint`).
_FLAT_TO_SECTION: dict[str, tuple[str, str]] = {
    **{f.name: ("cache", f.name) for f in dataclasses.fields(CacheConfig)},
    **{f.name: ("scheduler", f.name) for f in dataclasses.fields(SchedulerConfig)},
    "enable_chunk_cache": ("chunk", "enable"),
    "chunk_separator": ("chunk", "separator"),
    "chunk_cache_size_gb": ("chunk", "cache_size_gb"),
    "chunk_cache_lru_threshold": ("chunk", "lru_threshold"),
    "chunk_cache_hash_algorithm": ("chunk", "hash_algorithm"),
    "chunk_layout": ("chunk", "layout"),
    "max_chunks": ("chunk", "max_chunks"),
    "chunk_cache_disk_dir": ("chunk", "disk_dir"),
    "chunk_cache_disk_gb": ("chunk", "disk_gb"),
    "chunk_cache_remote": ("chunk", "remote"),
    **{
        f.name: ("chunk", f.name)
        for f in dataclasses.fields(ChunkConfig)
        if f.name.startswith(_SAME_NAME_PREFIXES)
    },
    "documents_format": ("chunk", "documents_format"),
    "exact_follow_ups": ("chunk", "exact_follow_ups"),
    "exact_follow_ups_sights": ("chunk", "exact_follow_ups_sights"),
    "exact_prefix_reads": ("chunk", "exact_prefix_reads"),
    "kv_events_endpoint": ("kv_events", "endpoint"),
    "kv_events_topic": ("kv_events", "topic"),
    "kv_events_replay_endpoint": ("kv_events", "replay_endpoint"),
    "kv_events_buffer_steps": ("kv_events", "buffer_steps"),
    "kv_events_curve_secret_key": ("kv_events", "curve_secret_key"),
    "kv_events_curve_authorized_keys": ("kv_events", "curve_authorized_keys"),
    "kv_events_curve_server_key": ("kv_events", "curve_server_key"),
    "kv_events_insecure": ("kv_events", "insecure"),
    "fidelity_target": ("fidelity", "target"),
    "fidelity_profile": ("fidelity", "profile"),
    "fidelity_sample_rate": ("fidelity", "sample_rate"),
    "fidelity_distribution_steps": ("fidelity", "distribution_steps"),
    "fidelity_window": ("fidelity", "window"),
    "fidelity_margin": ("fidelity", "margin"),
    "fidelity_max_share": ("fidelity", "max_share"),
}


# Flat options whose value is one of a few names: the validators above check these same tuples, and
# the command line offers them as choices.
OPTION_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": DTYPES,
    "weights": WEIGHTS,
    "prefix_caching_hash_algo": BLOCK_HASH_ALGORITHMS,
    "chunk_cache_hash_algorithm": HASH_ALGORITHMS,
    "chunk_layout": CHUNK_LAYOUTS,
    "blend_selector": BLEND_SELECTORS,
    "blend_unit": BLEND_UNITS,
    "fusion_rule": FUSION_RULES,
    "fusion_pair": FUSION_PAIRS,
}


# What each flat engine option serves, in the order `--help` and docs/options.md list them (one
# argument group, one section each). A view over the config tree's sections, which keep their
# fields where the code reads them: the chunk pool's size and tiers are ChunkConfig's but serve
# memory, the served name is EngineConfig's but serves the server. tests/test_cli.py checks that
# every option is in exactly one group.
OPTION_GROUPS: dict[str, tuple[str, ...]] = {
    "model": (
        "device",
        "dtype",
        "seed",
        "tokenizer",
        "adapter",
        "threads",
        "weights",
        "int8_activations",
        "narrow_weights",
        "compile_decode",
        "require_kernels",
    ),
    "memory": (
        "kv_cache_memory_gb",
        "kv_cache_tokens",
        "block_size",
        "enable_prefix_caching",
        "hash_seed",
        "prefix_caching_hash_algo",
        "chunk_cache_size_gb",
        "chunk_cache_lru_threshold",
        "chunk_cache_hash_algorithm",
        "chunk_cache_disk_dir",
        "chunk_cache_disk_gb",
        "chunk_cache_remote",
    ),
    "scheduling": (
        "max_num_seqs",
        "max_num_batched_tokens",
        "long_prefill_token_threshold",
        "max_long_partial_prefills",
        "min_decode_share",
        "max_model_len",
    ),
    "reuse": (
        "enable_chunk_cache",
        "chunk_layout",
        "chunk_separator",
        "documents_format",
        "max_chunks",
        *(f.name for f in dataclasses.fields(ChunkConfig) if f.name.startswith(("fusion_", "blend_"))),
        "calibration_temperature",
        "calibration_scale",
        "separator_free",
        "separator_free_min_tokens",
        "exact_follow_ups",
        "exact_follow_ups_sights",
        "exact_prefix_reads",
    ),
    "fidelity": tuple(name for name in _FLAT_TO_SECTION if name.startswith("fidelity_")),
    "server": (
        "served_model_name",
        *(name for name in _FLAT_TO_SECTION if name.startswith("kv_events_")),
    ),
}


def option_names() -> list[str]:
    """Every flat engine option, for CLI flags and error messages."""
    return [*_TOP_LEVEL, *_FLAT_TO_SECTION]


def option_specs() -> dict[str, tuple[Any, Any]]:
    """Flat option name -> (its type, Optional removed; its default)."""
    specs: dict[str, tuple[Any, Any]] = {}
    for name in option_names():
        cls, field_name = (
            (EngineConfig, name)
            if name in _TOP_LEVEL
            else (
                _SECTIONS[_FLAT_TO_SECTION[name][0]],
                _FLAT_TO_SECTION[name][1],
            )
        )
        f = {f.name: f for f in dataclasses.fields(cls)}[field_name]
        tp = typing.get_type_hints(cls)[field_name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            tp = args[0] if len(args) == 1 else tp
        default = f.default if f.default is not dataclasses.MISSING else None
        specs[name] = (tp, default)
    return specs
