"""`exact_follow_ups` under layout "fusion" (engine/follow_ups.py): a request whose S and documents,
in this order, a background job prefilled into the prefix cache runs as one plain prompt (no
streams, no pinned entries, no fill jobs) and is answered as transformers answers the whole
prompt; any other order, another salt, or a request that has no such job yet is served by fusion."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from chunkcache import LLM, SamplingParams
from chunkcache.config import ChunkConfig
from chunkcache.core.sequence import Sequence, SequenceKind
from tests.support.engines import tiny_llm
from tests.support.oracle import hf_first_token_logprobs, hf_greedy
from tests.support.prompts import DOCS, SYSTEM, chunked
from tests.test_separator_free import _docs, _stuff

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
Q1, Q2, Q3 = "Where does Alice live?", "What is the dog called?", "How many coins are in the box?"

# Pieces of 16 tokens: a job runs in several steps beside the requests. `_sights2` is
# exact_follow_ups as a user turns it on (two sights: the option's default); `_llm` has it off
# unless a test turns it on, then at one sight (the first request queues the job).
_fusion = partial(tiny_llm, chunk_layout="fusion", long_prefill_token_threshold=16)
_sights2 = partial(_fusion, exact_follow_ups=True)
_llm = partial(_fusion, exact_follow_ups=False, exact_follow_ups_sights=1)


def _prompt(doc_ids: list[int], question: str) -> str:
    return chunked(SYSTEM, [DOCS[i] for i in doc_ids], question)


class Scheduled:
    """The kinds of the sequences the engine schedules (a spy on Scheduler.add)."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kinds: list[SequenceKind] = []
        add = llm.engine.scheduler.add

        def spy(seq: Sequence) -> None:
            self.kinds.append(seq.kind)
            add(seq)

        monkeypatch.setattr(llm.engine.scheduler, "add", spy)

    def take(self) -> list[SequenceKind]:
        kinds, self.kinds = self.kinds, []
        return kinds


def _stats(llm: LLM) -> dict[str, Any]:
    stats = llm.chunk_cache_stats()
    assert stats is not None
    return stats


def _is_full_prefill(path: Any, out: Any) -> None:
    """The reply is transformers' over the whole prompt: first-token log-probs and greedy tokens."""
    ref = hf_first_token_logprobs(path, out.prompt_token_ids)
    for token, lp in out.outputs[0].logprobs[0].items():
        assert abs(ref[token].item() - lp) < 1e-4, (token, ref[token].item(), lp)
    assert out.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, 8)


def _clean(llm: LLM) -> None:
    s = llm.engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert all(entry.pins == 0 for entry in llm.engine.chunks.pool.entries())
    llm.check_integrity()


def _salted(llm: LLM, prompt: str, salt: str) -> Any:
    """One request with a cache salt (a server field), stepped as LLM.generate steps."""
    engine = llm.engine
    engine.add_request(f"salted-{salt}-{len(engine._requests)}", prompt, GREEDY, cache_salt=salt)
    final = None
    while engine.has_unfinished_requests() or engine.has_background_work():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None
    return final


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_fusion_follow_up_is_answered_as_a_full_prefill(checkpoint, monkeypatch, arch: str) -> None:
    path = checkpoint(arch=arch, num_hidden_layers=3)
    llm = _llm(path, exact_follow_ups=True)
    baseline = _llm(path)
    seen = Scheduled(llm, monkeypatch)
    first = llm.generate(_prompt([0, 1, 2], Q1), GREEDY)[0]
    # The first question is fusion's, as without the option; its job ran beside it.
    assert (
        first.outputs[0].token_ids
        == baseline.generate(_prompt([0, 1, 2], Q1), GREEDY)[0].outputs[0].token_ids
    )
    kinds = seen.take()
    assert kinds.count(SequenceKind.FUSION_STREAM) == 4  # (the job is queued by FollowUps, unseen here)
    stats = _stats(llm)
    assert stats["exact_prefix_jobs"] == 1 and stats["exact_prefix_hits"] == 0
    hits, misses = stats["hits"], stats["misses"]
    follow = llm.generate(_prompt([0, 1, 2], Q2), GREEDY)[0]
    # One plain sequence: no stream, no fill job, no new job, no entry looked up.
    assert seen.take() == [SequenceKind.REQUEST]
    stats = _stats(llm)
    assert stats["exact_prefix_hits"] == 1 and stats["exact_prefix_jobs"] == 1
    assert (stats["hits"], stats["misses"]) == (hits, misses)
    context = len(follow.prompt_token_ids) - len(llm.tokenizer.encode(Q2, add_special_tokens=False))
    assert follow.num_prefix_cached_tokens >= context // 16 * 16 > 0
    _is_full_prefill(path, follow)
    # Without the option the same follow-up is fusion's, and not the full prefill's.
    other = baseline.generate(_prompt([0, 1, 2], Q2), GREEDY)[0]
    ref = hf_first_token_logprobs(path, other.prompt_token_ids)
    assert max(abs(ref[t].item() - lp) for t, lp in other.outputs[0].logprobs[0].items()) > 1e-3
    for engine in (llm, baseline):
        _clean(engine)


def test_only_the_same_order_and_salt_find_it(checkpoint, monkeypatch) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path, exact_follow_ups=True)
    seen = Scheduled(llm, monkeypatch)
    llm.generate(_prompt([0, 1, 2], Q1), GREEDY)
    seen.take()
    # Another order: fusion, and a job of its own for its follow-ups.
    llm.generate(_prompt([1, 0, 2], Q2), GREEDY)
    assert seen.take().count(SequenceKind.FUSION_STREAM) == 4
    assert _stats(llm)["exact_prefix_hits"] == 0 and _stats(llm)["exact_prefix_jobs"] == 2
    # Another tenant: fusion over its own entries, its own job; then its own follow-up hits.
    _salted(llm, _prompt([0, 1, 2], Q2), "b")
    assert seen.take().count(SequenceKind.FUSION_STREAM) == 4
    assert _stats(llm)["exact_prefix_hits"] == 0 and _stats(llm)["exact_prefix_jobs"] == 3
    salted = _salted(llm, _prompt([0, 1, 2], Q3), "b")
    assert seen.take() == [SequenceKind.REQUEST] and _stats(llm)["exact_prefix_hits"] == 1
    _is_full_prefill(path, salted)
    # Unsalted, the same order finds the first request's job.
    assert llm.generate(_prompt([0, 1, 2], Q3), GREEDY)[0].outputs[0].token_ids == salted.outputs[0].token_ids
    assert seen.take() == [SequenceKind.REQUEST] and _stats(llm)["exact_prefix_hits"] == 2
    _clean(llm)


# A chat template that renders documents itself, before the conversation (as templates made for
# retrieval do): S is the documents' preamble, the turns are the question part.
DOCUMENTS_FIRST = (
    "{{ bos_token }}{% for d in documents or [] %}{{ d.text }}\n\n{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_chat_follow_up_over_the_same_documents(checkpoint) -> None:
    """A chat's next turn, its documents again: where the template renders them before the turns,
    the earlier turns are in the question part, S and the documents match, and the turn is a full
    prefill's; where the documents are written into the last user message (templates that ignore
    them), the earlier turns are in S, so each turn is a new prefix and is served by fusion."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    docs = [DOCS[i] for i in (2, 0, 1)]
    turn = [{"role": "user", "content": Q1}]
    for documents_first in (True, False):
        llm = _llm(path, exact_follow_ups=True)
        if documents_first:
            llm.tokenizer.chat_template = DOCUMENTS_FIRST
        answer = llm.chat(turn, GREEDY, documents=docs)[0]
        assert _stats(llm)["exact_prefix_jobs"] == 1 and _stats(llm)["exact_prefix_hits"] == 0
        turns = [
            *turn,
            {"role": "assistant", "content": answer.outputs[0].text},
            {"role": "user", "content": Q2},
        ]
        follow = llm.chat(turns, GREEDY, documents=docs)[0]
        if documents_first:
            assert follow.prompt_token_ids[: len(answer.prompt_token_ids) - 8] == answer.prompt_token_ids[:-8]
            assert _stats(llm)["exact_prefix_hits"] == 1 and _stats(llm)["exact_prefix_jobs"] == 1
            _is_full_prefill(path, follow)
        else:
            assert _stats(llm)["exact_prefix_hits"] == 0 and _stats(llm)["exact_prefix_jobs"] == 2
        _clean(llm)


def test_aborts_and_prompts_too_long_for_one_sequence(checkpoint) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path, exact_follow_ups=True, max_model_len=200)
    engine = llm.engine
    # Aborted while its job is queued: the request ends, the job still fills the prefix cache.
    engine.add_request("aborted", _prompt([0, 1, 2], Q1), GREEDY)
    engine.step()
    assert engine.has_background_work()
    engine.abort_request("aborted")
    while engine.has_unfinished_requests() or engine.has_background_work():
        engine.step()
    assert _stats(llm)["exact_prefix_jobs"] == 1
    _clean(llm)
    # Its follow-up, aborted after it became a plain request.
    engine.add_request("follow", _prompt([0, 1, 2], Q2), GREEDY)
    engine.step()
    assert _stats(llm)["exact_prefix_hits"] == 1
    engine.abort_request("follow")
    while engine.has_unfinished_requests():
        engine.step()
    _clean(llm)
    # A whole prompt whose max_tokens does not fit max_model_len, where each stream's does: fusion.
    prompt = _prompt([0, 1, 2], Q3)
    size = len(
        engine.intake.make_sequence("probe", prompt, GREEDY, True, engine.config.chunk).prompt_token_ids
    )
    room = 200 - size + 1
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=room, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == room and _stats(llm)["exact_prefix_hits"] == 1
    _clean(llm)


def test_separator_free_requests_read_the_exact_prefix(checkpoint, monkeypatch) -> None:
    """A separator-free prompt is a plain prompt's token ids: where the prompt before the question
    admission cut is cached exactly (a first sight's own plain prefill, or a job's), it runs plain
    rather than as a fusion request."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(
        path, exact_follow_ups=True, separator_free=True, kv_cache_tokens=4096, chunk_cache_size_gb=0.01
    )
    seen = Scheduled(llm, monkeypatch)
    docs = _docs(llm.tokenizer, 3)
    llm.generate(_stuff(docs, [0, 1, 2], "Who is first?"), GREEDY)  # first sight: plain, learned
    seen.take()
    # Same order again: one learned span, not documents to fuse: plain, its prefix cached.
    same = llm.generate(_stuff(docs, [0, 1, 2], "What is second?"), GREEDY)[0]
    assert seen.take() == [SequenceKind.REQUEST] and same.num_prefix_cached_tokens > 0
    _is_full_prefill(path, same)
    # Another order: a fusion request, and a job for its follow-ups.
    llm.generate(_stuff(docs, [2, 0], "Which is third?"), GREEDY)
    assert SequenceKind.FUSION_STREAM in seen.take()
    stats = _stats(llm)
    assert stats["separator_free_fusion"] == 1 and stats["exact_prefix_jobs"] == 1
    again = llm.generate(_stuff(docs, [2, 0], "Who is fourth?"), GREEDY)[0]
    assert seen.take() == [SequenceKind.REQUEST] and _stats(llm)["exact_prefix_hits"] == 1
    _is_full_prefill(path, again)
    _clean(llm)


def test_with_two_sights_only_a_repeated_order_is_prefilled(checkpoint, monkeypatch) -> None:
    """`exact_follow_ups` on with its default sights, 2: an order seen once queues nothing
    (random retrieval pays no job); its repeat is fused and queues the job; from the third request
    on it is exact."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _sights2(path)
    chunk = llm.engine.config.chunk
    assert (chunk.exact_follow_ups, chunk.exact_follow_ups_sights) == (True, 2)
    seen = Scheduled(llm, monkeypatch)
    for order in ([0, 1, 2], [1, 0, 2], [2, 1, 0]):
        llm.generate(_prompt(order, Q1), GREEDY)
    assert seen.take().count(SequenceKind.FUSION_STREAM) == 12
    assert _stats(llm)["exact_prefix_jobs"] == 0
    _salted(llm, _prompt([0, 1, 2], Q2), "b")  # another tenant's sight is its own
    assert _stats(llm)["exact_prefix_jobs"] == 0 and seen.take().count(SequenceKind.FUSION_STREAM) == 4
    llm.generate(_prompt([0, 1, 2], Q2), GREEDY)  # the repeat: fused, its job queued
    assert seen.take().count(SequenceKind.FUSION_STREAM) == 4
    assert _stats(llm)["exact_prefix_jobs"] == 1 and _stats(llm)["exact_prefix_hits"] == 0
    third = llm.generate(_prompt([0, 1, 2], Q3), GREEDY)[0]
    assert seen.take() == [SequenceKind.REQUEST] and _stats(llm)["exact_prefix_hits"] == 1
    _is_full_prefill(path, third)
    _clean(llm)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_a_bad_sights_value_is_refused_by_name(bad: object) -> None:
    from chunkcache.config import ChunkConfig

    with pytest.raises(ValueError, match="exact_follow_ups_sights"):
        ChunkConfig(exact_follow_ups_sights=bad).validate()  # type: ignore[arg-type]


def test_an_exact_follow_up_is_not_checked_as_a_reuse_configuration(checkpoint) -> None:
    """Shadow checks (fidelity/shadow.py) judge the engine's reuse configuration: a request served
    as a plain prompt over an exact prefix is not drawn (its agreement would be the prefix cache's)."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path, exact_follow_ups=True, fidelity_sample_rate=1.0, fidelity_max_share=1.0)
    llm.generate(_prompt([0, 1, 2], Q1), GREEDY)
    checked = _stats(llm)["fidelity"]["configs"]["default"]
    assert checked.get("agree", 0) + checked.get("disagree", 0) == 1
    llm.generate(_prompt([0, 1, 2], Q2), GREEDY)
    assert _stats(llm)["exact_prefix_hits"] == 1
    assert _stats(llm)["fidelity"]["configs"]["default"] == checked
    _clean(llm)


def test_jobs_never_evict_chunk_entries(checkpoint) -> None:
    """A job's KV is prefix-cache blocks of the paged KV; the chunk pool's pages are its own budget:
    jobs for many orders, through a KV cache that holds few of them, evict no document's entry."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path, exact_follow_ups=True, kv_cache_tokens=256, chunk_cache_size_gb=0.01)
    pool = llm.engine.chunks.pool
    orders = [[0, 1, 2], [2, 1, 0], [1, 2, 0], [0, 2, 1], [2, 0, 1], [1, 0, 2]]
    llm.generate(_prompt(orders[0], Q1), GREEDY)
    entries = {e.key for e in pool.entries()}
    for order in orders[1:]:
        llm.generate(_prompt(order, Q1), GREEDY)
    assert _stats(llm)["exact_prefix_jobs"] == len(orders)
    assert pool.stats.evictions == 0 and {e.key for e in pool.entries()} == entries
    # The KV cache did turn over: the first order's prefix is gone, the last one's is there.
    assert _stats(llm)["exact_prefix_hits"] == 0
    llm.generate(_prompt(orders[-1], Q2), GREEDY)
    assert _stats(llm)["exact_prefix_hits"] == 1
    llm.generate(_prompt(orders[0], Q2), GREEDY)
    assert _stats(llm)["exact_prefix_hits"] == 1
    _clean(llm)


def test_a_shadow_checks_prefill_serves_the_order_exactly(checkpoint) -> None:
    """By default (sights 2) a request's order queues no job at its first sight, but a shadow check
    of it is a plain prefill of its prompt under its salt: the next request with those documents in
    that order is an exact hit (an exact answer: right for serving), and it is not drawn for a
    check, so the gate's count is of the requests reuse served."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _sights2(path, fidelity_sample_rate=1.0, fidelity_max_share=1.0)
    llm.generate(_prompt([0, 1, 2], Q1), GREEDY)
    checked = _stats(llm)["fidelity"]["configs"]["default"]
    assert checked.get("agree", 0) + checked.get("disagree", 0) == 1
    assert _stats(llm)["exact_prefix_jobs"] == 0
    follow = llm.generate(_prompt([0, 1, 2], Q2), GREEDY)[0]
    assert _stats(llm)["exact_prefix_hits"] == 1 and _stats(llm)["exact_prefix_jobs"] == 0
    assert _stats(llm)["fidelity"]["configs"]["default"] == checked
    _is_full_prefill(path, follow)
    # Another salt finds nothing of it: fused, and checked.
    _salted(llm, _prompt([0, 1, 2], Q3), "b")
    assert _stats(llm)["exact_prefix_hits"] == 1
    again = _stats(llm)["fidelity"]["configs"]["default"]
    assert again.get("agree", 0) + again.get("disagree", 0) == 2
    _clean(llm)


@pytest.mark.parametrize("reads", [True, False], ids=["default", "reads-off"])
def test_an_order_a_plain_prefill_left_is_read_exactly_by_default(
    checkpoint, monkeypatch, reads: bool
) -> None:
    """Without `exact_follow_ups` no job is ever queued, but an exact prefix that is there (a plain
    prompt of the same tokens computed it) is read by default: the fusion request runs as one
    plain prompt, computes only its question and answers as a full prefill (issue 56: an exact
    repeat costs no more than a prefix cache). `exact_prefix_reads` off (the measurement tools')
    keeps it a fusion request."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _fusion(path, exact_prefix_reads=reads, exact_follow_ups=False)
    assert ChunkConfig().exact_prefix_reads is True  # the default
    seen = Scheduled(llm, monkeypatch)
    tokens = llm.generate(_prompt([0, 1, 2], Q1), GREEDY)[0].prompt_token_ids
    llm.generate([tokens], GREEDY)  # the same tokens as a plain prompt: S and the documents cached
    seen.take()
    follow = llm.generate(_prompt([0, 1, 2], Q2), GREEDY)[0]
    stats = _stats(llm)
    assert stats["exact_prefix_jobs"] == 0
    if reads:
        assert seen.take() == [SequenceKind.REQUEST] and stats["exact_prefix_hits"] == 1
        context = len(follow.prompt_token_ids) - len(llm.tokenizer.encode(Q2, add_special_tokens=False))
        assert follow.num_prefix_cached_tokens >= context // 16 * 16 > 0
        _is_full_prefill(path, follow)
    else:
        assert seen.take().count(SequenceKind.FUSION_STREAM) == 4 and stats["exact_prefix_hits"] == 0
    # Another order is not that prefix: fusion.
    llm.generate(_prompt([1, 0, 2], Q2), GREEDY)
    assert seen.take().count(SequenceKind.FUSION_STREAM) == 4
    _clean(llm)
