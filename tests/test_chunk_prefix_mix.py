"""Chunked requests beside plain ones, with the prefix cache on and off, in either order.

Regression: an "offset" request has no borrowed slots, so the scheduler matched it against the
prefix cache; after a plain request over the same tokens it then skipped blend (its output was
a full prefill's) and reported more cached tokens than its prompt has. With the prefix cache off,
the match zeroed the count of its system part. Outputs are checked against transformers.
"""

from __future__ import annotations

import pytest
import torch

from chunkcache import LLM
from tests.support.engines import tiny_llm as _llm
from tests.support.oracle import (
    chunk_isolated_mask,
    hf_logprobs_with_mask,
    hf_offset_reuse_logprobs,
    hf_slices_reuse_logprobs,
)
from tests.support.prompts import FIRST, REUSE, SEP

SYSTEM = "You answer questions about the documents below, briefly and only from them."
DOCS = [
    "Alice lives in Paris and drinks tea every morning before she walks to the market.",
    "The red box in the attic holds 42 coins, three keys and an old letter from Rome.",
    "Bob was born in 1990 in Rome, the capital of Italy, and he works as a baker there.",
]
QUESTION = "Where does Alice live?"
PROMPT = SYSTEM + SEP + SEP.join(DOCS) + SEP + QUESTION
ISOLATED = {"chunk_layout": "isolated"}


def _reference(path, llm: LLM, layout: str, prefix_caching: bool = True) -> torch.Tensor:
    tok = llm.tokenizer
    sys_ids = tok.encode(SYSTEM, add_special_tokens=True)
    chunks = [tok.encode(d, add_special_tokens=False) for d in DOCS]
    q_ids = tok.encode(QUESTION, add_special_tokens=False)
    if layout == "offset" and prefix_caching:
        # The blocks are registered for follow-ups: the last chunk's tokens after its last full
        # block run fresh (BlendInput.fresh_from), the rest is reused.
        fresh = (len(sys_ids) + sum(map(len, chunks))) // 16 * 16
        s = len(sys_ids)
        pieces = [(sys_ids, 0, s)]
        end = s
        for c in chunks:
            n = max(0, min(len(c), fresh - end))
            if n:
                pieces.append((sys_ids + c, s, n))
            end += len(c)
        joined = sys_ids + [t for c in chunks for t in c] + q_ids
        return hf_slices_reuse_logprobs(path, pieces, joined[fresh:])
    if layout == "offset":
        return hf_offset_reuse_logprobs(path, sys_ids, chunks, q_ids)
    mask, positions = chunk_isolated_mask(len(sys_ids), [len(c) for c in chunks], len(q_ids))
    ids = sys_ids + [t for c in chunks for t in c] + q_ids
    return hf_logprobs_with_mask(path, ids, mask, positions)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-on", "prefix-off"])
@pytest.mark.parametrize("layout", ["offset", "isolated"])
@pytest.mark.parametrize("order", ["plain-first", "chunked-first"])
def test_chunked_and_plain_requests_mix(checkpoint, prefix_caching: bool, layout: str, order: str) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    # exact_prefix_reads off: with it a chunked request after a plain prefill of its tokens reads
    # that exact prefix on purpose (tests/test_fusion_follow_ups.py); here none may read it.
    llm = _llm(path, enable_prefix_caching=prefix_caching, exact_follow_ups=False, exact_prefix_reads=False)
    options = REUSE if layout == "offset" else ISOLATED
    ref = _reference(path, llm, layout, prefix_caching)
    # The plain request is the chunked prompt's own token ids: every block of it is then in the
    # prefix cache, the worst case for a chunked request that wrongly matches the prefix.
    joined = llm.generate(PROMPT, FIRST, chunk_options=options)[0].prompt_token_ids
    llm = _llm(path, enable_prefix_caching=prefix_caching, exact_follow_ups=False, exact_prefix_reads=False)
    plain_first = order == "plain-first"
    if plain_first:
        llm.generate([joined], FIRST)
    cold = llm.generate(PROMPT, FIRST, chunk_options=options)[0]
    if not plain_first:
        llm.generate([joined], FIRST)
    warm = llm.generate(PROMPT, FIRST, chunk_options=options)[0]

    tok = llm.tokenizer
    num_sys = len(tok.encode(SYSTEM, add_special_tokens=True))
    num_docs = sum(len(tok.encode(d, add_special_tokens=False)) for d in DOCS)
    for out in (cold, warm):
        for token, lp in out.outputs[0].logprobs[0].items():
            assert abs(ref[token].item() - lp) < 1e-4, (out is warm, token, ref[token].item(), lp)
        assert out.num_cached_tokens <= len(out.prompt_token_ids)
        assert not out.blend_fallback
    # Cold: S and the documents were computed for this request; warm: all of them are reused.
    assert cold.num_cached_tokens == 0
    if layout == "offset" and prefix_caching:
        # Ratio 0: every chunk token reused but the last chunk's after its last full block.
        assert cold.num_blend_reused_tokens == (num_sys + num_docs) // 16 * 16 - num_sys
        # The same prompt again reads the cold request's blended blocks: no pool, no blend.
        assert warm.num_blend_reused_tokens == warm.num_blend_recomputed_tokens == 0
        assert warm.num_prefix_cached_tokens == (len(warm.prompt_token_ids) - 1) // 16 * 16
        assert llm.chunk_cache_stats()["blended_prefix_hits"] == 1
    else:
        if layout == "offset":
            assert cold.num_blend_reused_tokens == warm.num_blend_reused_tokens == num_docs
        assert warm.num_prefix_cached_tokens == num_sys
        assert warm.num_chunk_cached_tokens == num_docs
    llm.check_integrity()


def test_blend_holds_all_its_blocks_under_a_small_token_budget(checkpoint) -> None:
    """A blend prefill under a small budget runs its layers in pieces, every token's KV written at
    each layer, so it holds blocks for all its tokens from its first piece on (admitted with the
    budget's share of its blocks only, it once failed, shape mismatch, and silently fell back to a
    plain prefill)."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path, max_num_batched_tokens=32)
    llm.generate(PROMPT, FIRST, chunk_options=ISOLATED)  # warm the pool
    out = llm.generate(PROMPT, FIRST, chunk_options=REUSE)[0]
    assert len(out.prompt_token_ids) > 32
    assert not out.blend_fallback
    assert llm.chunk_cache_stats()["blend_fallbacks"] == 0
    ref = _reference(path, llm, "offset")
    for token, lp in out.outputs[0].logprobs[0].items():
        assert abs(ref[token].item() - lp) < 1e-4
    llm.check_integrity()
