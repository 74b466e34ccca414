"""Engine option `compile_decode`: one-sequence decode steps through torch.compile, checked
against transformers (every generated token's log-probs) and against the eager engine."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from chunkcache import SamplingParams
from chunkcache.model import llama
from chunkcache.model.linear import Linear, _sum_blocks
from tests.support.engines import tiny_llm
from tests.support.oracle import hf_greedy, hf_model, linear_reference

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog near the river bank",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28",
]


_llm = partial(tiny_llm, kv_cache_tokens=4096, chunk_cache_size_gb=0.01)


# The 1-row products of the compiled step: inductor's multiply-sum loops or BLAS calls. Which one
# runs is timed per projection kind at start-up (`time_one_row_products`); here each is forced
# once for all kinds, and a mix is forced below.
@pytest.mark.parametrize(("arch", "products"), [("llama", "fused"), ("qwen3", "blas")])
def test_compiled_decode_matches_transformers(checkpoint, monkeypatch, arch: str, products: str) -> None:
    timings = (0.0, 1.0) if products == "fused" else (1.0, 0.0)  # (fused, BLAS) seconds
    monkeypatch.setattr(llama, "time_one_row_products", lambda linears: {m.kind: timings for m in linears})
    path = checkpoint(arch=arch, tie_word_embeddings=True)
    llm = _llm(path, compile_decode=True)
    model = llm.engine.runner.model
    assert model.fused_products == (products == "fused")
    layer_linears = [m for m in model.layers.modules() if isinstance(m, Linear)]
    # The [out, in] copies are held only where the compiled step reads them.
    assert all((m.fused is not None) == model.fused_products for m in [*layer_linears, model.lm_head])
    if model.fused_products:  # the tied lm_head's fused weight is the embedding itself, no copy
        assert model.lm_head.fused[0].data_ptr() == model.embed_tokens.weight.data_ptr()
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


@pytest.mark.slow  # torch.compile
@pytest.mark.parametrize(
    ("n_in", "n_out", "bias", "gated", "with_residual", "narrow"),
    [
        (96, 160, True, True, False, "transposed"),
        (160, 96, True, False, True, "dense"),
        (8960, 24, True, False, True, "dense"),  # longer than a cascade: summed in 4 blocks
    ],
)
def test_fused_one_row_products_match_f_linear(
    n_in: int, n_out: int, bias: bool, gated: bool, with_residual: bool, narrow: str
) -> None:
    """Under torch.compile a Linear holding its fused weight computes 1-3 rows as a multiply-sum;
    eager, the same Linear still takes BLAS. Both against F.linear."""
    gen = torch.Generator().manual_seed(n_in)
    lin = Linear(n_in, n_out, bias=bias, gated=gated)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=gen) * 0.1)
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(n_out, generator=gen))
    weight, b = lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()
    assert lin.prepare(pack=False, narrow_copy=True)[0] == narrow
    assert lin.hold_fused_weight()
    compiled = torch.compile(lin, dynamic=True)
    out_size = n_out // 2 if gated else n_out
    # A sum of 8960 float32 products rounds ~1e-5 of its size apart in another order.
    tol = 1e-5 if n_in <= 160 else 1e-4
    for rows in (1, 3):
        x = torch.randn(rows, n_in, generator=gen)
        residual = torch.randn(rows, out_size, generator=gen) if with_residual else None
        ref = linear_reference(x, weight, b, gated, residual)
        with torch.inference_mode():
            torch.testing.assert_close(compiled(x, residual), ref, atol=tol, rtol=tol)
            torch.testing.assert_close(lin(x, residual), ref, atol=tol, rtol=tol)


def test_long_rows_are_summed_in_the_fewest_blocks_under_a_cascade() -> None:
    assert [_sum_blocks(n) for n in (1536, 4096, 4864, 8960, 4099)] == [1, 1, 2, 4, 1]  # 4099: prime


def test_packed_narrow_layout_holds_no_fused_weight() -> None:
    lin = Linear(96, 160, bias=False)
    with torch.no_grad():
        lin.weight.normal_()
    if lin.prepare(pack=True, narrow_copy=False)[0] != "packed":
        pytest.skip("torch built without oneDNN")
    assert not lin.hold_fused_weight() and lin.fused is None


def test_products_chosen_per_projection_kind(checkpoint, monkeypatch) -> None:
    """Fused where its kind measured faster, BLAS elsewhere: the lm_head and gate/up fused, the
    rest BLAS; greedy tokens as transformers'."""
    timings = {}

    def fake_timings(linears):
        for m in linears:
            timings[m.kind] = (0.0, 1.0) if m.out_features > 2 * m.in_features else (1.0, 0.0)
        return timings

    monkeypatch.setattr(llama, "time_one_row_products", fake_timings)
    path = checkpoint(arch="llama", tie_word_embeddings=True)
    llm = _llm(path, compile_decode=True)
    model = llm.engine.runner.model
    linears = [*[m for m in model.layers.modules() if isinstance(m, Linear)], model.lm_head]
    assert {m.fused is not None for m in linears} == {True, False}
    assert all((m.fused is not None) == (timings[m.kind][0] < timings[m.kind][1]) for m in linears)
    assert model.lm_head.fused is not None
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    tokens = out.outputs[0].token_ids
    assert tokens == hf_greedy(path, out.prompt_token_ids, len(tokens))
    llm.check_integrity()
