"""Blend: reuse cached chunk KV at natural positions and recompute the tokens that matter.

Layout "offset" puts chunk i at its natural offset o_i. Its cached K was computed at
[s, s + len_i) (the canonical isolated entry), so it is re-rotated by o_i - s (RoPE is a rotation
linear in the position); V is untouched. Reuse alone loses the attention between chunks, so
(CacheBlend) every chunk token runs fresh through the layers before the first check layer; at
each check layer j the fresh K (or V) of the chunk tokens still running is compared with the
cached one and only the share `ratios[j]` of all chunk tokens with the largest deviation keeps
running (EPIC's first-k tokens of every chunk always do). The KV of a layer is the cached KV with
the running tokens' fresh KV written over it. S is never recomputed: its cached KV is exact.
Q always runs. Ratio 1.0 at check layer 0 is a full prefill; ratio 0 at layer 0 is pure reuse.

The blended KV lands in the request's own blocks; the pool keeps the canonical isolated KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkcache.config import ChunkConfig
from chunkcache.model.llama import LlamaForCausalLM


@dataclass
class BlendInput:
    token_ids: torch.Tensor  # [T] S, the chunks and Q, in order
    cached_slots: torch.Tensor  # [P] pool slots of S and the chunks (P = T - len Q)
    cached_delta: torch.Tensor  # [P] natural position minus the position the KV was computed at
    num_sys: int
    chunk_spans: list[tuple[int, int]]  # (start, length) of each chunk in the token list
    own_slots: torch.Tensor  # [T] where the blended KV of each token is written


@dataclass
class BlendResult:
    hidden: torch.Tensor  # [1, hidden] final hidden state of the last token
    reused_tokens: int  # chunk tokens whose KV stayed the cached one past the last check layer
    recomputed_tokens: int  # chunk tokens that ran through every layer, plus Q
    reused: torch.Tensor  # [P] bool: the cached token's KV was kept in the last layer (S always)


def _deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    return (fresh - cached).pow(2).sum(dim=(1, 2))


def _keep(
    cfg: ChunkConfig,
    ratio: float,
    num_chunk_tokens: int,
    chunk_rows: torch.Tensor,
    boundary_rows: torch.Tensor,
    fresh: tuple[torch.Tensor, torch.Tensor],
    cached: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Rows (of the tokens still running) that keep running: Q, boundary and selected chunk tokens."""
    keep = ~chunk_rows | boundary_rows
    idx = chunk_rows.nonzero().squeeze(1)
    if idx.numel() == 0:
        return keep
    (k_new, v_new), (k_old, v_old) = fresh, cached
    if cfg.blend_selector == "threshold":
        relative = _deviation(k_new[idx], k_old[idx]) / k_old[idx].pow(2).sum(dim=(1, 2)).clamp_min(1e-12)
        keep[idx[relative > cfg.blend_threshold]] = True
        return keep
    if cfg.blend_selector == "v_deviation":
        dev = _deviation(v_new[idx], v_old[idx])
    else:
        dev = _deviation(k_new[idx], k_old[idx])
    count = min(idx.numel(), math.ceil(ratio * num_chunk_tokens - 1e-9))
    if count > 0:
        keep[idx[torch.topk(dev, count).indices]] = True
    return keep


@torch.inference_mode()
def blend_prefill(
    model: LlamaForCausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    inp: BlendInput,
    cfg: ChunkConfig,
) -> BlendResult:
    device = inp.token_ids.device
    total = inp.token_ids.numel()
    cached_len = inp.cached_slots.numel()
    positions = torch.arange(total, device=device)
    is_chunk = torch.zeros(total, dtype=torch.bool, device=device)
    is_chunk[inp.num_sys : cached_len] = True
    boundary = torch.zeros(total, dtype=torch.bool, device=device)
    for start, length in inp.chunk_spans:
        boundary[start : start + min(cfg.blend_boundary_tokens, length)] = True
    num_chunk_tokens = cached_len - inp.num_sys
    check = dict(zip(cfg.blend_check_layers, cfg.blend_recompute_ratios, strict=True))
    rotary = model.rotary

    active = torch.arange(inp.num_sys, total, device=device)  # tokens still running, ascending
    h = model.embed_tokens(inp.token_ids[active])
    for layer_index, layer in enumerate(model.layers):
        k_cache, v_cache = kv_caches[layer_index]
        attn = layer.self_attn
        k_old = rotary.rerotate(k_cache[inp.cached_slots], inp.cached_delta)
        v_old = v_cache[inp.cached_slots]
        q, k, v = attn.project(layer.input_layernorm(h), positions[active])
        if layer_index in check:
            chunk_rows = is_chunk[active]
            # Compare only the chunk rows with their cached counterparts (indices < cached_len).
            safe = active.clamp(max=cached_len - 1)
            keep = _keep(
                cfg,
                check[layer_index],
                num_chunk_tokens,
                chunk_rows,
                boundary[active],
                (k, v),
                (k_old[safe], v_old[safe]),
            )
            active, h, q, k, v = active[keep], h[keep], q[keep], k[keep], v[keep]
        k_all = torch.empty((total, *k.shape[1:]), dtype=k.dtype, device=device)
        v_all = torch.empty_like(k_all)
        k_all[:cached_len], v_all[:cached_len] = k_old, v_old
        k_all[active], v_all[active] = k, v
        k_cache[inp.own_slots] = k_all
        v_cache[inp.own_slots] = v_all
        mask = positions[None, :] <= active[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k_all.transpose(0, 1).unsqueeze(0),
            v_all.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=attn.scale,
            enable_gqa=True,
        )
        h = h + attn.o_proj(o[0].transpose(0, 1).reshape(active.numel(), -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    recomputed_chunks = int(is_chunk[active].sum())
    reused = torch.ones(cached_len, dtype=torch.bool, device=device)
    reused[active[active < cached_len]] = False
    return BlendResult(
        hidden=model.norm(h[-1:]),
        reused_tokens=num_chunk_tokens - recomputed_chunks,
        recomputed_tokens=recomputed_chunks + total - cached_len,
        reused=reused,
    )
