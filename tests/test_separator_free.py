"""Separator-free matching (chunk/matcher.py): cached chunks found inside plain prompts, checked
against transformers with the KV slices assembled by hand."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

from chunkcache import LLM, SamplingParams
from chunkcache.chunk.matcher import WINDOW, SpanIndex, anchors
from chunkcache.core.plan import Entry
from tests.support.engines import tiny_llm
from tests.support.oracle import hf_first_token_logprobs, hf_slices_reuse_logprobs
from tests.support.tiny_checkpoint import corpus

FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
# Pure reuse: what is borrowed is used as it is, so the oracle can assemble the same KV.
REUSE = {"blend_check_layers": [0], "blend_recompute_ratios": [0.0]}
PREAMBLE = "Answer the question from the context below.\n\n"


def _docs(tok: Any, n: int, tokens: int = 90) -> list[str]:
    lines = [line.strip() for line in corpus(num_lines=300, seed=11) if "#" not in line]
    docs, k = [], 0
    for _ in range(n):
        parts: list[str] = []
        while len(tok.encode(" ".join(parts), add_special_tokens=False)) < tokens:
            parts.append(lines[k])
            k += 1
        docs.append(" ".join(parts))
    return docs


def _stuff(docs: list[str], order: list[int], question: str, preamble: str = PREAMBLE) -> str:
    """A LangChain-style "stuff" prompt: documents joined by blank lines, no separators."""
    return preamble + "\n\n".join(docs[i] for i in order) + "\n\nQuestion: " + question


# Offset (+ blend), pinned: this module is about separator-free matching on that layout (its
# fusion form: tests/test_fusion_separator_free.py); the engine's default layout is fusion.
_llm = partial(
    tiny_llm, kv_cache_tokens=4096, chunk_cache_size_gb=0.01, separator_free=True, chunk_layout="offset"
)


def _close(out: Any, ref: torch.Tensor) -> None:
    for token, lp in out.outputs[0].logprobs[0].items():
        assert abs(ref[token].item() - lp) < 1e-4, (token, ref[token].item(), lp)


def _pieces(ids: list[int], cut) -> list[tuple[list[int], int, int]]:
    """The cache a plan assembles, as `hf_slices_reuse_logprobs` pieces: S; each computed gap as the
    causal run of S + gap; each borrowed run as its slice of its entry's own context."""
    s = cut.sys_end
    pieces: list[tuple[list[int], int, int]] = [(ids[:s], 0, s)]
    for a, b, run in cut.parts:
        if run is None:
            pieces.append((ids[:s] + ids[a:b], s, b - a))
        else:
            entry_sys, entry_tokens = run.entry.token_ids
            pieces.append((list(entry_sys) + list(entry_tokens), len(entry_sys) + run.entry_start, b - a))
    return pieces


def test_anchors_depend_on_content_only() -> None:
    doc = list(range(100, 400))
    found = anchors(doc)
    assert found, "a 300-token text has anchors"
    for before in ([], [7] * 13, list(range(50, 90))):
        shifted = anchors(before + doc + [3, 4, 5])
        inside = [
            (p - len(before), h) for p, h in shifted if len(before) <= p <= len(before) + len(doc) - WINDOW
        ]
        assert inside == found


def test_match_is_verified_and_extended_token_by_token() -> None:
    doc = tuple(range(1000, 1200))
    entry = Entry(b"k", "chunk", ((1, 2), doc), len(doc))
    alive = {id(entry)}
    index = SpanIndex(lambda e: id(e) in alive)
    index.add(entry)
    # The document inside another text, its first and last tokens changed (as a tokenizer merges
    # a document's edges with its neighbours): the run is exactly the equal interior.
    prompt = [5] * 30 + [77] + list(doc[1:-1]) + [78] + [6] * 20
    runs = index.match(prompt, anchors(prompt), 32)
    assert [(r.start, r.length, r.entry_start) for r in runs] == [(31, len(doc) - 2, 1)]
    # A dead entry is never returned, and leaves the index.
    alive.clear()
    assert index.match(prompt, anchors(prompt), 32) == []
    index.check_integrity()


def test_match_prefers_a_run_aligned_with_its_entry_and_takes_back_a_shared_blank_line() -> None:
    # A learned span holds A then B; a canonical entry holds a blank line and B alone. In a prompt
    # with C, the blank line, then B, where C's run (from another span) also reached over the blank
    # line, B is taken from the canonical entry, from its start, though the span's slice of it
    # would be longer (the span goes on as the prompt does).
    blank = (9, 9)
    a, b, c, tail = (tuple(range(s, s + 80)) for s in (1000, 2000, 3000, 4000))
    span = Entry(b"span", "chunk", ((1,), a + blank + b + tail), 240)
    canonical = Entry(b"canon", "chunk", ((1,), blank + b), 82)
    other = Entry(b"other", "chunk", ((1,), c + blank), 82)
    index = SpanIndex(lambda e: True)
    for entry in (span, canonical, other):
        index.add(entry)
    prompt = [5] * 20 + list(c + blank + b + tail)
    runs = index.match(prompt, anchors(prompt), 32)
    by_entry = {r.entry.key: r for r in runs}
    assert by_entry[b"canon"].entry_start == 0 and by_entry[b"canon"].start == 100
    assert by_entry[b"other"].end == 100  # gave the blank line back
    assert by_entry[b"canon"].computed_after((1,)) and not by_entry[b"canon"].computed_after((2,))
    # Without the canonical entry, B comes from inside the span: not computed right after S.
    index2 = SpanIndex(lambda e: e is not canonical)
    for entry in (span, other):
        index2.add(entry)
    inside = [r for r in index2.match(prompt, anchors(prompt), 32) if r.entry is span]
    assert inside and not inside[0].aligned and not inside[0].computed_after((1,))
    # ...unless S itself is the span's S and what precedes the slice in it.
    assert inside[0].computed_after((1, *span.token_ids[1][: inside[0].entry_start]))


def test_first_sight_is_exact_and_second_sight_reuses_slices(checkpoint) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    tok = llm.tokenizer
    docs = _docs(tok, 3)
    first = llm.generate(_stuff(docs, [0, 1, 2], "Who is first?"), FIRST, chunk_options=REUSE)[0]
    # First sight: nothing to borrow, so a plain prefill, whose S and span are then stored.
    _close(first, hf_first_token_logprobs(path, first.prompt_token_ids))
    stats = llm.chunk_cache_stats()
    assert stats["separator_free_cut"] == 1 and stats["entries"] == 2
    assert 0 < stats["separator_free_learned_tokens"] < len(first.prompt_token_ids)
    assert first.num_chunk_cached_tokens == 0 and first.num_blend_recomputed_tokens == 0

    # Second sight, reordered and recombined: the documents are found inside the learned span.
    text = _stuff(docs, [2, 0], "What is second?")
    ids = tok.encode(text)
    engine = llm.engine
    cut = engine.chunks.cutter.plan(ids, engine.config.chunk)
    assert cut is not None
    second = llm.generate(text, FIRST, chunk_options=REUSE)[0]
    assert second.prompt_token_ids == ids
    s = cut.sys_end
    pieces: list[tuple[list[int], int, int]] = [(ids[:s], 0, s)]
    matched = 0
    for a, b, run in cut.parts:
        if run is None:  # a gap: computed after this prompt's S
            pieces.append((ids[:s] + ids[a:b], s, b - a))
        else:  # a slice of the learned entry, where it was computed
            entry_sys, entry_tokens = run.entry.token_ids
            pieces.append((list(entry_sys) + list(entry_tokens), len(entry_sys) + run.entry_start, b - a))
            matched += b - a
    _close(second, hf_slices_reuse_logprobs(path, pieces, ids[cut.q_start :]))
    doc_tokens = sum(len(tok.encode(docs[i], add_special_tokens=False)) for i in (2, 0))
    assert matched >= 0.8 * doc_tokens
    assert second.num_chunk_cached_tokens == matched
    llm.check_integrity()


def test_chunks_of_separator_prompts_are_found_in_plain_prompts(checkpoint) -> None:
    llm = _llm(checkpoint())
    tok = llm.tokenizer
    docs = _docs(tok, 3)
    sep = " # # "
    llm.generate(sep.join(["Use the documents.", *docs, "Question?"]), FIRST)
    out = llm.generate(_stuff(docs, [1, 2], "Which one?"), FIRST)[0]
    doc_tokens = sum(len(tok.encode(docs[i], add_special_tokens=False)) for i in (1, 2))
    assert llm.chunk_cache_stats()["separator_free_matched_tokens"] >= 0.8 * doc_tokens
    assert out.num_chunk_cached_tokens > 0
    llm.check_integrity()


@pytest.mark.parametrize("how", ["engine", "request", "salt", "isolated"])
def test_off_switches(checkpoint, how: str) -> None:
    llm = _llm(checkpoint(), separator_free=how != "engine")
    docs = _docs(llm.tokenizer, 2)
    options = {"separator_free": False} if how == "request" else None
    if how == "isolated":
        options = {"chunk_layout": "isolated"}
    for order in ([0, 1], [1, 0]):
        if how == "salt":
            llm.engine.add_request(f"s{order[0]}", _stuff(docs, order, "Q?"), FIRST, cache_salt="tenant")
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
        else:
            out = llm.generate(_stuff(docs, order, "Q?"), FIRST, chunk_options=options)[0]
            assert out.num_chunk_cached_tokens == 0
    assert llm.chunk_cache_stats()["separator_free_requests"] == 0
    assert llm.chunk_cache_stats()["entries"] == 0
    llm.check_integrity()


def test_request_option_turns_it_on_and_eviction_keeps_the_index_sound(checkpoint) -> None:
    # A pool of 16 pages (256 tokens): every prompt's span evicts the last one.
    llm = _llm(checkpoint(), separator_free=False, chunk_cache_size_gb=16 * 16 * 2 * 2 * 2 * 16 * 4 / 2**30)
    docs = _docs(llm.tokenizer, 6, tokens=60)
    on = {"separator_free": True}
    for order in ([0, 1, 2], [3, 4, 5], [0, 1, 2], [5, 3], [1, 0]):
        out = llm.generate(_stuff(docs, order, "Q?"), FIRST, chunk_options=on)[0]
        assert out.outputs[0].finish_reason == "length"
        llm.check_integrity()
    stats = llm.chunk_cache_stats()
    assert stats["separator_free_requests"] == 5 and stats["evictions"] > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_prompt_whose_gaps_could_not_fit_the_kv_cache_stays_plain(checkpoint) -> None:
    # 16 blocks: the prompt fits, but not beside its gaps computed in paged blocks (were the pool
    # to refuse them), so it is not cut: a plain prefill, never a request that could wait forever.
    llm = _llm(checkpoint(), kv_cache_tokens=256, max_model_len=256)
    docs = _docs(llm.tokenizer, 2, tokens=80)
    out = llm.generate(_stuff(docs, [0, 1], "Q?"), FIRST)[0]
    assert out.outputs[0].finish_reason == "length"
    stats = llm.chunk_cache_stats()
    assert stats["separator_free_requests"] == 1 and stats["separator_free_cut"] == 0
    llm.check_integrity()


def test_prompt_that_is_mostly_new_runs_as_a_first_sight(checkpoint) -> None:
    llm = _llm(checkpoint())
    docs = _docs(llm.tokenizer, 5, tokens=60)
    llm.generate(_stuff(docs, [0], "Q?"), FIRST)
    # One known document among four new ones: under a quarter of the span could be borrowed, so
    # the prompt is a plain prefill (nothing reused, nothing blended) whose span is stored.
    out = llm.generate(_stuff(docs, [1, 2, 0, 3, 4], "Q?"), FIRST)[0]
    assert out.num_chunk_cached_tokens == 0 and out.num_blend_recomputed_tokens == 0
    assert llm.chunk_cache_stats()["separator_free_matched_tokens"] == 0
    # ...and found by the next prompt holding its documents.
    again = llm.generate(_stuff(docs, [4, 2], "Q?"), FIRST)[0]
    assert again.num_chunk_cached_tokens > 0
    llm.check_integrity()


def test_first_sight_entries_are_written_down_to_the_tiers(checkpoint, tmp_path) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    with _llm(path, chunk_cache_disk_dir=str(tmp_path / "kv")) as llm:
        docs = _docs(llm.tokenizer, 3)
        llm.generate(_stuff(docs, [0, 1, 2], "Who is first?"), FIRST, chunk_options=REUSE)
        llm.engine.flush_chunk_tiers()
        stats = llm.chunk_cache_stats()
        assert stats["separator_free_cut"] == 1 and stats["entries"] == 2  # S and the span
        assert stats["tiers"]["disk"]["stores"] == 2 and stats["tiers"]["disk"]["entries"] == 2
        llm.check_integrity()


def test_a_slice_from_inside_an_entry_never_enters_the_prefix_cache(checkpoint) -> None:
    """An offset request registers S and its first chunk in the prefix cache as plain-prefill KV;
    a separator-free first chunk cut from inside a learned span was computed in another context,
    so it must not be registered: a plain request over the same tokens stays exact (it got
    another context's KV, 0.6 nats off, before the check)."""
    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    docs = _docs(llm.tokenizer, 3)

    def raw(order: list[int], question: str) -> str:  # no preamble: the prompt opens on a document
        return "\n\n".join(docs[i] for i in order) + "\n\nQuestion: " + question

    llm.generate(raw([0, 1, 2], "Who is first?"), FIRST, chunk_options=REUSE)
    second = llm.generate(raw([1, 0], "What is second?"), FIRST, chunk_options=REUSE)[0]
    assert second.num_chunk_cached_tokens > 0  # its first chunk is a slice from inside the span
    out = llm.generate(raw([1, 0], "What is third?"), FIRST, chunk_options={"separator_free": False})[0]
    _close(out, hf_first_token_logprobs(path, out.prompt_token_ids))
    llm.check_integrity()


# ---- canonical entries: a run borrowed from inside an entry is recomputed right after S ------


# Instructions long enough to be a run of their own: the second sight's S extends over them.
LONG_PREAMBLE = (
    "Use the following pieces of context to answer the question at the end. If you do not know "
    "the answer, just say that you do not know, do not try to make up an answer.\n\n"
)


def _long(docs: list[str], order: list[int], question: str) -> str:
    return _stuff(docs, order, question, LONG_PREAMBLE)


def _second_sight(llm: LLM, docs: list[str]) -> tuple[list[int], Any]:
    """First sight of docs 0-2, then the plan of a second sight of docs 2 and 0 (before it runs)."""
    llm.generate(_long(docs, [0, 1, 2], "Who is first?"), FIRST, chunk_options=REUSE)
    ids = llm.tokenizer.encode(_long(docs, [2, 0], "What is second?"))
    engine = llm.engine
    cut = engine.chunks.cutter.plan(ids, engine.config.chunk)
    assert cut is not None
    # S reaches over the instructions, which the first sight learned right after its own S.
    preamble = len(llm.tokenizer.encode(LONG_PREAMBLE))
    assert preamble - 4 <= cut.sys_end <= preamble + 2
    return ids, cut


def _canonical(llm: LLM, sys_ids: list[int], chunk: list[int]) -> Any:
    from chunkcache.hashing import chunk_hash

    engine = llm.engine
    key = chunk_hash(engine.model_name, sys_ids, chunk, engine.config.chunk.hash_algorithm)
    return engine.chunks.pool.get(key, (tuple(sys_ids), tuple(chunk)))


def test_a_borrowed_slice_is_recomputed_as_a_canonical_entry(checkpoint) -> None:
    """The second sight borrows slices from inside the learned span; once it is served, each is
    computed in the background as its own entry right after S: its KV equals transformers' KV of
    S + the run, and a third prompt (another order) borrows those entries, exact against
    transformers with the cache assembled from them."""
    from chunkcache.core.kv_slots import gather_kv
    from tests.support.oracle import hf_layer_kv

    path = checkpoint(arch="llama", num_hidden_layers=3)
    llm = _llm(path)
    docs = _docs(llm.tokenizer, 3)
    ids, cut = _second_sight(llm, docs)
    runs = [
        (a, b)
        for a, b, run in cut.parts
        if run is not None and not run.computed_after(tuple(ids[: cut.sys_end]))
    ]
    assert runs, "the second sight borrows from inside the learned span"
    second = llm.generate(_long(docs, [2, 0], "What is second?"), FIRST, chunk_options=REUSE)[0]
    assert second.num_chunk_cached_tokens > 0
    stats = llm.chunk_cache_stats()
    assert stats["separator_free_canonical_jobs"] == len(runs)
    assert stats["separator_free_canonical_tokens"] == sum(b - a for a, b in runs)
    assert not llm.engine.has_background_work()  # generate returned after it
    s = cut.sys_end
    engine = llm.engine
    for a, b in runs:
        entry = _canonical(llm, ids[:s], ids[a:b])
        assert entry is not None and entry.ready and entry.pins == 0
        k, v = gather_kv(engine.runner.kv_caches, engine.chunks._slots(entry))
        for layer, (hk, hv) in enumerate(hf_layer_kv(path, ids[:s] + ids[a:b])):
            torch.testing.assert_close(k[layer], hk[:, s:].transpose(0, 1), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v[layer], hv[:, s:].transpose(0, 1), atol=1e-4, rtol=1e-4)

    # Third sight, another order: the documents are found as canonical entries, from their start.
    text = _long(docs, [0, 2], "Which is third?")
    ids3 = llm.tokenizer.encode(text)
    cut3 = engine.chunks.cutter.plan(ids3, engine.config.chunk)
    # Document 0 opens this prompt as it opened the first: the shared prefix reaches over it, yet
    # S stays the known one (the canonical entries are keyed by it).
    assert cut3 is not None and ids3[: cut3.sys_end] == ids[:s]
    borrowed = [run for _, _, run in cut3.parts if run is not None]
    # Each computed right after this S: a canonical entry, or the span's head.
    assert all(r.computed_after(tuple(ids[:s])) for r in borrowed)
    assert sum(b - a for a, b, run in cut3.parts if run is not None) >= 0.8 * (cut3.q_start - s)
    assert any(r.entry.num_tokens < 150 for r in borrowed)  # a canonical entry, not the span
    third = llm.generate(text, FIRST, chunk_options=REUSE)[0]
    _close(third, hf_slices_reuse_logprobs(path, _pieces(ids3, cut3), ids3[cut3.q_start :]))
    assert llm.chunk_cache_stats()["separator_free_canonical_jobs"] == len(runs)  # nothing more to do
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(e.pins == 0 for e in engine.chunks.pool.entries())
    llm.check_integrity()


def test_background_jobs_take_only_what_requests_leave_of_a_step(checkpoint, monkeypatch) -> None:
    """Canonical jobs are background work (engine/scheduler.py): in a step they come after every
    request, in pieces of the threshold, never beside a request's prefill (the starvation floor
    is set out of reach here), only beside decodes or alone."""
    from chunkcache.engine import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "BACKGROUND_MAX_WAIT_STEPS", 10**6)
    llm = _llm(checkpoint(), long_prefill_token_threshold=16, max_num_batched_tokens=40)
    docs = _docs(llm.tokenizer, 3)
    _second_sight(llm, docs)
    engine = llm.engine
    batches: list[list[tuple[bool, int]]] = []
    run = engine.runner.run

    def recording(batch: Any) -> Any:
        batches.append(
            [(s.kind.is_background, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
        )
        return run(batch)

    engine.runner.run = recording  # type: ignore[method-assign]
    engine.add_request("second", _long(docs, [2, 0], "What is second?"), FIRST)
    engine.add_request("plain", "Something else entirely, a plain prompt.", SamplingParams(max_tokens=4))
    finished = set()
    while engine.has_unfinished_requests() or engine.has_background_work():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"second", "plain"}
    for batch in batches:
        kinds = [background for background, _ in batch]
        assert kinds == sorted(kinds)  # requests first
        assert all(n <= 16 for background, n in batch if background)
        if any(background for background, _ in batch):
            assert all(n == 1 for background, n in batch if not background)  # decodes only
    assert llm.chunk_cache_stats()["separator_free_canonical_tokens"] > 0
    llm.check_integrity()


@pytest.mark.parametrize("how", ["abort", "fail"])
def test_resources_return_after_a_cancelled_or_failed_request_and_job(checkpoint, how: str) -> None:
    """A second sight aborted after admission: its canonical jobs still run (nobody needs the
    request for them); a step that fails on a canonical job drops its entry. Either way the KV
    blocks, the pins and the pool pages come back."""
    llm = _llm(checkpoint())
    docs = _docs(llm.tokenizer, 3)
    ids, cut = _second_sight(llm, docs)
    engine = llm.engine
    pool = engine.chunks.pool
    s = cut.sys_end
    runs = [
        (a, b)
        for a, b, run in cut.parts
        if run is not None and not run.computed_after(tuple(ids[: cut.sys_end]))
    ]
    assert runs
    engine.add_request("second", _long(docs, [2, 0], "What is second?"), SamplingParams(max_tokens=20))
    shared: list[bool] = []  # whether the failed step held the request too (background work shares)
    if how == "fail":
        run = engine.runner.run

        def failing(batch: Any) -> Any:
            if any(s.kind.is_background for s in batch.seqs):
                shared.append(any(not s.kind.is_background for s in batch.seqs))
                raise RuntimeError("injected")
            return run(batch)

        engine.runner.run = failing  # type: ignore[method-assign]
    engine.step()  # admitted: its background jobs are queued
    assert engine.has_background_work()
    if how == "abort":
        engine.abort_request("second")
    outs = []
    while engine.has_unfinished_requests() or engine.has_background_work():
        outs += [o for o in engine.step() if o.finished]
        llm.check_integrity()
    assert [o.request_id for o in outs] == ["second"]
    canonical = llm.chunk_cache_stats()["separator_free_canonical_tokens"]
    entries = [_canonical(llm, ids[:s], ids[a:b]) for a, b in runs]
    if how == "abort":
        assert outs[0].outputs[0].finish_reason == "abort"
        assert canonical > 0 and all(e is not None and e.ready for e in entries)  # cached
    else:
        # The request is failed with the step it shared, else not hurt.
        assert outs[0].outputs[0].finish_reason == ("error" if shared[0] else "length")
        assert canonical == 0 and entries == [None] * len(runs)  # the failed jobs' entries are gone
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(e.pins == 0 and e.ready for e in pool.entries())
    assert llm.chunk_cache_stats()["jobs_running"] == 0
    llm.check_integrity()


def test_a_request_that_needs_a_canonical_entry_promotes_its_job(checkpoint) -> None:
    """A request whose chunk is a canonical entry still being computed in the background makes
    the job an ordinary fill job: it runs with a request's priority, not on what is left."""
    from chunkcache.core.plan import ChunkedPrompt, ChunkPlan
    from chunkcache.core.sequence import Sequence

    llm = _llm(checkpoint(), long_prefill_token_threshold=8, max_num_batched_tokens=16)
    docs = _docs(llm.tokenizer, 3)
    ids, cut = _second_sight(llm, docs)
    engine = llm.engine
    engine.add_request("second", _long(docs, [2, 0], "What is second?"), FIRST)
    while engine.has_unfinished_requests():
        engine.step()
    jobs = [s for s in [*engine.scheduler.running, *engine.scheduler.waiting] if s.kind.is_background]
    assert jobs  # pieces of 8 on what the request left: not done yet
    a, b = next(
        (a, b)
        for a, b, run in cut.parts
        if run is not None and not run.computed_after(tuple(ids[: cut.sys_end]))
    )
    s = cut.sys_end
    job = next(j for j in jobs if list(j.token_ids) == ids[a:b])
    q = llm.tokenizer.encode(" Question: which?", add_special_tokens=False)
    chunked = ChunkedPrompt(tuple(ids[:s]), (tuple(ids[a:b]),), tuple(q))
    tokens = chunked.all_token_ids()
    seq = Sequence(
        "needs", list(tokens), list(tokens), FIRST, chunk_plan=ChunkPlan(chunked, engine.config.chunk)
    )
    seq.prefix_keys.cacheable = False
    seq.reply.generator = torch.Generator().manual_seed(0)
    engine._post(seq)
    engine.step()
    assert not job.kind.is_background
    done: list[str] = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert done == ["needs"]
    entry = _canonical(llm, ids[:s], ids[a:b])
    assert entry is not None and entry.ready
    while engine.has_background_work():
        engine.step()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(e.pins == 0 for e in engine.chunks.pool.entries())
    llm.check_integrity()


def test_entries_a_request_borrows_are_pinned_before_its_new_entries_evict(checkpoint) -> None:
    """A pool just large enough for the first sight's S and span: the second sight's new S (over
    the instructions) needs pages, and the span it is about to borrow from is the only entry an
    eviction could free them from. It must stay (pinned first): the new S is computed privately
    instead, and the borrowed KV is still the span's (exact against transformers)."""
    from chunkcache.chunk.matcher import SpanIndex, plan

    path = checkpoint(arch="llama", num_hidden_layers=3)
    probe = _llm(path)
    docs = _docs(probe.tokenizer, 3)
    first_ids = probe.tokenizer.encode(_long(docs, [0, 1, 2], "Who is first?"))
    cut = plan(first_ids, SpanIndex(lambda e: False), 32, 256)
    assert cut is not None
    pages = -(-cut.sys_end // 16) + -(-(cut.q_start - cut.sys_end) // 16)
    token_bytes = probe.engine.spec.kv_bytes_per_token(4)
    gb = pages * 16 * token_bytes / 2**30
    llm = _llm(path, chunk_cache_size_gb=gb, chunk_cache_lru_threshold=1.0)
    assert llm.engine.chunks.pool.num_pages == pages
    ids, cut2 = _second_sight(llm, docs)
    assert llm.chunk_cache_stats()["entries"] == 2
    second = llm.generate(_long(docs, [2, 0], "What is second?"), FIRST, chunk_options=REUSE)[0]
    assert second.num_chunk_cached_tokens > 0
    _close(second, hf_slices_reuse_logprobs(path, _pieces(ids, cut2), ids[cut2.q_start :]))
    assert llm.chunk_cache_stats()["uncacheable"] > 0  # the new S, computed privately
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    llm.check_integrity()
