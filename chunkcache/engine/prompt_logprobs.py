"""Log-probabilities of a request's prompt tokens (vLLM's `prompt_logprobs`; what `echo` with
`logprobs` on /v1/completions returns, as evaluation harnesses use it).

Prompt token i > 0 gets log p(token_i | tokens before it), read from the hidden state of position
i - 1 as the prefill computes it, plus the top-k entries there. Every prompt position must be
computed for that, so such requests skip the prefix cache and chunk mode (engine.py refuses a
chunked prompt, the scheduler does not match a prefix). Entries are stored by position, so a
preempted request that prefills again overwrites rather than appends.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from chunkcache.engine.sequence import Sequence


def record_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    seqs: Seq[Sequence],
    num_new_tokens: Seq[int],
) -> None:
    """`hidden` [tokens, hidden] of one forward whose tokens are those of `seqs` in order
    (`num_new_tokens[i]` each, the first `num_computed` of each already done)."""
    start = 0
    for seq, n in zip(seqs, num_new_tokens, strict=True):
        k = seq.params.prompt_logprobs
        c = seq.num_computed
        prompt_len = seq.num_own_prompt_tokens
        if k is not None and c < prompt_len - 1:
            # Positions c .. c+n-1 predict tokens c+1 .. c+n; only those still in the prompt count.
            m = min(n, prompt_len - 1 - c)
            logprobs = torch.log_softmax(compute_logits(hidden[start : start + m]).float(), dim=-1).cpu()
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None] * prompt_len
            targets = torch.tensor(seq.token_ids[c + 1 : c + 1 + m], dtype=torch.long)
            picked = logprobs.gather(1, targets[:, None])[:, 0].tolist()
            top = torch.topk(logprobs, min(k, logprobs.shape[-1])) if k > 0 else None
            for j in range(m):
                entry: dict[int, float] = {}
                if top is not None:
                    entry = dict(zip(top.indices[j].tolist(), top.values[j].tolist(), strict=True))
                entry[int(targets[j])] = picked[j]
                seq.prompt_logprobs[c + 1 + j] = entry
        start += n
