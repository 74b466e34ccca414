"""Follow-up questions: a request with the same S and chunks in the same order as an earlier one
reads their KV from the prefix cache and computes only its question (engine/follow_ups.py):
the earlier request's blended KV under the same blend options, or with `exact_follow_ups` the
exact KV that a background job prefilled."""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch

from chunkcache import LLM, SamplingParams
from chunkcache.core.kv_slots import block_slots
from tests.support.engines import tiny_llm
from tests.support.oracle import hf_continue_over_cache, hf_first_token_logprobs, hf_greedy, hf_layer_kv
from tests.support.prompts import DOCS, SYSTEM, chunked

ORDER = [2, 3, 0, 1]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
BLEND = {"chunk_layout": "offset", "blend_recompute_ratios": [0.3]}


# The engine's default chunk pool; exact_follow_ups off unless a test turns it on (then at one
# sight: the first request queues the job). Two sights (the option's default): test_fusion_follow_ups.py.
_llm = partial(
    tiny_llm,
    chunk_cache_size_gb=None,
    exact_follow_ups=False,
    exact_prefix_reads=False,
    exact_follow_ups_sights=1,
)


def _prompt(doc_ids: list[int], question: str) -> str:
    return chunked(SYSTEM, [DOCS[i] for i in doc_ids], question)


def _blended_kv(llm: LLM, prompt: str, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) [Hk, P, D] of the first `num_blocks` blocks of `prompt`'s blend chain, as
    the prefix cache holds them."""
    engine = llm.engine
    seq = engine.intake.make_sequence("probe", prompt, GREEDY, True, engine.intake.chunk_config(BLEND))
    assert seq.prefix_keys.kv_key is not None
    blocks, _ = engine.blocks.match_prefix(seq.token_ids, num_blocks, seq.prefix_keys.block_keys)
    assert len(blocks) == num_blocks
    slots = block_slots(
        blocks, engine.blocks.block_size, num_blocks * engine.blocks.block_size, engine.device
    )
    kv = [
        (k[slots].transpose(0, 1).clone(), v[slots].transpose(0, 1).clone())
        for k, v in engine.runner.kv_caches
    ]
    engine.blocks.free(blocks)
    return kv


def _salted(llm: LLM, prompt: str, salt: str):
    """One request with a cache salt (LLM.generate has none: it is a server field)."""
    engine = llm.engine
    engine.add_request(
        f"salted-{salt}-{len(engine._requests)}", prompt, GREEDY, chunk_options=BLEND, cache_salt=salt
    )
    final = None
    while engine.has_unfinished_requests() or engine.has_background_work():  # as LLM.generate
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None, "the request never finished"
    return final


def _chunk_end(llm: LLM, doc_ids: list[int]) -> int:
    tok = llm.tokenizer
    return len(tok.encode(SYSTEM)) + sum(len(tok.encode(DOCS[i], add_special_tokens=False)) for i in doc_ids)


def test_a_follow_up_reads_the_blended_prefix(checkpoint) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    first = llm.generate(_prompt(ORDER, "Where does Alice live?"), GREEDY, chunk_options=BLEND)[0]
    assert first.num_blend_recomputed_tokens > 0
    follow = llm.generate(_prompt(ORDER, "What is the dog called?"), GREEDY, chunk_options=BLEND)[0]
    stats = llm.chunk_cache_stats()
    assert stats["blended_prefix_hits"] == 1
    assert follow.num_blend_recomputed_tokens == follow.num_blend_reused_tokens == 0
    need = _chunk_end(llm, ORDER) // 16
    assert follow.num_prefix_cached_tokens >= need * 16
    # Oracle: transformers running the rest of the prompt over the cached blocks' KV.
    kv = _blended_kv(llm, follow.prompt, need)
    rest = follow.prompt_token_ids[need * 16 :]
    ref, tokens = hf_continue_over_cache(path, kv, rest, 8)
    for token, lp in follow.outputs[0].logprobs[0].items():
        assert abs(ref[token].item() - lp) < 1e-4, (token, ref[token].item(), lp)
    assert follow.outputs[0].token_ids == tokens
    # That KV is the blend's, which does not depend on the question: an engine that blends the
    # follow-up itself writes the same KV for those tokens.
    fresh = _llm(path)
    alone = fresh.generate(follow.prompt, GREEDY, chunk_options=BLEND)[0]
    assert alone.num_blend_recomputed_tokens > 0
    # The answer does not depend on whether the blended blocks were found.
    assert alone.outputs[0].token_ids == follow.outputs[0].token_ids
    for token, lp in alone.outputs[0].logprobs[0].items():
        assert abs(follow.outputs[0].logprobs[0][token] - lp) < 1e-4
    for (k, v), (k2, v2) in zip(kv, _blended_kv(fresh, follow.prompt, need), strict=True):
        torch.testing.assert_close(k, k2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v2, atol=1e-5, rtol=1e-5)
    # And it is not a full prefill's: the blend reused most chunk tokens.
    full_k = hf_layer_kv(path, follow.prompt_token_ids)[-1][0][:, : need * 16]
    assert (kv[-1][0] - full_k).abs().max() > 1e-3
    for engine in (llm, fresh):
        s = engine.engine.stats()
        assert s["kv_blocks_free"] == s["kv_blocks_total"]
        engine.check_integrity()


def test_only_the_same_cut_and_options_find_it(checkpoint) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    q1, q2 = "Where does Alice live?", "How many coins are in the box?"
    first = llm.generate(_prompt(ORDER, q1), GREEDY, chunk_options=BLEND)[0]
    tok = llm.tokenizer
    exact = (len(tok.encode(SYSTEM)) + len(tok.encode(DOCS[ORDER[0]], add_special_tokens=False))) // 16 * 16

    def hits() -> int:
        return llm.chunk_cache_stats()["blended_prefix_hits"]

    # A plain prompt of the same tokens finds S and the first chunk (a plain prefill's KV), no
    # blended block, and stays exact.
    plain = llm.generate([first.prompt_token_ids], GREEDY)[0]
    assert plain.num_cached_tokens == exact
    ref = hf_first_token_logprobs(path, first.prompt_token_ids)
    for token, lp in plain.outputs[0].logprobs[0].items():
        assert abs(ref[token].item() - lp) < 1e-4
    assert plain.outputs[0].token_ids == hf_greedy(path, first.prompt_token_ids, 8)
    # Published (KV events) are the plain blocks only: a router computes plain chains.
    assert (
        len(llm.engine.blocks.state_events())
        == len(first.prompt_token_ids + first.outputs[0].token_ids) // 16
    )
    # Another order, other blend options, a question-dependent selector, APE: no hit.
    llm.generate(_prompt([3, 2, 0, 1], q2), GREEDY, chunk_options=BLEND)
    llm.generate(_prompt(ORDER, q2), GREEDY, chunk_options={**BLEND, "blend_recompute_ratios": [0.5]})
    query = {**BLEND, "blend_selector": "query_attention"}
    llm.generate(_prompt(ORDER, q1), GREEDY, chunk_options=query)
    again = llm.generate(_prompt(ORDER, q2), GREEDY, chunk_options=query)[0]
    assert again.num_blend_recomputed_tokens > 0
    ape = {**BLEND, "calibration_temperature": 0.9}
    llm.generate(_prompt(ORDER, q1), GREEDY, chunk_options=ape)
    assert llm.generate(_prompt(ORDER, q2), GREEDY, chunk_options=ape)[0].num_blend_recomputed_tokens > 0
    assert hits() == 0
    # Tenants: a salted blend is found by its own salt only.
    _salted(llm, _prompt(ORDER, q1), "a")
    _salted(llm, _prompt(ORDER, q2), "b")
    assert hits() == 0
    salted = _salted(llm, _prompt(ORDER, q2), "a")
    assert hits() == 1 and salted.num_blend_recomputed_tokens == 0
    # The same options again: found.
    llm.generate(_prompt(ORDER, q2), GREEDY, chunk_options=BLEND)
    assert hits() == 2
    s = llm.engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    llm.check_integrity()


def test_without_prefix_caching_every_request_blends(checkpoint) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path, enable_prefix_caching=False)
    for question in ("Where does Alice live?", "What is the dog called?"):
        out = llm.generate(_prompt(ORDER, question), GREEDY, chunk_options=BLEND)[0]
        assert out.num_blend_recomputed_tokens > 0
    assert llm.chunk_cache_stats()["blended_prefix_hits"] == 0
    llm.check_integrity()


def test_exact_follow_ups_are_answered_as_a_full_prefill(checkpoint) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    # Pieces of 16 tokens: the background job takes several steps beside a request.
    llm = _llm(path, exact_follow_ups=True, long_prefill_token_threshold=16)
    baseline = _llm(path)
    q1, q2 = "Where does Alice live?", "What is the dog called?"
    first = llm.generate(_prompt(ORDER, q1), GREEDY, chunk_options=BLEND)[0]
    # The first question is blended as without the option; the job ran beside it.
    alone = baseline.generate(_prompt(ORDER, q1), GREEDY, chunk_options=BLEND)[0]
    assert first.num_blend_recomputed_tokens > 0
    assert first.outputs[0].token_ids == alone.outputs[0].token_ids
    stats = llm.chunk_cache_stats()
    assert stats["exact_prefix_jobs"] == 1 and stats["exact_prefix_hits"] == 0
    follow = llm.generate(_prompt(ORDER, q2), GREEDY, chunk_options=BLEND)[0]
    stats = llm.chunk_cache_stats()
    assert stats["exact_prefix_hits"] == 1 and stats["blended_prefix_hits"] == 0
    assert stats["exact_prefix_jobs"] == 1  # its S and chunks were cached already: no new job
    assert follow.num_blend_recomputed_tokens == 0
    assert follow.num_prefix_cached_tokens >= _chunk_end(llm, ORDER) // 16 * 16
    ref = hf_first_token_logprobs(path, follow.prompt_token_ids)
    for token, lp in follow.outputs[0].logprobs[0].items():
        assert abs(ref[token].item() - lp) < 1e-4, (token, ref[token].item(), lp)
    assert follow.outputs[0].token_ids == hf_greedy(path, follow.prompt_token_ids, 8)
    # Without the option the same follow-up reads the blended KV instead, and is not exact.
    baseline_follow = baseline.generate(_prompt(ORDER, q2), GREEDY, chunk_options=BLEND)[0]
    assert baseline.chunk_cache_stats()["blended_prefix_hits"] == 1
    assert baseline.chunk_cache_stats()["exact_prefix_jobs"] == 0
    assert max(abs(ref[t].item() - lp) for t, lp in baseline_follow.outputs[0].logprobs[0].items()) > 1e-3
    # A queued job is the engine's own work, not a waiting request (a load-aware router reads it).
    llm.engine.add_request("queued", _prompt([1, 0, 3], q1), GREEDY, chunk_options=BLEND)
    llm.engine.step()  # the job runs beside the request, on what its budget leaves
    assert llm.engine.has_background_work()
    assert llm.engine.stats()["num_waiting"] + llm.engine.stats()["num_running"] == 1
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    while llm.engine.has_background_work():
        llm.engine.step()
    # Another tenant finds nothing of it; its own job makes its follow-up exact too.
    _salted(llm, _prompt(ORDER, q1), "b")
    assert llm.chunk_cache_stats()["exact_prefix_hits"] == 1
    assert llm.chunk_cache_stats()["exact_prefix_jobs"] == 3
    assert _salted(llm, _prompt(ORDER, q2), "b").num_blend_recomputed_tokens == 0
    assert llm.chunk_cache_stats()["exact_prefix_hits"] == 2
    for engine in (llm, baseline):
        s = engine.engine.stats()
        assert s["kv_blocks_free"] == s["kv_blocks_total"]
        engine.check_integrity()


def test_an_exact_prefix_job_yields_to_requests(checkpoint) -> None:
    """The job waits while the request prefills (its first token never pays for the job), then
    runs in pieces beside its decodes; when the KV blocks run out (14 blocks for a 146-token
    request decoding 40 and the 136-token job), it gives its blocks back (a yield, not a
    preemption) and resumes from what it left in the prefix cache."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path, exact_follow_ups=True, long_prefill_token_threshold=16, kv_cache_tokens=224)
    engine = llm.engine
    # 40 tokens: the job runs beside these decodes.
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("first", _prompt(ORDER, "Where does Alice live?"), params, chunk_options=BLEND)
    engine.step()
    assert engine.chunk_steps is not None
    (job,) = engine.chunk_steps.follow_ups.jobs.values()
    first = engine._requests["first"]
    most, shared = 0, None
    while engine.has_unfinished_requests():
        if first.num_output_tokens == 0:
            assert job.num_computed == 0  # nothing beside the request's prefill (fill jobs included)
        if job.num_computed and shared is None:
            shared = job.reuse.num_prefix_cached  # the request's own plain blocks (S, first chunk)
        most = max(most, job.num_computed)
        engine.step()
    assert job in engine.scheduler.waiting and not job.block_table  # its blocks went back
    assert 16 < most < job.num_own_prompt_tokens
    assert engine.stats()["num_preemptions"] == 0  # a yield is not a preemption
    engine.step()
    assert shared is not None and job.reuse.num_prefix_cached > shared  # resumed from its own cached blocks
    while engine.has_background_work():
        engine.step()
    assert llm.chunk_cache_stats()["exact_prefix_jobs"] == 1
    follow = llm.generate(_prompt(ORDER, "What is the dog called?"), GREEDY, chunk_options=BLEND)[0]
    assert llm.chunk_cache_stats()["exact_prefix_hits"] == 1
    ref = hf_first_token_logprobs(path, follow.prompt_token_ids)
    for token, lp in follow.outputs[0].logprobs[0].items():
        assert abs(ref[token].item() - lp) < 1e-4
    s = engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    llm.check_integrity()


@pytest.mark.server
def test_a_server_answers_a_follow_up_turn_exactly(checkpoint) -> None:
    """Through the OpenAI server: a chat's documents, then a follow-up over the same documents.
    The server runs the exact-prefix job while idle; the follow-up reads it (a full prefill's
    tokens) and reports its cached tokens."""
    import openai

    from chunkcache.chunk.parse import tokenize_parts
    from chunkcache.config import EngineConfig
    from chunkcache.engine.engine import LLMEngine
    from chunkcache.server.app import build_app
    from tests.support.server_util import ServerThread

    path = checkpoint(arch="llama", num_hidden_layers=3)
    # One sight: the first turn queues the job (at the default two, the follow-up would).
    options = {
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_tokens": 2048,
        "exact_follow_ups": True,
        "exact_follow_ups_sights": 1,
    }
    engine = LLMEngine(EngineConfig.from_options(str(path), use_env=False, **options))
    srv = ServerThread(build_app(engine, api_key=None, max_queue=16, served_model_name="m")).start()
    documents = [DOCS[i] for i in ORDER]
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)

        def chat(question: str):
            return client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": question}],
                max_tokens=8,
                temperature=0,
                extra_body={"documents": documents, "ignore_eos": True},
            )

        chat("Where does Alice live?")
        deadline = time.monotonic() + 30
        while srv.on_engine(lambda: engine.chunk_cache_stats()["exact_prefix_jobs"]) < 1:
            assert time.monotonic() < deadline, "the exact-prefix job never ran while the server idled"
            time.sleep(0.05)
        question = "What is the dog called?"
        follow = chat(question)
        assert srv.on_engine(lambda: engine.chunk_cache_stats()["exact_prefix_hits"]) == 1
        parts = engine.render_chat([{"role": "user", "content": question}], documents=documents)
        ids = tokenize_parts(
            parts.system, parts.chunks, parts.question, engine.tokenizer, False
        ).all_token_ids()
        assert follow.usage.prompt_tokens == len(ids)
        assert (
            follow.usage.prompt_tokens_details.cached_tokens
            >= (len(ids) - len(parts.question)) // 16 * 16 - 16
        )
        want = engine.tokenizer.decode(hf_greedy(path, ids, 8))
        assert follow.choices[0].message.content == want
        srv.wait_idle()
        srv.on_engine(engine.check_integrity)
    finally:
        srv.stop()


def test_with_two_sights_a_repeated_order_read_from_its_blend_turns_exact(checkpoint) -> None:
    """`exact_follow_ups` on with its default sights (2) under layout offset: the order's second request reads the
    first one's blended blocks, and as its second sight queues the job, so the third is exact."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = tiny_llm(path, chunk_cache_size_gb=None, chunk_layout="offset", exact_follow_ups=True)
    llm.generate(_prompt(ORDER, "Where does Alice live?"), GREEDY)
    llm.generate(_prompt(ORDER, "What is the dog called?"), GREEDY)
    stats = llm.chunk_cache_stats()
    assert (stats["blended_prefix_hits"], stats["exact_prefix_jobs"], stats["exact_prefix_hits"]) == (1, 1, 0)
    third = llm.generate(_prompt(ORDER, "How many coins are in the box?"), GREEDY)[0]
    assert llm.chunk_cache_stats()["exact_prefix_hits"] == 1
    assert third.outputs[0].token_ids == hf_greedy(path, third.prompt_token_ids, 8)
    llm.check_integrity()
