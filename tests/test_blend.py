"""Layout "offset" and blend (docs/design.md §3) against transformers."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from chunkcache import LLM, SamplingParams
from chunkcache.core.kv_slots import block_slots
from chunkcache.errors import InvalidRequestError
from tests.support.engines import tiny_llm
from tests.support.oracle import (
    chunk_isolated_mask,
    hf_first_token_logprobs,
    hf_greedy,
    hf_greedy_with_mask,
    hf_layer_kv,
    hf_offset_reuse_logprobs,
)
from tests.support.prompts import DOCS, FIRST, FULL, QUESTIONS, REUSE, SEP, SYSTEM, chunked

# The blend alone, against its oracles: with the prefix cache on, a blend's blocks are registered
# for follow-ups and the last chunk's tail runs fresh (test_follow_ups.py).
_llm = partial(tiny_llm, enable_prefix_caching=False)


def _prompt(doc_ids: list[int], question: str = QUESTIONS[0]) -> str:
    return chunked(SYSTEM, [DOCS[i] for i in doc_ids], question)


def _parts(llm: LLM, doc_ids: list[int], question: str = QUESTIONS[0]):
    tok = llm.tokenizer
    sys_ids = tok.encode(SYSTEM, add_special_tokens=True)
    chunks = [tok.encode(DOCS[i], add_special_tokens=False) for i in doc_ids]
    return sys_ids, chunks, tok.encode(question, add_special_tokens=False)


def _assert_logprobs_close(out, ref: torch.Tensor, tol: float = 1e-4) -> None:
    for token, lp in out.outputs[0].logprobs[0].items():
        assert abs(ref[token].item() - lp) < tol, (token, ref[token].item(), lp)


@pytest.mark.parametrize("rope", ["default", "linear", "llama3", "yarn"])
def test_rerotation_is_exact(checkpoint, rope: str) -> None:
    path = checkpoint(arch="llama", rope=rope)
    llm = _llm(path)
    llm.generate(_prompt([0, 2]), FIRST)  # fills the pool with the isolated entries
    engine = llm.engine
    sys_ids, chunks, _ = _parts(llm, [0, 2])
    s = len(sys_ids)
    entry = next(
        e for e in engine.chunks.pool._entries.values() if e.token_ids == (tuple(sys_ids), tuple(chunks[1]))
    )
    slots = block_slots(entry.pages, 16, entry.num_tokens, engine.device)
    cached_k = engine.runner.kv_caches[0][0][slots]  # computed at [s, s + len)
    delta = len(chunks[0])  # natural offset of the second chunk minus s
    moved = engine.runner.model.rotary.rerotate(cached_k, torch.full((slots.numel(),), delta))
    natural = hf_layer_kv(path, sys_ids + chunks[0] + chunks[1])[0][0]  # [Hk, T, D]
    expected = natural[:, s + delta : s + delta + len(chunks[1])].transpose(0, 1)
    torch.testing.assert_close(moved, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ratio_one_at_layer_zero_is_a_full_prefill(checkpoint, arch: str) -> None:
    path = checkpoint(arch=arch, num_hidden_layers=3)
    llm = _llm(path)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    for doc_ids in ([0, 1, 2], [3, 0]):
        llm.generate(_prompt(doc_ids), FIRST)  # warm: every chunk now comes from the pool
        out = llm.generate(_prompt(doc_ids), greedy, chunk_options=FULL)[0]
        # Every chunk token is recomputed: only S (never recomputed) counts as cached.
        assert out.num_chunk_cached_tokens == 0
        assert out.num_prefix_cached_tokens == len(_parts(llm, doc_ids)[0])
        ids = out.prompt_token_ids
        _assert_logprobs_close(out, hf_first_token_logprobs(path, ids))
        assert out.outputs[0].token_ids == hf_greedy(path, ids, 16)
        assert out.num_blend_reused_tokens == 0
    llm.check_integrity()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ratio_zero_is_offset_reuse(checkpoint, arch: str) -> None:
    path = checkpoint(arch=arch, num_hidden_layers=3)
    llm = _llm(path)
    for doc_ids, question in (([0, 1, 2], QUESTIONS[0]), ([4, 3], QUESTIONS[2])):
        out = llm.generate(_prompt(doc_ids, question), FIRST, chunk_options=REUSE)[0]
        sys_ids, chunks, q_ids = _parts(llm, doc_ids, question)
        _assert_logprobs_close(out, hf_offset_reuse_logprobs(path, sys_ids, chunks, q_ids))
        assert out.num_blend_recomputed_tokens == len(q_ids)
    llm.check_integrity()


def test_kl_shrinks_as_the_ratio_grows(checkpoint) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=4)
    llm = _llm(path)
    vocab = llm.engine.spec.vocab_size
    every = SamplingParams(temperature=0, max_tokens=1, logprobs=vocab)
    prompts = [(d, q) for d in ([0, 1, 2], [2, 3, 4], [4, 0, 3, 1]) for q in QUESTIONS]
    kl: dict[float, float] = {}
    for ratio in (1.0, 0.5, 0.0):
        opts = {"chunk_layout": "offset", "blend_check_layers": [1], "blend_recompute_ratios": [ratio]}
        total = 0.0
        for doc_ids, question in prompts:
            out = llm.generate(_prompt(doc_ids, question), every, chunk_options=opts)[0]
            ref = hf_first_token_logprobs(path, out.prompt_token_ids)
            mine = torch.full((vocab,), float("-inf"))
            for token, lp in out.outputs[0].logprobs[0].items():
                mine[token] = lp
            total += float((ref.exp() * (ref - mine)).sum())
        kl[ratio] = total / len(prompts)
    assert kl[1.0] < 1e-6
    assert kl[1.0] < kl[0.5] < kl[0.0], kl


def test_selectors_and_boundary_tokens(checkpoint) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    prompt = _prompt([0, 1, 2])
    _, chunks, q_ids = _parts(llm, [0, 1, 2])
    n_chunk = sum(map(len, chunks))
    epic = llm.generate(prompt, FIRST, chunk_options={**REUSE, "blend_boundary_tokens": 2})[0]
    assert epic.num_blend_recomputed_tokens == 2 * len(chunks) + len(q_ids)
    v_dev = llm.generate(
        prompt,
        FIRST,
        chunk_options={
            "chunk_layout": "offset",
            "blend_selector": "v_deviation",
            "blend_check_layers": [1],
            "blend_recompute_ratios": [0.3],
        },
    )[0]
    assert v_dev.num_blend_reused_tokens == n_chunk - -(-3 * n_chunk // 10)
    # Threshold 0 keeps every token that deviates at all: all but the first chunk's, whose cached KV
    # (S then the chunk) is exactly what full attention computes.
    everything = llm.generate(
        prompt,
        FIRST,
        chunk_options={
            "chunk_layout": "offset",
            "blend_selector": "threshold",
            "blend_check_layers": [1],
            "blend_threshold": 0.0,
        },
    )[0]
    assert everything.num_blend_reused_tokens <= len(chunks[0])
    _assert_logprobs_close(everything, hf_first_token_logprobs(path, everything.prompt_token_ids))
    # Gradual filtering over two check layers.
    two = llm.generate(
        prompt,
        FIRST,
        chunk_options={
            "chunk_layout": "offset",
            "blend_check_layers": [1, 2],
            "blend_recompute_ratios": [0.5, 0.2],
            "blend_selector": "k_deviation",
        },
    )[0]
    assert two.num_blend_reused_tokens == n_chunk - -(-2 * n_chunk // 10)
    llm.check_integrity()


def test_blend_never_pollutes_the_pool(checkpoint) -> None:
    path = checkpoint(arch="qwen3", num_hidden_layers=3)
    llm = _llm(path, enable_prefix_caching=True)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(
        _prompt([0, 1]), greedy, chunk_options={"chunk_layout": "offset", "blend_recompute_ratios": [0.5]}
    )
    out = llm.generate(_prompt([1, 0]), greedy, chunk_options={"chunk_layout": "isolated"})[0]
    assert out.num_chunk_cached_tokens > 0
    sys_ids, chunks, q_ids = _parts(llm, [1, 0])
    mask, positions = chunk_isolated_mask(len(sys_ids), [len(c) for c in chunks], len(q_ids))
    assert out.outputs[0].token_ids == hf_greedy_with_mask(path, out.prompt_token_ids, mask, positions, 8)
    # Nor the prefix cache: a plain request over the same tokens computes everything.
    plain = llm.generate([out.prompt_token_ids], greedy)[0]
    assert plain.num_cached_tokens <= len(sys_ids)
    assert plain.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, 8)


def test_blend_failure_falls_back_to_plain_prefill(checkpoint, monkeypatch) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path, enable_prefix_caching=True)
    import chunkcache.engine.runner as runner_module

    def broken(*args, **kwargs):
        raise RuntimeError("injected blend failure")

    monkeypatch.setattr(runner_module.BlendRun, "run", broken)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([_prompt([0, 1]), _prompt([2, 1])], greedy, chunk_options={"chunk_layout": "offset"})
    for out in outs:
        assert out.blend_fallback
        _assert_logprobs_close(out, hf_first_token_logprobs(path, out.prompt_token_ids))
        assert out.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, 12)
    assert llm.chunk_cache_stats()["blend_fallbacks"] == 2
    # A fallback's KV is a plain prefill's: a plain prompt over the same tokens finds it all.
    again = llm.generate([outs[0].prompt_token_ids], FIRST)[0]
    assert again.num_cached_tokens == (len(outs[0].prompt_token_ids) - 1) // 16 * 16
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.check_integrity()


def test_min_tokens_gives_plain_prefill(checkpoint) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    out = llm.generate(
        _prompt([0, 1]), FIRST, chunk_options={"chunk_layout": "offset", "blend_min_tokens": 10_000}
    )[0]
    assert out.num_chunk_cached_tokens == 0 and out.num_blend_recomputed_tokens == 0
    _assert_logprobs_close(out, hf_first_token_logprobs(path, out.prompt_token_ids))


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"chunk_layout": "offset", "blend_check_layers": [7]}, "out of range"),
        ({"blend_recompute_ratios": [1.5]}, "[0, 1]"),
        ({"blend_check_layers": [0, 1], "blend_recompute_ratios": [0.1, 0.5]}, "must not increase"),
        ({"blend_check_layers": [0, 1]}, "one ratio per check layer"),
        (
            {"blend_selector": "k_deviation", "blend_check_layers": [0]},
            "at check layer 0 differ by rounding only",
        ),
        ({"blend_selector": "threshold", "blend_check_layers": [0]}, "give blend_check_layers from 1"),
        ({"blend_selector": "random"}, "blend_selector 'random'"),
        ({"chunk_layout": "diagonal"}, "chunk_layout 'diagonal'"),
        ({"blend_boundary_tokens": -1}, "blend_boundary_tokens"),
        ({"blend_unit": "sentence"}, "blend_unit 'sentence'"),
        ({"blend_unit": "chunk", "blend_selector": "threshold"}, "ranking selector"),
        ({"max_chunks": 3}, "unknown per-request chunk option 'max_chunks'"),
    ],
)
def test_bad_blend_options_are_rejected(checkpoint, options: dict, needle: str) -> None:
    llm = _llm(checkpoint(arch="llama", num_hidden_layers=3))
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(_prompt([0, 1]), FIRST, chunk_options=options)
    assert needle in str(info.value)
    assert not llm.engine.has_unfinished_requests()
    llm.check_integrity()


def test_engine_level_offset_layout(checkpoint) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path, chunk_layout="offset", blend_check_layers=[0], blend_recompute_ratios=[1.0])
    out = llm.generate(_prompt([2, 0]), FIRST)[0]
    _assert_logprobs_close(out, hf_first_token_logprobs(path, out.prompt_token_ids))
    with pytest.raises(ValueError, match="out of range"):
        _llm(path, chunk_layout="offset", blend_check_layers=[5])


def test_eval_cli_runs_every_mode(checkpoint, tmp_path, capsys) -> None:
    import json

    from chunkcache.cli import main

    path = checkpoint(arch="llama", num_hidden_layers=3)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": _prompt([0, 1, 2])})
        + "\n"
        + json.dumps({"system": SYSTEM, "chunks": [DOCS[3], DOCS[4]], "question": QUESTIONS[2]})
        + "\n"
    )
    out_json = tmp_path / "eval.json"
    args = ["eval", "--model", str(path), "--prompts", str(prompts), "--max-tokens", "4"]
    args += ["--dtype", "float32", "--kv-cache-tokens", "1024", "--chunk-cache-size-gb", "0.001"]
    args += ["--json", str(out_json)]
    assert main(args) == 0
    table = capsys.readouterr().out
    names = ["full", "isolated", "offset", "blend@0.05", "blend@0.15", "blend@0.3", "boundary-4"]
    for name in names:
        assert name in table
    results = {r["mode"]: r for r in json.loads(out_json.read_text())}
    assert list(results) == names
    full = results["full"]
    assert full["top1_agreement"] == 1.0 and full["exact_match"] == 1.0 and full["mean_kl"] == 0.0
    assert all(r["prompts"] == 2 and r["mean_kl"] >= 0 for r in results.values())
    assert 0 < results["blend@0.3"]["recomputed_share"] <= 1


def test_query_attention_scores_match_explicit_softmax() -> None:
    from chunkcache.engine.blend_select import query_attention as _query_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 4, 8, generator=gen)  # 7 rows, 4 query heads, head dim 8
    keys = torch.randn(9, 2, 8, generator=gen)  # 9 keys, 2 KV heads (GQA: 2 query heads each)
    got = _query_attention(q, keys, num_query=3, scale=0.5)
    want = torch.zeros(9)
    for row in range(4, 7):
        for h in range(4):
            logits = (keys[:, h // 2] @ q[row, h]) * 0.5
            want += logits.softmax(dim=0)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("unit", ["token", "chunk"])
def test_query_attention_selector(checkpoint, unit: str) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    docs = [0, 2, 3]
    _, chunks, _ = _parts(llm, docs)
    llm.generate(_prompt(docs), FIRST)  # warm
    query = {**FULL, "blend_selector": "query_attention", "blend_unit": unit}
    # Ratio 1.0 at layer 0 recomputes everything, whichever the ranking: a full prefill.
    out = llm.generate(_prompt(docs), FIRST, chunk_options=query)[0]
    _assert_logprobs_close(out, hf_first_token_logprobs(path, out.prompt_token_ids))
    assert out.num_blend_reused_tokens == 0
    # A budget of exactly the longest chunk: by chunk, that one chunk or a set of shorter ones
    # that fit, never a part of one; by token, exactly the budget.
    lengths = [len(c) for c in chunks]
    ratio = max(lengths) / sum(lengths)
    partial = {**query, "blend_check_layers": [1], "blend_recompute_ratios": [ratio]}
    out = llm.generate(_prompt(docs), FIRST, chunk_options=partial)[0]
    recomputed = sum(lengths) - out.num_blend_reused_tokens
    if unit == "token":
        assert recomputed == max(lengths)
    else:
        assert recomputed <= max(lengths)
        assert any(
            recomputed == sum(lengths[i] for i in subset)
            for subset in ([0], [1], [2], [0, 1], [0, 2], [1, 2])
        )
    assert not out.blend_fallback
    llm.check_integrity()


def _record(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list:
    """Wrap `owner.name` so that each of its return values is appended to the returned list."""
    results: list = []
    real = getattr(owner, name)

    def spy(*args):
        results.append(real(*args))
        return results[-1]

    monkeypatch.setattr(owner, name, spy)
    return results


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # q/k/v bias; per-head k-norm
def test_check_layer_recomputes_the_tokens_transformers_ranks_first(checkpoint, monkeypatch, arch) -> None:
    """At check layer 1 with K deviation, the chunk tokens that keep running are those whose
    fresh K deviates most from their cached K, both taken from transformers: fresh = the full
    prefill's layer-1 K (layer 0 runs every token, so layer 1 sees exactly a full prefill's
    input), cached = the run of S + that chunk alone, re-rotated to the chunk's offset. Blend
    projects only K for this choice (`_project_k`); a wrong slice, bias, norm or rotation there
    ranks other tokens first."""
    import chunkcache.engine.blend as blend
    import chunkcache.engine.runner as runner
    from chunkcache.model.linear import Linear
    from tests.support.oracle import hf_rerotate

    path = checkpoint(arch=arch, num_hidden_layers=3)
    llm = _llm(path)
    results = _record(monkeypatch, runner.BlendRun, "result")
    docs, ratio = [2, 3, 1], 0.3
    options = {
        "chunk_layout": "offset",
        "blend_check_layers": [1],
        "blend_recompute_ratios": [ratio],
        "blend_selector": "k_deviation",
    }
    out = llm.generate(_prompt(docs), FIRST, chunk_options=options)[0]
    sys_ids, chunks, q_ids = _parts(llm, docs)
    assert out.prompt_token_ids == sys_ids + [t for c in chunks for t in c] + q_ids
    s, n = len(sys_ids), sum(len(c) for c in chunks)
    fresh = hf_layer_kv(path, out.prompt_token_ids)[1][0][:, s : s + n]  # [Hk, n, D]
    cached, offset = [], s
    for c in chunks:
        alone = hf_layer_kv(path, sys_ids + c)[1][0][:, s:]
        cached.append(hf_rerotate(path, alone, offset - s))
        offset += len(c)
    # The K-only projection is the K of the model's own projection (bias, norm and RoPE included).
    attn = llm.engine.runner.model.layers[1].self_attn
    x = torch.randn(7, attn.qkv_proj.in_features)
    rope = attn.rotary.table(torch.tensor([0, 3, 5, 8, 13, 21, 34]), x.dtype)
    with torch.inference_mode():
        want = attn.project(x, rope)[1]
        torch.testing.assert_close(blend._project_k(attn, x, rope), want)
    # ... from whichever layouts the projection holds: dense, transposed, or only oneDNN's opaque one
    served = attn.qkv_proj
    weight, bias = served.dense_weight()
    for pack, narrow_copy, held in (
        (False, True, "transposed"),
        (True, True, "packed"),
        (True, False, "packed"),
    ):
        lin = Linear(served.in_features, served.out_features, bias=bias is not None)
        with torch.no_grad():
            lin.weight.copy_(weight)
            if bias is not None:
                lin.bias.copy_(bias)
        assert held in lin.prepare(pack, narrow_copy) and lin.weight is None
        attn.qkv_proj = lin
        try:
            with torch.inference_mode():
                torch.testing.assert_close(blend._project_k(attn, x, rope), want)
        finally:
            attn.qkv_proj = served
    deviation = (fresh - torch.cat(cached, dim=1)).pow(2).sum(dim=(0, 2))  # [n]
    recomputed = ~results[-1].reused[s:]
    assert int(recomputed.sum()) == -(-3 * n // 10)
    # Every chosen token deviates at least as much as every other (up to float noise).
    assert deviation[recomputed].min() >= deviation[~recomputed].max() - 1e-4 * deviation.max()
    assert deviation[recomputed].min() > 1e-3 * deviation.max()  # not a tie among zeros


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_exact_first_chunk_is_reused_without_running(checkpoint, monkeypatch, arch) -> None:
    """The first chunk, computed right after this S, holds a full prefill's KV, so blend does not
    run it. With a ratio that recomputes every other chunk token at check layer 1, the result
    is then a full prefill (transformers), with the first chunk's tokens reused."""
    import chunkcache.engine.blend as blend

    path = checkpoint(arch=arch, num_hidden_layers=3)
    llm = _llm(path)
    skipped = _record(monkeypatch, blend, "_exact_never_chosen")
    docs = [1, 3, 2]
    _, chunks, _ = _parts(llm, docs)
    n, first = sum(len(c) for c in chunks), len(chunks[0])
    options = {
        "chunk_layout": "offset",
        "blend_check_layers": [1],
        "blend_recompute_ratios": [(n - first) / n],
    }
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    out = llm.generate(_prompt(docs), greedy, chunk_options=options)[0]
    assert skipped == [True] and not out.blend_fallback
    assert out.num_blend_reused_tokens == first
    _assert_logprobs_close(out, hf_first_token_logprobs(path, out.prompt_token_ids))
    # Decode reads the request's blocks: the reused chunk's KV was written there too.
    assert out.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, 6)
    llm.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_rows_equals_masked_attention(dtype: torch.dtype) -> None:
    """Blend's per-layer attention without a mask equals SDPA with the causal mask over its rows."""
    import torch.nn.functional as F

    from chunkcache.model.row_attention import attend_rows, plan_rows

    gen = torch.Generator().manual_seed(0)
    total, heads, kv_heads, dim = 700, 6, 2, 16
    k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    scattered = torch.randperm(total, generator=gen)[:150].sort().values
    patterns = {
        "all": torch.arange(total),
        "tail": torch.arange(37, total),  # ratio 1: every token after S
        "scattered": scattered,
        "scattered+runs": torch.cat(
            [scattered[scattered < 300], torch.arange(300, 520), torch.tensor([600, 699])]
        ),
        "one": torch.tensor([5]),
        "last-block": torch.tensor([650, 660, 699]),
        "spread-from-0": torch.tensor([0, 2, 3, 9, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 300]),
    }
    seen: set[str] = set()  # which paths ran: every one must
    for name, rows in patterns.items():
        q = torch.randn(rows.numel(), heads, dim, generator=gen).to(dtype)
        mask = torch.arange(total)[None, :] <= rows[:, None]
        want = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].float(),
            k.transpose(0, 1)[None].float(),
            v.transpose(0, 1)[None].float(),
            attn_mask=mask,
            scale=0.3,
            enable_gqa=True,
        )[0].transpose(0, 1)
        # call_cost=0: the mask-free plan whatever it costs; the default may pick one masked call.
        # Tiny blocks (every row its own), runs as causal blocks or as masked rows, big blocks.
        for max_tail, min_run, cost in (
            (1, 2, 0),
            (64, 4, 0),
            (4096, 32, 0),
            (10**6, 10**6, 0),
            (4096, 32, 1000),
        ):
            plan = plan_rows(rows, heads, kv_heads, dtype, max_tail=max_tail, min_run=min_run, call_cost=cost)
            got = attend_rows(q, k, v, plan, 0.3)
            seen.add(plan.kind)
            seen.update("causal" if b.mask is None else "masked span" for b in plan.blocks)
            seen.update("at head" for b in plan.blocks if b.first == 0)
            assert got.dtype == dtype
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(
                got.float(),
                want,
                atol=tol,
                rtol=tol,
                msg=f"{name}, tail {max_tail}, run {min_run}, cost {cost}",
            )
    assert seen == {"head", "masked", "blocks", "causal", "masked span", "at head"}, seen


def test_offset_request_registers_its_exact_prefix(checkpoint) -> None:
    """S and the first chunk of a layout-"offset" request hold a plain prefill's KV: they enter the
    prefix cache (and its events), and a plain request over the same tokens reuses them exactly."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path, enable_prefix_caching=True)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    docs = [2, 3, 0]
    out = llm.generate(_prompt(docs), greedy, chunk_options={"chunk_layout": "offset"})[0]
    sys_ids, chunks, _ = _parts(llm, docs)
    exact = (len(sys_ids) + len(chunks[0])) // 16 * 16
    assert exact >= 32  # S and the first chunk span two full blocks
    plain = llm.generate([out.prompt_token_ids], greedy)[0]
    assert plain.num_cached_tokens == exact
    _assert_logprobs_close(plain, hf_first_token_logprobs(path, out.prompt_token_ids))
    assert plain.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, 6)
    # The isolated layout's own blocks hold Q only: nothing of another prompt is registered.
    isolated = llm.generate(_prompt([4, 1]), FIRST, chunk_options={"chunk_layout": "isolated"})[0]
    again = llm.generate([isolated.prompt_token_ids], FIRST)[0]
    assert again.num_cached_tokens <= len(sys_ids)
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.check_integrity()


def _stored(layer: int, ratio: float) -> dict:
    return {
        "chunk_layout": "offset",
        "blend_check_layers": [layer],
        "blend_recompute_ratios": [ratio],
        "blend_selector": "stored_deviation",
    }


def test_stored_sensitivity_is_measured_once_as_transformers_measures_it(checkpoint, monkeypatch) -> None:
    """Each chunk entry's sensitivity (engine/sensitivity.py) is the K/V deviation between the runs
    of S + P + C and S + C, layer-normalised, as transformers computes it; it is measured the first
    time a request ranks by it and kept with the entry, not measured again."""
    import chunkcache.engine.runner as runner
    from tests.support.oracle import hf_sensitivity

    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    measured = _record(monkeypatch, runner, "measure")
    docs = [2, 0, 4]
    llm.generate(_prompt(docs), FIRST, chunk_options=REUSE)  # computes the entries: no measuring
    assert measured == []
    llm.generate(_prompt(docs), FIRST, chunk_options=_stored(0, 0.3))
    assert len(measured) == 1 and len(measured[0]) == len(docs)  # one pass for the request
    sys_ids, chunks, _ = _parts(llm, docs)
    neutral = llm.engine.runner.neutral_ids
    assert len(neutral) > 50
    entries = {e.token_ids[-1]: e for e in llm.engine.chunks.pool.entries() if e.kind == "chunk"}
    for chunk in chunks:
        want = hf_sensitivity(path, sys_ids, neutral, chunk)
        torch.testing.assert_close(entries[tuple(chunk)].sensitivity, want, rtol=1e-3, atol=1e-5)
        assert want.max() > 2 * want.min()  # a ranking, not a constant
    llm.generate(_prompt([4, 2], QUESTIONS[1]), FIRST, chunk_options=_stored(1, 0.5))
    assert len(measured) == 1
    llm.check_integrity()


def test_stored_selector_runs_only_the_chosen_tokens(checkpoint, monkeypatch) -> None:
    """Ranked by the stored sensitivity at check layer 0, the chosen share of the chunk tokens
    (never the exact first chunk) runs through every layer and the others never run: the answer
    equals transformers running the prompt with the others' K and V projections replaced by their
    isolated ones at every layer. At ratio 1.0 it is a full prefill."""
    import chunkcache.engine.runner as runner
    from tests.support.oracle import hf_partial_reuse_logprobs

    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    results = _record(monkeypatch, runner.BlendRun, "result")
    docs, ratio = [1, 3, 2], 0.3
    out = llm.generate(_prompt(docs), FIRST, chunk_options=_stored(0, ratio))[0]
    sys_ids, chunks, q_ids = _parts(llm, docs)
    s, n, first = len(sys_ids), sum(map(len, chunks)), len(chunks[0])
    entries = {e.token_ids[-1]: e for e in llm.engine.chunks.pool.entries() if e.kind == "chunk"}
    scores = torch.cat([entries[tuple(c)].sensitivity for c in chunks[1:]])
    budget = -(-3 * n // 10)
    want = torch.zeros(n, dtype=torch.bool)
    want[first + torch.topk(scores, budget).indices] = True
    recomputed = ~results[-1].reused[s:]
    assert torch.equal(recomputed, want)
    assert out.num_blend_recomputed_tokens == budget + len(q_ids)
    ref = hf_partial_reuse_logprobs(path, sys_ids, chunks, q_ids, ~want)
    _assert_logprobs_close(out, ref)
    full = llm.generate(_prompt(docs), FIRST, chunk_options=_stored(0, 1.0))[0]
    _assert_logprobs_close(full, hf_first_token_logprobs(path, full.prompt_token_ids))
    llm.check_integrity()


def test_a_document_near_the_longest_context_is_measured_after_less_of_the_passage(checkpoint) -> None:
    """S, the passage and a document must fit the model's positions: a long document is measured
    after the end of the passage that fits, and the blend ranks by that (no fallback)."""
    path = checkpoint(arch="llama", num_hidden_layers=2, max_position_embeddings=256)
    llm = _llm(path)
    long_doc = " ".join(["Alice lives in Paris and drinks tea."] * 9)
    prompt = SYSTEM + SEP + DOCS[1] + SEP + long_doc + SEP + QUESTIONS[0]
    out = llm.generate(prompt, FIRST, chunk_options=_stored(0, 0.3))[0]
    assert not out.blend_fallback and out.num_blend_reused_tokens > 0
    entry = next(e for e in llm.engine.chunks.pool.entries() if e.kind == "chunk" and e.num_tokens > 150)
    s = len(entry.token_ids[0])
    assert s + entry.num_tokens + len(llm.engine.runner.neutral_ids) > 256  # the whole passage would not fit
    assert entry.sensitivity is not None and entry.sensitivity.shape == (entry.num_tokens,)
    assert bool(torch.isfinite(entry.sensitivity).all()) and float(entry.sensitivity.max()) > 0
    llm.check_integrity()
