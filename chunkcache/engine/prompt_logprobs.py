"""Log-probabilities of a request's prompt tokens (vLLM's `prompt_logprobs`; what `echo` with
`logprobs` on /v1/completions returns, as evaluation harnesses use it).

Prompt token i > 0 gets log p(token_i | tokens before it), read from the hidden state of position
i - 1 as the prefill computes it, plus the top-k entries there. Every prompt position must be
computed for that, so such requests skip the prefix cache and chunk mode (engine.py refuses a
chunked prompt, the scheduler does not match a prefix). Entries are stored by position, so a
preempted request that prefills again overwrites rather than appends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from chunkcache.core.sequence import Sequence


@dataclass(frozen=True)
class PromptSlice:
    """What one forward computed of a sequence's own prompt tokens' log-probabilities: positions
    `start` .. `start + m - 1` predict own prompt tokens `start + 1` .. `start + m` (`targets`)."""

    seq: Sequence
    start: int
    logprobs: torch.Tensor  # [m, vocab], float32, on the CPU
    targets: torch.Tensor  # [m]

    def picked(self) -> list[float]:
        """log p of each target token."""
        return self.logprobs.gather(1, self.targets[:, None])[:, 0].tolist()


# Rows whose logits one lm_head call computes at most: the slices of several sequences share a
# call (a native-weights lm_head dequantizes its whole weight per call: fusion's streams each paid
# it), while [rows, vocab] float32 stays bounded (256 rows of Qwen2.5's vocab: 156 MB).
LOGITS_ROWS = 256


def prompt_slices(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    seqs: Seq[Sequence],
    num_new_tokens: Seq[int],
    wanted: Callable[[Sequence], bool],
    first: Callable[[Sequence], int] = lambda seq: 0,
) -> Iterator[PromptSlice]:
    """For each of `seqs` that is `wanted`, the log-probs its new tokens give the prompt tokens
    after them, from own position `first(seq)` on (a fusion pair stream computes a document before
    its question: only the question's are wanted, and logits over a document would cost a vocab
    row per token). `hidden` [tokens, hidden] is one forward whose tokens are those of `seqs` in
    order (`num_new_tokens[i]` each, the first `num_computed` of each already done). Consecutive
    slices share an lm_head call up to `LOGITS_ROWS` rows."""
    pending: list[tuple[Sequence, int, torch.Tensor]] = []  # (seq, lo, hidden rows)

    def flush() -> Iterator[PromptSlice]:
        rows = torch.cat([h for _, _, h in pending])
        logprobs = torch.log_softmax(compute_logits(rows).float(), dim=-1).cpu()
        for (seq, lo, h), part in zip(pending, logprobs.split([len(h) for _, _, h in pending]), strict=True):
            targets = torch.tensor(seq.token_ids[lo + 1 : lo + 1 + len(h)], dtype=torch.long)
            yield PromptSlice(seq, lo, part, targets)
        pending.clear()

    start = 0
    for seq, n in zip(seqs, num_new_tokens, strict=True):
        c = seq.num_computed
        prompt_len = seq.num_own_prompt_tokens
        lo = max(c, first(seq)) if wanted(seq) else prompt_len
        # Positions lo .. c+n-1 predict tokens lo+1 .. c+n; only those still in the prompt count.
        hi = min(c + n, prompt_len - 1)
        if lo < hi:
            if pending and sum(len(h) for _, _, h in pending) + hi - lo > LOGITS_ROWS:
                yield from flush()
            pending.append((seq, lo, hidden[start + lo - c : start + hi - c]))
        start += n
    if pending:
        yield from flush()


def record_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    seqs: Seq[Sequence],
    num_new_tokens: Seq[int],
) -> None:
    """Each requesting sequence's prompt log-probs and their top-k, as its prefill computes them."""
    parts = prompt_slices(
        compute_logits, hidden, seqs, num_new_tokens, lambda s: s.params.prompt_logprobs is not None
    )
    for part in parts:
        seq, c, k = part.seq, part.start, part.seq.params.prompt_logprobs
        assert k is not None
        if seq.reply.prompt_logprobs is None:
            seq.reply.prompt_logprobs = [None] * seq.num_own_prompt_tokens
        picked = part.picked()
        top = torch.topk(part.logprobs, min(k, part.logprobs.shape[-1])) if k > 0 else None
        for j in range(len(picked)):
            entry: dict[int, float] = {}
            if top is not None:
                entry = dict(zip(top.indices[j].tolist(), top.values[j].tolist(), strict=True))
            entry[int(part.targets[j])] = picked[j]
            seq.reply.prompt_logprobs[c + 1 + j] = entry
