"""How blend chooses the chunk tokens that keep running at a check layer (engine/blend.py).

The selectors rank the candidates by what a check layer shows of them (CacheBlend's K or V
deviation, the question's attention) or by what each entry measured once (`stored_deviation`);
`keep_rows` turns the ranking into the rows that run on: the best share `ratio` of all chunk
tokens, or whole chunks (`blend_unit="chunk"`), or those over a threshold. Apart from blend.py so
that the layer loop reads in one sitting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from chunkcache.config import ChunkConfig


def _deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    return (fresh - cached).pow(2).sum(dim=(1, 2))


def query_attention(q: torch.Tensor, keys: torch.Tensor, num_query: int, scale: float) -> torch.Tensor:
    """Attention that the question's rows (the last `num_query` of `q`) pay to each key, summed
    over the question's tokens and heads: [K]. The question sees every key, so no mask."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    qq = q[-num_query:].float()  # [Q, H, D]
    kk = keys.float().repeat_interleave(heads // kv_heads, dim=1)  # [K, H, D]
    probs = torch.einsum("qhd,khd->hqk", qq, kk).mul_(scale).softmax(dim=-1)
    return probs.sum(dim=(0, 1))


@dataclass
class Evidence:
    """What the selectors rank the running rows by at a check layer; each reads its own part.
    Fresh K/V and the cached K/V are of the running rows (cached: clamped to a cached token)."""

    k_fresh: torch.Tensor | None = None
    v_fresh: torch.Tensor | None = None  # None where the selector does not read it (`_K_SELECTORS`)
    k_cached: torch.Tensor | None = None
    v_cached: torch.Tensor | None = None
    attention: torch.Tensor | None = None  # `query_attention`
    prior: torch.Tensor | None = None  # `stored_deviation`


def _scores(cfg: ChunkConfig, idx: torch.Tensor, ev: Evidence) -> torch.Tensor:
    """Per candidate row `idx`: how much recomputing it matters (larger = recompute first); for
    "threshold", the deviation relative to the cached K's norm, compared with the threshold."""
    if cfg.blend_selector == "query_attention":
        assert ev.attention is not None
        return ev.attention[idx]
    if cfg.blend_selector == "stored_deviation":
        assert ev.prior is not None
        return ev.prior[idx]
    if cfg.blend_selector == "v_deviation":
        assert ev.v_fresh is not None and ev.v_cached is not None
        return _deviation(ev.v_fresh[idx], ev.v_cached[idx])
    assert ev.k_fresh is not None and ev.k_cached is not None
    deviation = _deviation(ev.k_fresh[idx], ev.k_cached[idx])
    if cfg.blend_selector == "threshold":
        return deviation / ev.k_cached[idx].pow(2).sum(dim=(1, 2)).clamp_min(1e-12)
    return deviation


@dataclass(frozen=True)
class Tokens:
    """What a request's tokens are, per token of the prompt [T]."""

    is_chunk: torch.Tensor  # bool: a chunk token (a candidate)
    boundary: torch.Tensor  # bool: a chunk token that always runs
    chunk_id: torch.Tensor  # long: its chunk's index, -1 elsewhere
    num_chunk_tokens: int


def keep_rows(
    cfg: ChunkConfig, ratio: float, tokens: Tokens, active: torch.Tensor, evidence: Evidence
) -> torch.Tensor:
    """Rows of the tokens still running (`active`, ascending) that keep running: Q, boundary and
    selected chunk tokens; the evidence is per running row."""
    chunk_rows, chunk_ids = tokens.is_chunk[active], tokens.chunk_id[active]
    keep = ~chunk_rows | tokens.boundary[active]
    idx = chunk_rows.nonzero().squeeze(1)
    if idx.numel() == 0:
        return keep
    score = _scores(cfg, idx, evidence)
    if cfg.blend_selector == "threshold":
        keep[idx[score > cfg.blend_threshold]] = True
        return keep
    budget = min(idx.numel(), math.ceil(ratio * tokens.num_chunk_tokens - 1e-9))
    if budget <= 0:
        return keep
    if cfg.blend_unit == "token":
        keep[idx[torch.topk(score, budget).indices]] = True
        return keep
    # Whole chunks, best summed score first, each taken if it still fits in the budget.
    ids = chunk_ids[idx]
    totals = torch.zeros(int(ids.max()) + 1, dtype=score.dtype, device=score.device)
    totals.index_add_(0, ids, score)
    sizes = torch.bincount(ids, minlength=totals.numel())
    for chunk in torch.argsort(totals, descending=True).tolist():
        size = int(sizes[chunk])
        if 0 < size <= budget:
            keep[idx[ids == chunk]] = True
            budget -= size
    return keep
