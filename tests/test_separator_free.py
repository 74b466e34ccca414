"""Separator-free matching (chunk/matcher.py): cached chunks found inside plain prompts, checked
against transformers with the KV slices assembled by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from oracle import hf_first_token_logprobs, hf_slices_reuse_logprobs
from tiny_checkpoint import corpus

from chunkcache import LLM, SamplingParams
from chunkcache.chunk.matcher import WINDOW, SpanIndex, anchors, plan
from chunkcache.chunk.pool import Entry

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


def _stuff(docs: list[str], order: list[int], question: str) -> str:
    """A LangChain-style "stuff" prompt: documents joined by blank lines, no separators."""
    return PREAMBLE + "\n\n".join(docs[i] for i in order) + "\n\nQuestion: " + question


def _llm(path: Any, **options: Any) -> LLM:
    options.setdefault("kv_cache_tokens", 4096)
    options.setdefault("chunk_cache_size_gb", 0.01)
    options.setdefault("separator_free", True)
    return LLM(str(path), device="cpu", **options)


def _close(out: Any, ref: torch.Tensor) -> None:
    for token, lp in out.outputs[0].logprobs[0].items():
        assert abs(ref[token].item() - lp) < 1e-4, (token, ref[token].item(), lp)


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
    cut = plan(ids, engine.chunks.index, engine.config.chunk.separator_free_min_tokens, 256)
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
