"""Blend: reuse cached chunk KV at natural positions and recompute the tokens that matter.

Layout "offset" puts chunk i at its natural offset o_i. Its cached K was computed at
[s, s + len_i) (the canonical isolated entry), so it is re-rotated by o_i - s (RoPE is a rotation
linear in the position); V is untouched. Reuse alone loses the attention between chunks, so
(CacheBlend) every chunk token runs fresh through the layers before the first check layer; at
each check layer j the fresh K (or V) of the chunk tokens still running is compared with the
cached one and only the share `ratios[j]` of all chunk tokens with the largest deviation keeps
running (EPIC's first-k tokens of every chunk always do). The KV of a layer is the cached KV with
the running tokens' fresh KV written over it. S is never recomputed: its cached KV is exact.
Nor, where no check layer could choose it, is a first chunk computed right after this S: its
fresh KV would equal the cached one (`BlendInput.num_exact`). Q always runs. Ratio 1.0 at check layer 0 is a full prefill; ratio 0 at layer 0 is pure
reuse (but for `BlendInput.fresh_from`).

Selectors rank the candidates: by K or V deviation (CacheBlend), by the attention the
question's tokens pay them at the check layer (`query_attention`: the question is known when the
request arrives, so recompute what it reads), or by the deviation each entry measured once and
stored (`stored_deviation`, engine/sensitivity.py). That one needs no fresh KV, so at a check
layer the choice is made before the layer's projection, and the tokens not chosen skip the layer
(at check layer 0 they never run). `blend_unit="chunk"` recomputes whole chunks, ranked by their
summed score, as many as fit in the same token budget.

The blended KV lands in the request's own blocks; the pool keeps the canonical isolated KV.
Those blocks are registered in the prefix cache under an extra key of the blend's options and the
prompt's cuts (`kv_options`, `hashing.blend_key`): the chunks' blended KV does not depend on the
question (causal attention; the selectors but `query_attention` rank chunk tokens by what they
hold), so a follow-up with the same S and chunks in the same order reads it and computes only
its question (and the last chunk's tokens after its last full block, which therefore always run
here too: `BlendInput.fresh_from`).

A large blend need not run in one step: `BlendRun` runs its layers in as many calls as the
scheduler's token budget asks (engine/scheduler.py), each layer writing its KV as it goes. The
split is by layers, not by token groups, because a layer's choice of tokens (at a check layer)
needs every running token's fresh K at once, and because a split by layers runs exactly the
operations of an unsplit blend: the blended KV and answer do not change.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from chunkcache.config import ChunkConfig
from chunkcache.engine.blend_select import Evidence, Tokens, keep_rows, query_attention
from chunkcache.model.calibration import ContextCalibration, calibrated_attention
from chunkcache.model.linear import Linear
from chunkcache.model.llama import Attention, LlamaForCausalLM
from chunkcache.model.rope import RopeTable, RotaryEmbedding
from chunkcache.model.row_attention import attend_rows, plan_rows
from chunkcache.model.upcast import dense_product


@dataclass
class BlendInput:
    token_ids: torch.Tensor  # [T] S, the chunks and Q, in order
    cached_slots: torch.Tensor  # [P] pool slots of S and the chunks (P = T - len Q)
    cached_delta: torch.Tensor  # [P] natural position minus the position the KV was computed at
    num_sys: int
    chunk_spans: list[tuple[int, int]]  # (start, length) of each chunk in the token list
    own_slots: torch.Tensor  # [T] where the blended KV of each token is written
    # Tokens from the head whose cached KV is a plain prefill's: S, and the first chunk when its
    # entry was computed right after this S from its start. Causal attention keeps them from
    # seeing anything after them, so running them again gives their cached KV back.
    num_exact: int = 0
    # Q's attention to the chunks (APE); the chunk tokens that run keep exact attention.
    calibration: ContextCalibration | None = None
    # Chunk tokens from here on always run, as boundary tokens do: those of the last chunk after
    # its last full KV block when the blocks are registered for follow-ups (`kv_options`). That
    # block also holds the question, so a follow-up cannot find it and computes those tokens
    # fresh; running them here too keeps a request's answer the same whether or not it found
    # an earlier request's blended blocks. None: no such tokens.
    fresh_from: int | None = None
    # [P] float: each cached token's stored sensitivity (engine/sensitivity.py; S rows unused),
    # for selector "stored_deviation".
    prior: torch.Tensor | None = None


@dataclass
class BlendResult:
    hidden: torch.Tensor  # [1, hidden] final hidden state of the last token
    reused_tokens: int  # chunk tokens whose KV stayed the cached one past the last check layer
    recomputed_tokens: int  # chunk tokens that ran through every layer, plus Q
    reused: torch.Tensor  # [P] bool: the cached token's KV was kept in the last layer (S always)


# Selectors that need only the fresh K of the candidates, not their Q or V.
_K_SELECTORS = ("k_deviation", "threshold")
# Selectors whose scores are known before a layer runs: the choice comes before its projection.
_EARLY_SELECTORS = ("stored_deviation",)
# The K rows of a merged q/k/v projection, dense, per projection: (weight [Hk * D, in], bias).
_K_WEIGHTS: weakref.WeakKeyDictionary[Linear, tuple[torch.Tensor, torch.Tensor | None]] = (
    weakref.WeakKeyDictionary()
)


def _project_k(attn: Attention, x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
    """The K [T, Hk, D] that `attn.project` computes for x (bias, k-norm, `rope`'s RoPE),
    without its Q and V: at a check layer every chunk token needs its K compared, but only the
    chosen share needs Q and V (at 0.15 this skips ~75% of that layer's q/k/v projection)."""
    proj = attn.qkv_proj
    if proj not in _K_WEIGHTS:
        weight, bias = proj.dense_weight()
        rows = slice(attn.q_size, attn.q_size + attn.kv_size)
        _K_WEIGHTS[proj] = (
            weight[rows].contiguous(),
            None if bias is None else bias[rows].contiguous(),
        )
    weight, bias = _K_WEIGHTS[proj]
    k = dense_product(x, weight, bias).view(x.shape[0], attn.num_kv_heads, attn.head_dim)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    return RotaryEmbedding.apply(rope, k)


def _exact_never_chosen(cfg: ChunkConfig, num_chunk_tokens: int, num_exact_chunk_tokens: int) -> bool:
    """Whether no check layer would choose an exact token (`BlendInput.num_exact`), so that they
    need not run at all: their fresh KV equals the cached one, and the selector ranks by that
    deviation (a question-attention selector could rank them first), per token (a whole-chunk
    unit could take one to fill its budget), at a check layer after 0 (at layer 0 every
    deviation is rounding noise), with fewer tokens to choose than the others offer."""
    if cfg.blend_selector == "threshold":
        deviation_ranked = cfg.blend_threshold > 0
    else:
        deviation_ranked = cfg.blend_selector in ("k_deviation", "v_deviation", "stored_deviation")
    first_ratio = cfg.blend_recompute_ratios[0]
    budget = math.ceil(first_ratio * num_chunk_tokens - 1e-9)
    # A stored score is ranked below every other at any layer (`blend_prefill`'s `prior`).
    chosen_by_noise = cfg.blend_check_layers[0] == 0 and cfg.blend_selector not in _EARLY_SELECTORS
    return (
        num_exact_chunk_tokens > 0
        and deviation_ranked
        and cfg.blend_unit == "token"
        and (not chosen_by_noise or budget == 0)
        and budget <= num_chunk_tokens - num_exact_chunk_tokens
    )


def needs_stored_scores(cfg: ChunkConfig) -> bool:
    """Whether a blend under `cfg` ranks by the entries' stored sensitivity: selector
    "stored_deviation" with a ratio that keeps some chunk tokens and not all (0 keeps none and 1
    every one, whatever the scores), so that measuring them would be wasted."""
    return cfg.blend_selector in _EARLY_SELECTORS and any(0.0 < r < 1.0 for r in cfg.blend_recompute_ratios)


def kv_options(cfg: ChunkConfig) -> tuple[object, ...] | None:
    """The options that decide the chunks' blended KV (with the prompt's cuts,
    `hashing.blend_key`), or None where the request's KV is not worth finding again: where the
    choice depends on the question (`query_attention`), which a follow-up asks anew; or where the
    tokens after the chunks read them through APE's calibration, which a plain prefill over the
    blended KV would not apply."""
    if cfg.blend_selector == "query_attention":
        return None
    if (cfg.calibration_temperature, cfg.calibration_scale) != (1.0, 1.0):
        return None
    threshold = cfg.blend_threshold if cfg.blend_selector == "threshold" else None
    return (
        tuple(cfg.blend_check_layers),
        tuple(float(r) for r in cfg.blend_recompute_ratios),
        cfg.blend_selector,
        threshold,
        cfg.blend_unit,
        cfg.blend_boundary_tokens,
    )


class BlendRun:
    """One blend prefill, run layer by layer so that it can span several steps (the per-step
    token budget, engine/scheduler.py): `run(stop)` runs the layers up to `stop`, and the next call
    goes on from there. Between calls it keeps what a layer hands the next (the running tokens and
    their hidden states), and each layer writes its blended KV to the request's blocks as it runs,
    so running the layers in any number of calls is exactly one pass over them: the same
    operations on the same tensors, the same result. A row of one layer costs about 1 / num_layers
    of a token's forward: `rows` is what the scheduler sizes a piece by."""

    @torch.inference_mode()
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        inp: BlendInput,
        cfg: ChunkConfig,
    ) -> None:
        self.model, self.kv_caches, self.inp, self.cfg = model, kv_caches, inp, cfg
        device = inp.token_ids.device
        self.total = total = inp.token_ids.numel()
        self.cached_len = cached_len = inp.cached_slots.numel()
        self.positions = torch.arange(total, device=device)
        self.is_chunk = is_chunk = torch.zeros(total, dtype=torch.bool, device=device)
        is_chunk[inp.num_sys : cached_len] = True
        boundary = torch.zeros(total, dtype=torch.bool, device=device)
        chunk_id = torch.full((total,), -1, dtype=torch.long, device=device)
        for i, (start, length) in enumerate(inp.chunk_spans):
            boundary[start : start + min(cfg.blend_boundary_tokens, length)] = True
            chunk_id[start : start + length] = i
        if inp.fresh_from is not None:
            boundary[max(inp.fresh_from, inp.num_sys) : cached_len] = True
        self.num_chunk_tokens = num_chunk_tokens = cached_len - inp.num_sys
        self.tokens = Tokens(is_chunk, boundary, chunk_id, num_chunk_tokens)
        self.check = dict(zip(cfg.blend_check_layers, cfg.blend_recompute_ratios, strict=True))
        rotary = model.rotary

        running = torch.ones(total, dtype=torch.bool, device=device)  # S never runs: its KV is exact
        running[: inp.num_sys] = False
        if _exact_never_chosen(cfg, num_chunk_tokens, inp.num_exact - inp.num_sys):
            # Nor the exact first chunk (25% of the chunk tokens with 4 chunks): same KV, no choice
            # to make, so its layer-0 work (and its K at the check layer) is skipped. Boundary
            # tokens still run, as everywhere.
            running[inp.num_sys : inp.num_exact] = boundary[inp.num_sys : inp.num_exact]
        self.active = active = running.nonzero().squeeze(1)  # tokens still running, ascending
        self.h = model.embed_tokens(inp.token_ids[active])
        spec = model.spec
        # One layer's KV list [T, Hk, D]: the cached KV (K re-rotated) with the running tokens' fresh
        # KV written over it. Reused by every layer; the request's blocks get a copy of each.
        self.k_all = torch.empty((total, spec.num_kv_heads, spec.head_dim), dtype=self.h.dtype, device=device)
        self.v_all = torch.empty_like(self.k_all)
        # R(delta) is the same at every layer: its cos/sin once per request.
        self.cos, self.sin = rotary.rerotation(inp.cached_delta, self.k_all.dtype)
        self._moved()  # the running tokens' attention plan and RoPE: they change at check layers only
        self.prior = None
        if cfg.blend_selector in _EARLY_SELECTORS:
            # Without stored scores only where no ranking is needed (`needs_stored_scores`).
            assert inp.prior is not None or not needs_stored_scores(cfg), "no stored scores to rank by"
            self.prior = torch.zeros(total, dtype=torch.float32, device=device)
            if inp.prior is not None:
                self.prior[:cached_len] = inp.prior.to(device)
            self.prior[inp.num_sys : inp.num_exact] = -1.0  # exact already: chosen last (scores are >= 0)
        self.next_layer = 0

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def rows(self) -> int:
        """Tokens running in the next layer (fewer after a check layer)."""
        return self.active.numel()

    @property
    def done(self) -> bool:
        return self.next_layer == self.num_layers

    def _moved(self) -> None:
        spec = self.model.spec
        self.plan = plan_rows(self.active, spec.num_heads, spec.num_kv_heads, self.h.dtype)
        self.rope = self.model.rotary.table(self.positions[self.active], self.h.dtype)

    @torch.inference_mode()
    def run(self, stop: int) -> None:
        """Run the layers from the next one up to `stop` (exclusive)."""
        for layer_index in range(self.next_layer, min(stop, self.num_layers)):
            self._layer(layer_index)
            self.next_layer = layer_index + 1

    def _layer(self, layer_index: int) -> None:
        inp, cfg, model = self.inp, self.cfg, self.model
        layer = model.layers[layer_index]
        k_cache, v_cache = self.kv_caches[layer_index]
        attn = layer.self_attn
        cached_len, k_all, v_all = self.cached_len, self.k_all, self.v_all
        k_old, v_old = k_all[:cached_len], v_all[:cached_len]
        # index_select, not k_cache[slots]: the advanced-indexing gather is ~5x slower on CPU.
        torch.index_select(k_cache, 0, inp.cached_slots, out=k_old)
        torch.index_select(v_cache, 0, inp.cached_slots, out=v_old)
        model.rotary.rerotate_(k_old, self.cos, self.sin)
        h = self.h
        x = layer.input_layernorm(h)
        ratio = self.check.get(layer_index)
        if ratio is not None and self.prior is not None:
            # Ranked by what the entries stored: chosen before this layer's projection, which the
            # others skip (at layer 0 they never run).
            keep = keep_rows(cfg, ratio, self.tokens, self.active, Evidence(prior=self.prior[self.active]))
            self.active, h, x = self.active[keep], h[keep], x[keep]
            self.h = h
            self._moved()
            ratio = None
        k_only = ratio is not None and cfg.blend_selector in _K_SELECTORS and ratio < 1.0
        v_fresh: torch.Tensor | None = None
        if k_only:
            k = _project_k(attn, x, self.rope)
        else:
            q, k, v = attn.project(x, self.rope)
            v_fresh = v
        if ratio is not None:
            active = self.active
            # Compare only the chunk rows with their cached counterparts (indices < cached_len).
            safe = active.clamp(max=cached_len - 1)
            attention = None
            if cfg.blend_selector == "query_attention":
                # The question's view of this layer: fresh keys where tokens still run.
                keys = k_all.clone()
                keys[active] = k
                attention = query_attention(q, keys, self.total - cached_len, attn.scale)[active]
            evidence = Evidence(k, v_fresh, k_old[safe], v_old[safe], attention)
            keep = keep_rows(cfg, ratio, self.tokens, active, evidence)
            self.active = active[keep]
            self.h = h = h[keep]
            self._moved()
            if k_only:
                q, k, v = attn.project(x[keep], self.rope)
            else:
                q, k, v = q[keep], k[keep], v[keep]
        active = self.active
        k_all.index_copy_(0, active, k)
        v_all.index_copy_(0, active, v)
        k_cache.index_copy_(0, inp.own_slots, k_all)
        v_cache.index_copy_(0, inp.own_slots, v_all)
        o = attend_rows(q, k_all, v_all, self.plan, attn.scale)
        if inp.calibration is not None:
            # Q's rows are the last ones still running: every chunk and S row comes first.
            nq = self.total - cached_len
            o[-nq:] = calibrated_attention(q[-nq:], k_all, v_all, active[-nq:], inp.calibration, attn.scale)
        # The residual adds fused into the projections, as in the model's own forward.
        h = attn.o_proj(o.reshape(active.numel(), -1), h)
        self.h = layer.mlp(layer.post_attention_layernorm(h), residual=h)

    @torch.inference_mode()
    def result(self) -> BlendResult:
        """What the blend gives once every layer ran."""
        assert self.done, "the blend has layers left to run"
        active, cached_len = self.active, self.cached_len
        recomputed_chunks = int(self.is_chunk[active].sum())
        reused = torch.ones(cached_len, dtype=torch.bool, device=active.device)
        reused[active[active < cached_len]] = False
        return BlendResult(
            hidden=self.model.norm(self.h[-1:]),
            reused_tokens=self.num_chunk_tokens - recomputed_chunks,
            recomputed_tokens=recomputed_chunks + self.total - cached_len,
            reused=reused,
        )
