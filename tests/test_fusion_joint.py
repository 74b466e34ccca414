"""Layout fusion's joint stream over k documents (`fusion_max_joint`) and the bound on the
document streams that decode (`fusion_max_streams`), against transformers over each stream's own
prompt (engine/fusion.py)."""

from __future__ import annotations

from typing import Any

import torch

import chunkcache.engine.engine as engine_module
from chunkcache import LLM, SamplingParams
from chunkcache.config import ChunkConfig
from chunkcache.core.plan import ChunkedPrompt
from chunkcache.engine.fusion import FusionGroup, JointChoice, pair_tokens
from chunkcache.engine.scheduler import Scheduler
from chunkcache.server.metrics import ServerMetrics
from tests.support.oracle import hf_first_token_logprobs
from tests.test_fusion import (
    DOCS,
    GREEDY,
    STEPS,
    SYSTEM,
    _hf_stream_logprobs,
    _llm,
    _prompt,
    _reference_combine,
    _relevance,
    abort_while_the_pair_joins,
)

# Asks about three of the four documents (Alice, Bob and Carol).
THREE_QUESTION = "Where do Alice, Bob and Carol live?"


def test_the_joint_stream_reads_every_document_within_the_margin_of_the_top_one() -> None:
    relevance = [-1.0, -0.5, -2.0, -0.75]
    assert JointChoice.choose(relevance, 0.3, 3) == JointChoice((1, 3), 0.25)
    assert JointChoice.choose(relevance, 0.5, 3) == JointChoice((1, 3, 0), 0.25)
    assert JointChoice.choose(relevance, 0.5, 2).documents == (1, 3)  # the pair stream
    assert JointChoice.choose(relevance, 100, 8).documents == (1, 3, 0, 2)
    assert JointChoice.choose(relevance, 0.2, 3).documents == (1,)  # none joins
    assert JointChoice.choose([-1.0, -1.0, -1.0], 0.0, 2).documents == (0, 1)  # ties: prompt order


def test_the_kv_fit_holds_the_joint_streams_longest_documents() -> None:
    prompt = ChunkedPrompt((1, 2), ((3,) * 5, (4,) * 9, (5,) * 7, (6,) * 2), (7, 8))
    fit = lambda **kw: pair_tokens(prompt, ChunkConfig(layout="fusion", fusion_pair="lead", **kw))  # noqa: E731
    assert fit() == 9  # the pair: its second document, the longest
    assert fit(fusion_max_joint=3) == 9 + 7
    assert fit(fusion_max_joint=10) == 9 + 7 + 5  # all but one document at most
    assert pair_tokens(prompt, ChunkConfig(layout="fusion")) == 0


def _contexts(llm: LLM, doc_ids: list[int], question: str) -> tuple[list[int], list[list[int]], list[int]]:
    tok = llm.tokenizer
    sys_ids = tok.encode(SYSTEM, add_special_tokens=True)
    docs = [sys_ids + tok.encode(DOCS[i], add_special_tokens=False) for i in doc_ids]
    return sys_ids, docs, tok.encode(question, add_special_tokens=False)


def _greedy(path: Any, steps: list[list[list[int]]], q: list[int]) -> list[int]:
    """Greedy tokens of the contrastive rule over transformers' streams; `steps[t]` the streams
    (the no-document one last) whose rows step t combines, relevance from each one's Q."""
    tokens: list[int] = []
    for contexts in steps:
        relevance = torch.tensor([_relevance(path, ctx, q) for ctx in contexts])
        lp = torch.stack([_hf_stream_logprobs(path, ctx + q + tokens)[-1] for ctx in contexts])
        tokens.append(int(_reference_combine("contrastive", lp, relevance).argmax()))
    return tokens


def test_a_joint_stream_over_three_documents_is_its_own_prompt_and_leads(checkpoint, monkeypatch) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path, max_num_batched_tokens=24)  # its two documents take several steps
    seen: list[torch.Tensor] = []
    original = FusionGroup.combine
    monkeypatch.setattr(
        FusionGroup, "combine", lambda self, rows: seen.append(rows.clone()) or original(self, rows)
    )
    doc_ids = [2, 0, 3, 1]
    options = {"fusion_pair": "lead", "fusion_max_joint": 3}
    out = llm.generate(_prompt(doc_ids, THREE_QUESTION), GREEDY, chunk_options=options)[0]
    sys_ids, docs, q = _contexts(llm, doc_ids, THREE_QUESTION)
    relevance = [_relevance(path, ctx, q) for ctx in docs]
    top = sorted(sorted(range(4), key=lambda k: -relevance[k])[:3])
    joint = sys_ids + [t for k in top for t in docs[k][len(sys_ids) :]]
    # The first row: the four document streams, the joint stream, the no-document stream.
    assert seen[0].shape[0] == 6
    ref = hf_first_token_logprobs(path, joint + q)
    assert (torch.log_softmax(seen[0][4].float(), -1) - ref).abs().max() < 1e-4
    # "lead": the joint stream is the only document stream the rule reads.
    assert out.outputs[0].token_ids == _greedy(path, [[joint, sys_ids]] * STEPS, q)
    stats = llm.engine.stats()["chunk_cache"]["fusion_joint"]
    assert stats["documents"][2] == 1 and stats["documents_sum"] == 3  # one request, k = 3
    llm.check_integrity()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_only_the_most_relevant_document_streams_decode_past_the_first_step(checkpoint, monkeypatch) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path)
    sizes: list[int] = []
    original = FusionGroup.combine
    monkeypatch.setattr(
        FusionGroup, "combine", lambda self, rows: sizes.append(rows.shape[0]) or original(self, rows)
    )
    doc_ids = [1, 3, 0, 2]
    out = llm.generate(_prompt(doc_ids, THREE_QUESTION), GREEDY, chunk_options={"fusion_max_streams": 2})[0]
    assert sizes == [5] + [3] * (STEPS - 1)  # all four and S + Q, then the top two and S + Q
    sys_ids, docs, q = _contexts(llm, doc_ids, THREE_QUESTION)
    relevance = [_relevance(path, ctx, q) for ctx in docs]
    kept = sorted(sorted(range(4), key=lambda k: -relevance[k])[:2])
    steps = [[*docs, sys_ids]] + [[*(docs[k] for k in kept), sys_ids]] * (STEPS - 1)
    assert out.outputs[0].token_ids == _greedy(path, steps, q)
    llm.check_integrity()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    unbounded = llm.generate(_prompt(doc_ids, THREE_QUESTION), GREEDY)[0]
    assert unbounded.outputs[0].token_ids == _greedy(path, [[*docs, sys_ids]] * STEPS, q)


def test_the_joint_streams_choices_are_exported_as_histograms(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _llm(path)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for margin, joint in ((0.0, 2), (100.0, 4)):
        options = {"fusion_pair": "lead", "fusion_pair_margin": margin, "fusion_max_joint": joint}
        llm.generate(_prompt([0, 1, 2, 3], THREE_QUESTION), params, chunk_options=options)
    metrics = ServerMetrics("tiny")
    metrics.update_engine_stats(llm.engine.stats())
    text = metrics.render().decode()
    # Margin 0: one document (no joint stream); margin 100 with at most 4: all four.
    assert 'chunkcache_fusion_joint_documents_bucket{le="1"} 1.0' in text
    assert 'chunkcache_fusion_joint_documents_bucket{le="4"} 2.0' in text
    assert "chunkcache_fusion_joint_documents_sum 5.0" in text
    assert 'chunkcache_fusion_relevance_margin_bucket{le="+Inf"} 2.0' in text


# ---- fusion_joint_blend: the joint stream's later documents blended, not prefilled ---------------


def _joint_run(
    llm: LLM, doc_ids: list[int], options: dict[str, Any], monkeypatch
) -> tuple[Any, torch.Tensor]:
    """The reply and the joint stream's first row (4 documents, all four in the joint stream)."""
    rows: list[torch.Tensor] = []
    original = FusionGroup.combine
    monkeypatch.setattr(FusionGroup, "combine", lambda self, r: rows.append(r.clone()) or original(self, r))
    options = {"fusion_pair": "lead", "fusion_pair_margin": 100.0, "fusion_max_joint": 3, **options}
    out = llm.generate(_prompt(doc_ids, THREE_QUESTION), GREEDY, chunk_options=options)[0]
    monkeypatch.setattr(FusionGroup, "combine", original)
    return out, torch.log_softmax(rows[0][4].float(), -1)


def test_a_joint_stream_blended_with_everything_recomputed_is_the_exact_one(checkpoint, monkeypatch) -> None:
    """Blend at ratio 1 from layer 0 recomputes every token: the joint stream's KV, first row and
    the reply it leads are those of the prefilled joint stream and of transformers."""
    path = checkpoint(arch="llama")
    llm = _llm(path, max_num_batched_tokens=24)
    doc_ids = [3, 1, 0, 2]
    full = {"fusion_joint_blend": True, "blend_check_layers": [0], "blend_recompute_ratios": [1.0]}
    blended, row = _joint_run(llm, doc_ids, full, monkeypatch)
    prefilled, _ = _joint_run(llm, doc_ids, {}, monkeypatch)
    sys_ids, docs, q = _contexts(llm, doc_ids, THREE_QUESTION)
    relevance = [_relevance(path, ctx, q) for ctx in docs]
    top = sorted(sorted(range(4), key=lambda k: -relevance[k])[:3])
    joint = sys_ids + [t for k in top for t in docs[k][len(sys_ids) :]]
    assert (row - hf_first_token_logprobs(path, joint + q)).abs().max() < 1e-4
    assert blended.outputs[0].token_ids == prefilled.outputs[0].token_ids
    assert blended.outputs[0].token_ids == _greedy(path, [[joint, sys_ids]] * STEPS, q)
    llm.check_integrity()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_a_blended_joint_stream_reads_what_layout_offset_reads(checkpoint, monkeypatch) -> None:
    """With the default blend (15% recomputed at layer 1) the joint stream's first row is the
    first-token distribution of a layout-offset request over S, its documents and Q."""
    path = checkpoint(arch="llama")
    llm = _llm(path, enable_prefix_caching=False)  # no blend key: no tail run fresh in either
    doc_ids = [2, 3, 0, 1]
    _, row = _joint_run(llm, doc_ids, {"fusion_joint_blend": True}, monkeypatch)
    _, docs, q = _contexts(llm, doc_ids, THREE_QUESTION)
    relevance = [_relevance(path, ctx, q) for ctx in docs]
    top = sorted(sorted(range(4), key=lambda k: -relevance[k])[:3])
    first_logits: list[torch.Tensor] = []  # not a fusion request: its row where it is sampled
    sample = engine_module.sample_batch
    monkeypatch.setattr(
        engine_module,
        "sample_batch",
        lambda b, rows, *a: first_logits.append(rows.clone()) or sample(b, rows, *a),
    )
    params = SamplingParams(temperature=0, max_tokens=1)
    offset = {"chunk_layout": "offset"}
    llm.generate(_prompt([doc_ids[k] for k in top], THREE_QUESTION), params, chunk_options=offset)
    offset_row = torch.log_softmax(first_logits[0][0].float(), -1)
    assert (row - offset_row).abs().max() < 1e-4
    llm.check_integrity()


def test_blended_joint_groups_preempted_and_aborted_give_everything_back(checkpoint, monkeypatch) -> None:
    """A joint stream preempted (its blend lost: a plain prefill of its tokens when it comes back)
    and a group aborted while its joint stream blends."""
    path = checkpoint(arch="llama")
    preempted: list[bool] = []
    original = Scheduler._preempt
    monkeypatch.setattr(
        Scheduler,
        "_preempt",
        lambda self, seq, b: preempted.append(seq.chunks is not None) or original(self, seq, b),
    )
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    options = {"fusion_pair": "lead", "fusion_max_joint": 3, "fusion_joint_blend": True}
    orders = ([0, 1, 2], [3, 2], [2, 3, 1, 0], [1, 0, 3], [3, 0, 2, 1])
    prompts = [_prompt(order, THREE_QUESTION) for order in orders]
    small = _llm(path, kv_cache_tokens=16 * 40, max_num_batched_tokens=32)
    engine = small.engine
    for k, prompt in enumerate(prompts):
        engine.add_request(str(k), prompt, params, chunk_options=options)
    outs: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        engine.check_integrity()
    assert any(preempted)  # a joint stream among them (the only streams with entries of their own)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs.values())
    abort_while_the_pair_joins(engine, _prompt([1, 3, 0], THREE_QUESTION), params, options)


def _serve_together(
    llm: LLM, monkeypatch, requests: dict[str, tuple[str, dict[str, Any]]]
) -> tuple[dict[str, list[int]], dict[str, int], list[set[str]]]:
    """Add `requests` (name: prompt, chunk options) at once and step until all is done (the
    background work too: each order's second sight queues its exact-prefix job, `exact_follow_ups`,
    which holds blocks until it ends): the replies, the step of each one's first token, and per
    step the requests whose streams computed tokens."""
    computed: list[set[str]] = []
    original = Scheduler.schedule

    def schedule(self: Scheduler):
        batch = original(self)
        computed.append({s.request_id.split("/")[0] for s in batch.seqs})
        return batch

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    engine = llm.engine
    for name, (prompt, options) in requests.items():
        engine.add_request(name, prompt, GREEDY, chunk_options=options)
    replies: dict[str, list[int]] = {}
    first_token: dict[str, int] = {}
    while engine.has_unfinished_requests() or engine.has_background_work():
        for out in engine.step():
            if out.outputs[0].token_ids:
                first_token.setdefault(out.request_id, len(computed))
            if out.finished:
                replies[out.request_id] = out.outputs[0].token_ids
    llm.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return replies, first_token, computed


def _alone(llm: LLM, requests: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, list[int]]:
    return {
        k: llm.generate(p, GREEDY, chunk_options=o)[0].outputs[0].token_ids for k, (p, o) in requests.items()
    }


def test_fusion_requests_arriving_together_end_their_prefills_in_turn(checkpoint, monkeypatch) -> None:
    """Two fusion requests arriving together whose first steps and joint streams are long
    prefills each are served first come first served (`max_long_partial_prefills` 1): the first
    one's joint stream is its own work left, so the second starts only beside the first one's last
    pieces and answers after it; the replies are those each gets alone."""
    path = checkpoint(arch="llama")
    llm = _llm(path, long_prefill_token_threshold=16)
    options = {"fusion_pair": "lead", "fusion_max_joint": 3, "fusion_pair_margin": 100.0}
    requests = {
        "a": (_prompt([2, 0, 3, 1], THREE_QUESTION), options),
        "b": (_prompt([1, 3, 0, 2], THREE_QUESTION), options),
    }
    alone = _alone(llm, requests)
    replies, first_token, computed = _serve_together(llm, monkeypatch, requests)
    assert replies == alone
    # b's pieces run only beside a's last (short) one: never a step of b's own before a's first token.
    assert all("a" in step for step in computed[: first_token["a"]] if "b" in step)
    assert first_token["a"] < first_token["b"]


def test_a_short_first_step_does_not_wait_for_another_requests_joint_stream(checkpoint, monkeypatch) -> None:
    """A fusion request that may add a joint stream is short or long by its first step's own
    tokens, not by the joint stream it may never add: one arriving behind another's joint stream
    (a long prefill) whose streams' questions are short is admitted as a short prompt and answers
    first when no document joins its most relevant one (margin 0)."""
    path = checkpoint(arch="llama")
    llm = _llm(path, long_prefill_token_threshold=40)  # b's streams' questions below it, a's above
    joins = {"fusion_pair": "lead", "fusion_max_joint": 3, "fusion_pair_margin": 100.0}
    requests = {
        "a": (_prompt([2, 0, 3, 1], THREE_QUESTION), joins),
        "b": (_prompt([0, 3], "Alice?"), {**joins, "fusion_pair_margin": 0.0}),
    }
    alone = _alone(llm, requests)
    replies, first_token, computed = _serve_together(llm, monkeypatch, requests)
    assert replies == alone
    assert "b" in computed[0] or "b" in computed[1]  # admitted at once, not after a's prefill
    assert first_token["b"] < first_token["a"]
