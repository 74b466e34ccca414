"""Turning the last-position logits of each sequence into its next token (and its logprobs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from chunkcache.engine.structured import allowed_tokens
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


# ---- logit processing: penalties, logit_bias, min_tokens (vLLM's v1 sampler order: logits
# processors (bias, min_tokens), then penalties, then temperature / top-k / top-p) --------------


@dataclass
class History:
    """What a sequence has seen so far, for its penalties, and its output grammar's matcher."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    grammar: Any = None


def process_logits(
    logits: torch.Tensor, p: SamplingParams, history: History, stop_ids: frozenset[int]
) -> torch.Tensor:
    """One row of raw logits [vocab] as the request's options change it (a new tensor).

    `stop_ids` = EOS and stop token ids, masked while fewer than `min_tokens` tokens came out."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    if history.grammar is not None:
        logits = logits.masked_fill(~allowed_tokens(history.grammar, vocab), float("-inf"))
    if p.logit_bias:
        ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long)
        if len(ids):
            logits[ids] += torch.tensor([p.logit_bias[int(t)] for t in ids], dtype=logits.dtype)
    if p.min_tokens and len(history.output_token_ids) < p.min_tokens:
        banned = [t for t in stop_ids if t < vocab]
        if banned:
            logits[torch.tensor(banned, dtype=torch.long)] = float("-inf")
    output = torch.tensor(history.output_token_ids, dtype=torch.long)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(history.prompt_token_ids, dtype=torch.long)] = True
        seen[output] = True
        penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if p.frequency_penalty or p.presence_penalty:
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: list[History] | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> list[Sampled]:
    """logits [B, vocab] float32 of the raw model output. `histories` is needed by requests whose
    params process logits (penalties); the logprobs reported are those of the raw logits (vLLM's
    default `raw_logprobs`)."""
    greedy_ids = logits.argmax(-1).tolist()
    out: list[Sampled] = []
    logprobs_all = None
    if any(p.logprobs is not None for p in params):
        logprobs_all = torch.log_softmax(logits, dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        row_logits = logits[row]
        grammar = histories[row].grammar if histories is not None else None
        processed = p.processes_logits or grammar is not None
        if processed:
            if histories is None:
                raise ValueError("penalties, logit_bias and min_tokens need the sequences' token histories")
            row_logits = process_logits(row_logits, p, histories[row], stop_ids | frozenset(p.stop_token_ids))
        if p.greedy:
            token = int(row_logits.argmax()) if processed else greedy_ids[row]
        else:
            try:
                filtered = _filter_top_k_top_p(row_logits / p.temperature, p.top_k, p.top_p)
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
        if grammar is not None:
            grammar.consume_token(token)  # the grammar advances with the output
        out.append(Sampled(token, lp))
    return out
