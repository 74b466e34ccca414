"""Layout "fusion" over separator-free matches (chunk/matcher.py `fusion_documents`): a plain
prompt whose documents the pool holds is decoded as one exact stream per document, each against
transformers over that stream's own text S + Ci + Q."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import openai
import pytest
import torch

from chunkcache import LLM, SamplingParams
from chunkcache.chunk.matcher import Plan, Run, SpanIndex, fusion_documents
from chunkcache.core.plan import ChunkedPrompt, ChunkPlan, Entry
from chunkcache.core.sequence import Sequence
from chunkcache.engine.fusion import FusionGroup
from tests.support.engines import tiny_llm
from tests.support.oracle import hf_first_token_logprobs
from tests.support.server_util import ServerThread, served_client
from tests.test_fusion import _reference_decode
from tests.test_separator_free import _docs, _long

STEPS = 6  # as tests/test_fusion.py's reference decode
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
PRODUCT = {"fusion_rule": "product", "fusion_amateur": False}
# First sight (learned as one span), second (documents 2 and 0: 2 is a slice from inside the
# span, computed after this S; 0 follows the same S there: borrowed), third (1 computed, 2 and 0
# borrowed: exact entries of this S).
SIGHTS = (([0, 1, 2], "Who is first?"), ([2, 0], "What is second?"), ([1, 2, 0], "Which is third?"))

_llm = partial(
    tiny_llm, kv_cache_tokens=4096, chunk_cache_size_gb=0.01, separator_free=True, chunk_layout="fusion"
)


class Groups:
    """The fusion groups requests make, and the streams' first-step logits."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.groups: list[FusionGroup] = []
        self.first: dict[int, torch.Tensor] = {}
        create, combine = FusionGroup.create.__func__, FusionGroup.combine  # type: ignore[attr-defined]

        def spy_create(
            cls: type, request: Sequence, prompt: ChunkedPrompt, config: Any, spans=None
        ) -> FusionGroup:
            group = create(cls, request, prompt, config, spans)
            self.groups.append(group)
            return group

        def spy_combine(group: FusionGroup, stream_logits: torch.Tensor) -> torch.Tensor:
            self.first.setdefault(id(group), stream_logits.clone())
            return combine(group, stream_logits)

        monkeypatch.setattr(FusionGroup, "create", classmethod(spy_create))
        monkeypatch.setattr(FusionGroup, "combine", spy_combine)


def _sights(llm: LLM, docs: list[str], params: SamplingParams, options: dict | None = None) -> list[Any]:
    outs = []
    for order, question in SIGHTS:
        outs.append(llm.generate(_long(docs, order, question), params, chunk_options=options)[0])
        llm.check_integrity()
    return outs


def _check_cut(prompt_ids: list[int], prompt: ChunkedPrompt, dropped: int) -> None:
    """S opens the prompt, Q ends it, the documents are its middle in order (but for glue)."""
    s, q = list(prompt.sys_token_ids), list(prompt.question_token_ids)
    assert prompt_ids[: len(s)] == s and prompt_ids[len(prompt_ids) - len(q) :] == q
    middle = prompt_ids[len(s) : len(prompt_ids) - len(q)]
    at = 0
    for doc in prompt.chunks:
        found = next(i for i in range(at, len(middle)) if middle[i : i + len(doc)] == list(doc))
        at = found + len(doc)
    assert sum(map(len, prompt.chunks)) + dropped == len(middle)


def test_documents_are_borrowed_only_where_computed_right_after_s() -> None:
    """A hand-made first matching of S + C + glue + B + A + Q: C is a slice from inside a learned
    span (computed after P and A and B there), B is a canonical entry of this S, A is the span's
    slice right after P, and S is the span's S + P. So B and A are borrowed (A whole, though the
    first matching cut it in two), C is computed, the glue is in no document."""
    s1, p = (1,), tuple(range(500, 520))
    a, b, c = (tuple(range(x, x + 80)) for x in (1000, 2000, 3000))
    s2, glue, q = s1 + p, (7, 7), (9,) * 12
    span = Entry(b"span", "chunk", (s1, p + a + b + c), len(p + a + b + c))
    canonical = Entry(b"canon", "chunk", (s2, b), len(b))
    index = SpanIndex(lambda e: True)
    for entry in (span, canonical):
        index.add(entry)
    ids = list(s2 + c + glue + b + a + q)
    at_c, at_b = len(s2), len(s2) + 82
    at_a = at_b + 80
    first = Plan(
        len(s2),
        (
            (at_c, at_c + 80, Run(at_c, 80, span, len(p + a + b))),
            (at_c + 80, at_b, None),
            (at_b, at_a, Run(at_b, 80, canonical, 0)),
            (at_a, at_a + 40, Run(at_a, 40, span, len(p))),
            (at_a + 40, at_a + 80, Run(at_a + 40, 40, span, len(p) + 40)),
        ),
        at_a + 80,
    )
    docs = fusion_documents(ids, first, index, 32)
    assert docs is not None and docs.dropped == 2 and docs.matched == (True, True, True)
    assert [(x, y, run is not None) for x, y, run in docs.plan.parts] == [
        (at_c, at_c + 80, False),
        (at_b, at_a, True),
        (at_a, at_a + 80, True),
    ]
    borrowed = [run for _, _, run in docs.plan.parts if run is not None]
    assert [(r.entry.key, r.entry_start, r.length) for r in borrowed] == [
        (b"canon", 0, 80),
        (b"span", 20, 80),
    ]
    # Only one document known: not worth fusion.
    alone = Plan(len(s2), ((at_c, at_b, None), (at_b, at_a, Run(at_b, 80, canonical, 0))), at_a)
    assert fusion_documents(ids, alone, index, 32) is None


@pytest.mark.parametrize(
    ("arch", "options"), [("llama", PRODUCT), ("qwen2", None), ("llama", {"fusion_pair": "expert"})]
)
def test_every_stream_is_exactly_its_own_text(checkpoint, monkeypatch, arch: str, options) -> None:
    path = checkpoint(arch=arch, num_hidden_layers=3)
    llm = _llm(path)
    docs = _docs(llm.tokenizer, 3)
    seen = Groups(monkeypatch)
    first, second, third = _sights(llm, docs, FIRST, options)
    stats = llm.chunk_cache_stats()
    # First sight: nothing known, a plain prefill (exact); then two fusion requests.
    assert first.num_chunk_cached_tokens == 0
    assert stats["separator_free_fusion"] == 2 and stats["separator_free_fusion_plain"] == 0
    assert stats["separator_free_fusion_computed_tokens"] > 0  # second sight: doc 2 was a slice
    assert len(seen.groups) == 2
    for out, group, n_docs in zip((second, third), seen.groups, (2, 3), strict=True):
        assert len(group.prompt.chunks) == n_docs
        assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt)  # reported whole, once
        _check_cut(out.prompt_token_ids, group.prompt, stats["separator_free_fusion_dropped_tokens"])
        rows = seen.first[id(group)]
        assert rows.shape[0] == len(group.streams)
        for row, stream in zip(rows, group.streams, strict=True):
            ref = hf_first_token_logprobs(path, stream.prompt_token_ids)
            assert (torch.log_softmax(row.float(), -1) - ref).abs().max() < 1e-4, stream.request_id
    # The third sight borrows documents 2 and 0 (entries of this very S) and computes 1.
    assert third.num_chunk_cached_tokens >= len(seen.groups[1].prompt.chunks[0])
    assert third.num_prefix_cached_tokens == len(seen.groups[1].prompt.sys_token_ids)
    engine = llm.engine
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(e.pins == 0 for e in engine.chunks.pool.entries())


def test_greedy_tokens_equal_the_chunked_request_and_the_reference(checkpoint, monkeypatch) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    docs = _docs(llm.tokenizer, 3)
    seen = Groups(monkeypatch)
    *_, third = _sights(llm, docs, GREEDY, PRODUCT)
    prompt = seen.groups[-1].prompt
    assert third.num_chunk_cached_tokens > 0
    # The same documents as a chunked request (intake's path for a separator prompt), on an
    # engine without separator-free matching.
    other = _llm(path, separator_free=False)
    engine = other.engine
    config = engine.intake.chunk_config(PRODUCT)
    seq = Sequence("chunked", prompt.all_token_ids(), list(prompt.question_token_ids), GREEDY)
    seq.chunk_plan, seq.prefix_keys.cacheable = ChunkPlan(prompt, config), False
    seq.reply.generator = torch.Generator().manual_seed(0)
    FusionGroup.create(seq, prompt, config)
    engine._post(seq)
    chunked = None
    while engine.has_unfinished_requests():
        chunked = next((o for o in engine.step() if o.finished), chunked)
    assert chunked is not None
    assert third.outputs[0].token_ids == chunked.outputs[0].token_ids
    # ...and the rule over transformers' streams S + Ci + Q.
    contexts = [list(prompt.sys_token_ids + c) for c in prompt.chunks]
    tokens, combined = _reference_decode(path, contexts, list(prompt.question_token_ids), "product")
    assert third.outputs[0].token_ids == tokens
    for token, lp in third.outputs[0].logprobs[0].items():
        assert abs(combined[token].item() - lp) < 1e-4
    llm.check_integrity()
    other.check_integrity()


def test_documents_known_only_inside_a_span_are_computed_after_s(checkpoint, monkeypatch) -> None:
    """Documents 2 and 1 seen only inside the first sight's span (after other documents): no KV
    of them is exact after S, so the fusion request computes both, as canonical entries that the
    next prompt borrows."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    docs = _docs(llm.tokenizer, 3)
    seen = Groups(monkeypatch)
    llm.generate(_long(docs, [0, 1, 2], "Who is first?"), FIRST)
    out = llm.generate(_long(docs, [2, 1], "Which two?"), FIRST)[0]
    (group,) = seen.groups
    assert len(group.prompt.chunks) == 2 and out.num_chunk_cached_tokens == 0
    stats = llm.chunk_cache_stats()
    assert stats["separator_free_fusion_computed_tokens"] == sum(map(len, group.prompt.chunks))
    for row, stream in zip(seen.first[id(group)], group.streams, strict=True):
        ref = hf_first_token_logprobs(path, stream.prompt_token_ids)
        assert (torch.log_softmax(row.float(), -1) - ref).abs().max() < 1e-4
    again = llm.generate(_long(docs, [1, 2], "Which two, again?"), FIRST)[0]
    assert again.num_chunk_cached_tokens == sum(map(len, group.prompt.chunks))
    assert (
        llm.chunk_cache_stats()["separator_free_fusion_computed_tokens"]
        == stats["separator_free_fusion_computed_tokens"]
    )
    llm.check_integrity()


def test_no_or_one_matched_document_runs_as_a_plain_prompt(checkpoint, monkeypatch) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    docs = _docs(llm.tokenizer, 4)
    seen = Groups(monkeypatch)
    # No match (first sight), then one (document 0 among a new one): plain prefills, exact.
    for k, order in enumerate(([0, 1, 2], [3, 0])):
        out = llm.generate(_long(docs, order, "Which one?"), FIRST)[0]
        ref = hf_first_token_logprobs(path, out.prompt_token_ids)
        for token, lp in out.outputs[0].logprobs[0].items():
            assert abs(ref[token].item() - lp) < 1e-4
        assert out.num_chunk_cached_tokens == 0
        assert llm.chunk_cache_stats()["separator_free_fusion_plain"] == k
    assert not seen.groups
    llm.check_integrity()


def test_streams_that_do_not_fit_a_batch_run_as_a_plain_prompt(checkpoint, monkeypatch) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path, max_num_seqs=2)  # three streams (two documents and S + Q) do not fit
    docs = _docs(llm.tokenizer, 3)
    seen = Groups(monkeypatch)
    outs = _sights(llm, docs, FIRST)
    assert not seen.groups and llm.chunk_cache_stats()["separator_free_fusion_plain"] == 2
    for out in outs:
        ref = hf_first_token_logprobs(path, out.prompt_token_ids)
        for token, lp in out.outputs[0].logprobs[0].items():
            assert abs(ref[token].item() - lp) < 1e-4


def test_an_open_max_tokens_is_capped_for_the_streams(checkpoint, monkeypatch) -> None:
    """Three streams share the KV cache: an open max_tokens is capped so that they fit it (the
    request finishes by length, not by a preemption that never ends)."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path, kv_cache_tokens=1024, max_model_len=1024)
    docs = _docs(llm.tokenizer, 3)
    seen = Groups(monkeypatch)
    *_, third = _sights(llm, docs, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(seen.groups) == 2
    params = seen.groups[-1].request.params
    streams = len(seen.groups[-1].streams)
    assert params.max_tokens is not None and streams * (params.max_tokens + 16) <= 1024
    assert third.outputs[0].finish_reason == "length"
    assert len(third.outputs[0].token_ids) == params.max_tokens
    llm.check_integrity()


def test_abort_mid_stream_gives_everything_back(checkpoint) -> None:
    llm = _llm(checkpoint(arch="llama", num_hidden_layers=3))
    docs = _docs(llm.tokenizer, 3)
    for order, question in SIGHTS[:2]:
        llm.generate(_long(docs, order, question), FIRST)
    engine = llm.engine
    engine.add_request("fused", _long(docs, [1, 2, 0], "Abort?"), SamplingParams(max_tokens=50))
    engine.add_request("plain", "Something else, a plain prompt.", SamplingParams(max_tokens=8))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        engine.check_integrity()
        if steps == 4:
            engine.abort_request("fused")
    assert llm.chunk_cache_stats()["separator_free_fusion"] == 2
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(e.pins == 0 for e in engine.chunks.pool.entries())


def test_groups_preempted_and_resumed_answer_as_alone(checkpoint) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = _llm(path, kv_cache_tokens=16 * 34, max_model_len=16 * 34)
    roomy = _llm(path)
    docs = _docs(small.tokenizer, 3)
    prompts = [
        _long(docs, [1, 2, 0], "Third?"),
        _long(docs, [0, 2], "Fourth?"),
        _long(docs, [2, 1], "Fifth?"),
    ]
    for llm in (small, roomy):
        for order, question in SIGHTS[:2]:
            llm.generate(_long(docs, order, question), FIRST)
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert small.chunk_cache_stats()["separator_free_fusion"] == 4
    small.check_integrity()
    assert small.engine.blocks.num_free_blocks == small.engine.blocks.num_blocks
    for prompt, out in zip(prompts, outs, strict=True):
        alone = roomy.generate([prompt], params)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


# ---- through the server ----------------------------------------------------------------------

MODEL = "tiny-fusion-separator-free"


@pytest.fixture(scope="module")
def client(checkpoint) -> Iterator[tuple[openai.OpenAI, ServerThread]]:
    options = {
        "kv_cache_tokens": 4096,
        "chunk_cache_size_gb": 0.01,
        "chunk_layout": "fusion",
        "separator_free": True,
        "device": "cpu",
        "dtype": "float32",
    }
    with served_client(checkpoint(), options, MODEL) as served:
        yield served


def test_server_plain_prompts_served_by_fusion_streaming_and_not(client) -> None:
    cl, srv = client
    engine = srv.engine_loop.engine
    docs = _docs(engine.tokenizer, 3)

    def complete(order: list[int], question: str, stream: bool) -> Any:
        return cl.completions.create(
            model=MODEL, prompt=_long(docs, order, question), max_tokens=5, temperature=0, stream=stream,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    for order, question in SIGHTS[:2]:
        complete(order, question, False)
    whole = complete(*SIGHTS[2], False)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 5
    assert whole.usage.prompt_tokens == len(engine.tokenizer.encode(_long(docs, *SIGHTS[2])))
    assert whole.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(complete(*SIGHTS[2], True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    srv.wait_idle()
    assert srv.on_engine(lambda: engine.chunk_cache_stats()["separator_free_fusion"]) == 3
    assert srv.on_engine(lambda: engine.blocks.num_free_blocks) == engine.blocks.num_blocks
    srv.on_engine(engine.check_integrity)
