"""Engine construction: the model, the KV cache sized to its budget, the chunk pool and its lower
tiers, and the KV event publisher, built once from the config tree.

Kept apart from the step loop (engine.py) because none of it changes after start: what the loop
and request intake read of it (block counts, the model's shape, the tokenizer) is fixed here.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from chunkcache.chunk.manager import ChunkManager
from chunkcache.chunk.pool import ChunkPool
from chunkcache.chunk.tiers.disk import DiskTier
from chunkcache.chunk.tiers.identity import model_identity
from chunkcache.chunk.tiers.provider import TierProvider
from chunkcache.chunk.tiers.remote import RedisTier
from chunkcache.chunk.tiers.stack import TierStack
from chunkcache.config import ChunkConfig, EngineConfig, KVEventsConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.curve import CurveKeys, load_public_key
from chunkcache.engine.runner import ModelRunner
from chunkcache.engine.sensitivity import neutral_passage
from chunkcache.errors import KernelsUnavailableError
from chunkcache.fidelity.controller import Controller
from chunkcache.fidelity.gate import resolve as resolve_fidelity
from chunkcache.kv_publisher import KVEventPublisher, PublisherCurve
from chunkcache.malloc import keep_freed_memory, release_freed_memory
from chunkcache.model import catalog
from chunkcache.model.kernels import build as kernel_build
from chunkcache.model.loader import LoadedModel, load_model, resolve_device
from chunkcache.model.spec import ModelSpec
from chunkcache.threads import set_threads

logger = logging.getLogger(__name__)

_DEFAULT_KV_GB = 0.5
# "GPU" names the engine's main KV tier in vLLM's events (offloaded KV would be "CPU"), whatever
# the device: a router weighs tiers, not devices.
_MEDIUM = "GPU"


@dataclass
class EngineParts:
    """What an engine is built of; fixed once built."""

    # The config it was built from, with the reuse configuration the fidelity gate chose.
    config: EngineConfig
    loaded: LoadedModel
    model_name: str
    max_model_len: int
    blocks: BlockManager
    runner: ModelRunner
    chunks: ChunkManager | None
    publisher: KVEventPublisher | None
    # With a fidelity profile: the reuse configuration requests without their own options get,
    # moved along the profile by shadow checks' agreement (fidelity/controller.py).
    controller: Controller | None = None
    # Which kernels serve a CPU's quantized products: "c" or "torch" (`model/kernels/build.py`'s `kernels()`); None
    # off CPU, where they do not apply.
    kernels: str | None = None

    @property
    def spec(self) -> ModelSpec:
        return self.loaded.spec

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer


def build_engine(config: EngineConfig) -> EngineParts:
    """Load the model and build the caches and the publisher that `config` asks for."""
    config.validate()
    set_threads(config.threads)
    kernels = check_kernels(config)
    _log_known_model(config.model)
    loaded = load_model(
        config.model,
        config.device,
        config.dtype,
        config.tokenizer,
        config.adapter,
        config.narrow_weights,
        config.weights,
        config.int8_activations,
    )
    if loaded.device.type == "cpu":
        # What the load freed goes back; activations freed by a step stay mapped for the next
        # one (chunkcache/malloc.py).
        release_freed_memory()
        keep_freed_memory()
    model_name = config.served_model_name or loaded.name
    # With fidelity_target, the reuse configuration the model's profile chooses (fidelity/gate.py).
    base_chunk = config.chunk
    gated = resolve_fidelity(config, loaded)
    config = gated.config
    max_model_len = _max_model_len(config, loaded.spec)
    config.chunk.validate(loaded.spec.num_layers)
    if config.chunk.enable:
        logger.info("chunked prompts: layout %s (%s)", config.chunk.layout, _reuse_summary(config.chunk))
    bs = config.cache.block_size
    token_bytes = loaded.spec.kv_bytes_per_token(torch.tensor([], dtype=loaded.dtype).element_size())
    num_blocks = _num_blocks(config, token_bytes)
    blocks = BlockManager(
        num_blocks,
        bs,
        config.cache.enable_prefix_caching,
        config.cache.hash_seed,
        _MEDIUM,
        hash_algorithm=config.cache.prefix_caching_hash_algo,
    )
    pool_pages = int(config.chunk.cache_size_gb * 2**30) // (token_bytes * bs) if config.chunk.enable else 0
    # The passage chunk entries measure their sensitivity after, written as a document after the
    # separator (engine/sensitivity.py).
    neutral = config.chunk.separator + neutral_passage()
    neutral_ids = tuple(loaded.tokenizer.encode(neutral, add_special_tokens=False))
    runner = ModelRunner(
        loaded,
        (num_blocks + pool_pages) * bs,
        bs,
        neutral_ids,
        compile_decode=config.compile_decode,
        committed_slots=num_blocks * bs,
    )
    chunks = None
    if config.chunk.enable:
        pool = ChunkPool(num_blocks, pool_pages, bs, token_bytes * bs, config.chunk.lru_threshold, _MEDIUM)
        tiers = _lower_tiers(config.chunk, loaded, model_name)
        chunks = ChunkManager(config.chunk, model_name, blocks, pool, loaded.device, runner.kv_caches, tiers)
        runner.chunks = chunks
    publisher = _publisher(config.kv_events, model_name)
    controller = None
    if gated.profile is not None and gated.chosen is not None:
        controller = Controller(
            gated.profile, gated.chosen, base_chunk, config.fidelity, loaded.spec.num_layers
        )
    return EngineParts(
        config, loaded, model_name, max_model_len, blocks, runner, chunks, publisher, controller, kernels
    )


def _log_known_model(model: str) -> None:
    """Which known model this is (by short name, or its file by content: `catalog.identify`) and
    the defaults it is served with where no option says otherwise (the generic chunk defaults
    under its own, as `EngineConfig.from_options` merges them)."""
    known = catalog.identify(model)
    if known is None:
        return
    c = EngineConfig.from_options(model, use_env=False).chunk
    reuse = f"layout {c.layout}"
    if c.layout == "fusion":
        reuse += f", rule {c.fusion_rule}, amateur {c.fusion_amateur}, pair {c.fusion_pair}"
        reuse += f" (margin {c.fusion_pair_margin})" if c.fusion_pair != "none" else ""
    engine = ", ".join(f"{k} {v}" for k, v in known.engine_defaults) or "none"
    logger.info(
        "known model %s (%s): its default reuse %s; engine defaults %s (options given win)",
        known.name,
        known.title,
        reuse,
        engine,
    )


def check_kernels(config: EngineConfig) -> str | None:
    """On a CPU, which kernels will serve the quantized products ("c" or "torch"), known before the
    model loads (building the library at first use; where it fails, `model/kernels/build.py` logs one WARNING with
    the reason and the cost); with `require_kernels`, "torch" refuses to start, naming the reason,
    before minutes of loading. None off CPU: the C kernels serve CPUs only."""
    if resolve_device(config.device).type != "cpu":
        return None
    kernels = kernel_build.kernels()
    if kernels.kind == "c":
        logger.info("quantized products: C kernels %s", kernels.library)
    elif config.require_kernels:
        raise KernelsUnavailableError(
            f"require_kernels: the C kernels are unavailable ({kernels.reason}); "
            "fix that, or drop --require-kernels / CHUNKCACHE_REQUIRE_KERNELS to serve with torch's kernels"
        )
    return kernels.kind


def _max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    limit = spec.max_position_embeddings
    asked = config.scheduler.max_model_len
    if asked is not None and asked > limit:
        raise ValueError(f"max_model_len {asked} exceeds the model's max_position_embeddings {limit}")
    return asked or limit


def _num_blocks(config: EngineConfig, token_bytes: int) -> int:
    """Paged KV blocks: a number of tokens wins over a memory size; neither = _DEFAULT_KV_GB."""
    cache = config.cache
    if cache.kv_cache_tokens is not None:
        return cache.kv_cache_tokens // cache.block_size
    gb = cache.kv_cache_memory_gb or _DEFAULT_KV_GB
    return max(1, int(gb * 2**30) // (token_bytes * cache.block_size))


def _lower_tiers(chunk: ChunkConfig, loaded: LoadedModel, model_name: str) -> TierStack | None:
    """The chunk pool's lower tiers, nearest first; None without any. On a CPU the device pool
    already is host memory, so there is no separate host-memory tier."""
    tiers: list[TierProvider] = []
    if chunk.disk_dir:
        tiers.append(DiskTier(chunk.disk_dir, int(chunk.disk_gb * 2**30)))
    if chunk.remote:
        tiers.append(RedisTier(chunk.remote))
    if not tiers:
        return None
    spec = loaded.spec
    layout = (spec.num_layers, spec.num_kv_heads, spec.head_dim, loaded.dtype)
    return TierStack(tiers, model_identity(loaded.model, loaded.tokenizer, model_name), layout)


def _publisher(ev: KVEventsConfig, model_name: str) -> KVEventPublisher | None:
    """The KV event publisher, where an endpoint is configured."""
    if not ev.endpoint:
        return None
    topic = ev.topic or f"kv@{socket.gethostname()}-{os.getpid()}@{model_name}"
    curve = None
    if ev.curve_secret_key is not None:
        server_key = None if ev.curve_server_key is None else load_public_key(ev.curve_server_key)
        curve = PublisherCurve(CurveKeys.load(ev.curve_secret_key), ev.curve_authorized_keys, server_key)
    return KVEventPublisher(
        ev.endpoint, topic, ev.replay_endpoint, ev.buffer_steps, curve=curve, insecure=ev.insecure
    )


def _reuse_summary(chunk: ChunkConfig) -> str:
    """What a chunked prompt's reuse will do, for the load log line."""
    if chunk.layout == "fusion":
        amateur = " with the no-document stream" if chunk.fusion_amateur else ""
        pair = ""
        if chunk.fusion_pair != "none":
            pair = f", joint stream {chunk.fusion_pair} over up to {chunk.fusion_max_joint} documents"
            pair += f" within {chunk.fusion_pair_margin}" if chunk.fusion_pair_margin < 100 else ""
        return f"one exact stream per document, rule {chunk.fusion_rule}{amateur}{pair}"
    if chunk.layout == "offset":
        ratios = ", ".join(map(str, chunk.blend_recompute_ratios))
        return (
            f"blend by {chunk.blend_selector}, recompute {ratios} at layers {list(chunk.blend_check_layers)}"
        )
    return "documents side by side, nothing recomputed"
