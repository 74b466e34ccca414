"""Engine option `compile_decode`: one-sequence decode steps through torch.compile, checked
against transformers (every generated token's log-probs) and against the eager engine."""

from __future__ import annotations

import pytest
import torch
from oracle import hf_greedy, hf_model

from chunkcache import LLM, SamplingParams
from chunkcache.model import llama

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog near the river bank",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28",
]


def _llm(path, **options) -> LLM:
    return LLM(str(path), device="cpu", kv_cache_tokens=4096, chunk_cache_size_gb=0.01, **options)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_decode_matches_transformers(checkpoint, arch: str) -> None:
    path = checkpoint(arch=arch, tie_word_embeddings=True)
    llm = _llm(path, compile_decode=True)
    model = llm.engine.runner.model
    started = model.compiled_steps  # the start-up step that builds the graph
    assert started == 1
    hf = hf_model(path)
    for prompt in PROMPTS:  # one at a time: every decode step is the compiled shape
        out = llm.generate([prompt], GREEDY)[0]
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(path, out.prompt_token_ids, len(tokens))
        with torch.no_grad():
            logits = hf(torch.tensor([out.prompt_token_ids + tokens])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1)[len(out.prompt_token_ids) - 1 : -1]
        for step, top in enumerate(out.outputs[0].logprobs):
            for token, lp in top.items():
                assert abs(ref[step, token].item() - lp) < 1e-4, (step, token)
    # Every decode step but the first token's (a prefill) ran compiled.
    assert model.compiled_steps - started == len(PROMPTS) * (GREEDY.max_tokens - 1)
    llm.check_integrity()


def test_batched_and_chunked_steps_stay_eager(checkpoint) -> None:
    """Steps of another shape (several sequences, a prefill beside a decode) run the eager
    forward, with the same results as an engine without the option."""
    path = checkpoint(arch="llama")
    compiled = _llm(path, compile_decode=True, max_num_batched_tokens=9, max_num_seqs=2)
    eager = _llm(path, max_num_batched_tokens=9, max_num_seqs=2)
    a = compiled.generate(PROMPTS, GREEDY)
    b = eager.generate(PROMPTS, GREEDY)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert p.keys() == q.keys()
            assert max(abs(p[t] - q[t]) for t in p) < 1e-5
    compiled.check_integrity()


def test_packed_one_row_layout_is_refused(checkpoint, monkeypatch) -> None:
    """Without narrow copies a packed projection serves 1-row steps, which inductor cannot
    lower: the option is refused at start-up with a message naming the fix."""
    monkeypatch.setattr(llama, "packing_pays", lambda linear, rows: True)
    with pytest.raises(ValueError, match="compile_decode needs narrow_weights"):
        _llm(checkpoint(arch="llama"), compile_decode=True, narrow_weights=False)
