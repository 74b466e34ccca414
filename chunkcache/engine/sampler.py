"""Turning the last-position logits of each sequence into its next token (and its logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkcache.sampling import SamplingParams


@dataclass
class Sampled:
    token_id: int
    logprobs: dict[int, float] | None
    # Set when this row could not be sampled (NaN logits, ...): that request fails, the batch goes on.
    error: str | None = None


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop = (cum - sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[Sampled]:
    """logits [B, vocab] float32 of the raw model output."""
    greedy_ids = logits.argmax(-1).tolist()
    out: list[Sampled] = []
    logprobs_all = None
    if any(p.logprobs is not None for p in params):
        logprobs_all = torch.log_softmax(logits, dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            token = greedy_ids[row]
        else:
            try:
                filtered = _filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
                probs = torch.softmax(filtered, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=gen).item())
            except RuntimeError as e:  # torch refuses inf / NaN / negative probabilities
                out.append(Sampled(-1, None, error=f"sampling failed: {e}"))
                continue
        lp: dict[int, float] | None = None
        if p.logprobs is not None and logprobs_all is not None:
            row_lp = logprobs_all[row]
            lp = {}
            if p.logprobs > 0:
                top = torch.topk(row_lp, min(p.logprobs, row_lp.shape[-1]))
                lp = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            lp[token] = float(row_lp[token])
        out.append(Sampled(token, lp))
    return out
