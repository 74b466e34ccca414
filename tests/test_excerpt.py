"""The joint stream's excerpts (engine/excerpt.py, `fusion_joint_excerpt`): spans, their choice, and
the joint stream that reads them against transformers over the same tokens."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from transformers import AutoTokenizer

from chunkcache.config import ReuseOptions
from chunkcache.engine import excerpt as excerpt_module
from chunkcache.engine.excerpt import MAX_SPAN, WHOLE_UNDER, SpanTable, excerpt, scores, stems
from chunkcache.engine.fusion import FusionGroup
from chunkcache.errors import InvalidRequestError
from tests.support.oracle import hf_first_token_logprobs
from tests.support.prompts import SYSTEM, chunked
from tests.test_fusion import GREEDY, _llm

ALICE = "Alice lives in Paris.\nShe drinks tea.\nHer cat is grey."
BOB = "Bob lives in Rome.\nHe drinks coffee every day. His dog is brown.\nThe mass is 101.325 kg."
CAROL = "Carol lives in Oslo.\nShe drinks milk.\nHer bird is blue."
QUESTION = "What do Alice, Bob and Carol drink?"


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(str(checkpoint(arch="llama")))


@pytest.fixture(scope="module")
def table(tokenizer) -> SpanTable:
    return SpanTable.of(tokenizer, len(tokenizer) + 3)  # a model's table padded past the tokenizer's


@pytest.fixture
def short_documents_cut(monkeypatch) -> None:
    """These documents are a few budgets long at most: cut them all the same (by default a document
    shorter than WHOLE_UNDER budgets is read whole)."""
    monkeypatch.setattr(excerpt_module, "WHOLE_UNDER", 1)


def _texts(tokenizer, tokens: list[int], spans: list[tuple[int, int]]) -> list[str]:
    return [tokenizer.decode(tokens[a:b]) for a, b in spans]


def test_spans_end_at_line_breaks_and_sentences_never_inside_a_number(tokenizer, table) -> None:
    initials = tokenizer.encode(
        "It was found by Martin H. Klaproth, Dr. A.B. Smith. Then", add_special_tokens=False
    )
    assert [t.strip() for t in _texts(tokenizer, initials, table.spans(initials))] == [
        "It was found by Martin H. Klaproth, Dr. A.B. Smith.",
        "Then",
    ]
    tokens = tokenizer.encode(BOB, add_special_tokens=False)
    spans = table.spans(tokens)
    assert spans[0][0] == 0 and spans[-1][1] == len(tokens)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # contiguous, in order
    texts = _texts(tokenizer, tokens, spans)
    assert [t.strip() for t in texts] == [
        "Bob lives in Rome.",
        "He drinks coffee every day.",
        "His dog is brown.",
        "The mass is 101.325 kg.",
    ]
    assert texts[0].endswith("\n")  # the line break stays with its line
    long = tokenizer.encode("word " * (2 * MAX_SPAN), add_special_tokens=False)
    assert max(b - a for a, b in table.spans(long)) == MAX_SPAN


def test_spans_weigh_the_question_words_they_share_by_their_rarity_in_the_document() -> None:
    assert stems("Which has the higher densities?") == ["higher", "densiti"]
    assert stems("Density at 295K") == ["densiti", "295k"]
    spans = [{"bob", "live"}, {"drink", "coffe"}, {"dog", "brown", "drink"}, {"mass"}]
    score = scores(spans, {"drink", "coffe", "what"})
    assert score[3] == 0 and score[0] == 0
    assert score[1] > score[2] > 0  # "coffe" is in one span, "drink" in two
    # One word stemmed two ways: "discovered" -> "discov", "discovery" -> "discoveri".
    assert scores([{"discoveri", "year"}, {"locat"}], set(stems("When was it discovered?")))[0] > 0
    assert scores([{"ab"}], {"abc"}) == [0]  # short stems match only whole


def test_a_document_shorter_than_a_few_budgets_is_read_whole(tokenizer, table) -> None:
    tokens = tokenizer.encode(BOB, add_special_tokens=False)
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    assert excerpt(tokens, question, table, len(tokens) // WHOLE_UNDER + 1) == tokens
    assert len(excerpt(tokens, question, table, len(tokens) // WHOLE_UNDER)) < len(tokens)


@pytest.mark.usefixtures("short_documents_cut")
def test_an_excerpt_is_the_first_span_and_the_ones_sharing_the_questions_words(tokenizer, table) -> None:
    tokens = tokenizer.encode(BOB, add_special_tokens=False)
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    kept = excerpt(tokens, question, table, len(tokens) - 1)
    assert tokenizer.decode(kept) == "Bob lives in Rome.\nHe drinks coffee every day."
    first = table.spans(tokens)[0][1]
    assert excerpt(tokens, question, table, first - 2) == tokens[: first - 2]  # the first span, cut
    assert excerpt(tokens, question, table, len(tokens)) == tokens  # it fits: all of it
    elsewhere = tokenizer.encode("Where is the red box?", add_special_tokens=False)
    assert excerpt(tokens, elsewhere, table, 4) == tokens  # nothing shared: all of it


@pytest.mark.usefixtures("short_documents_cut")
def test_the_documents_subject_locates_nothing(tokenizer, table) -> None:
    """The first span's words (what the document is about) are named all through it: a question
    that shares no other word reads the document whole, not the spans that name its subject."""
    doc = tokenizer.encode(
        "Bob lives in Rome.\nBob drinks coffee.\nHis dog is brown.\nThe mass is 9 kg.",
        add_special_tokens=False,
    )
    heavy = tokenizer.encode("How heavy is Bob?", add_special_tokens=False)
    assert excerpt(doc, heavy, table, 8) == doc
    mass = tokenizer.encode("What is Bob's mass?", add_special_tokens=False)
    assert (
        tokenizer.decode(excerpt(doc, mass, table, len(doc) - 1)) == "Bob lives in Rome.\nThe mass is 9 kg."
    )


@pytest.mark.usefixtures("short_documents_cut")
def test_a_joint_stream_of_excerpts_is_its_own_prompt(checkpoint, monkeypatch) -> None:
    """All three documents join; the two after the first are read as their excerpts (the
    drinking lines), and the joint stream's first row is transformers' over exactly that prompt."""
    path = checkpoint(arch="llama")
    llm = _llm(path, max_num_batched_tokens=24)
    tok = llm.tokenizer
    rows: list[torch.Tensor] = []
    original = FusionGroup.combine
    monkeypatch.setattr(FusionGroup, "combine", lambda self, r: rows.append(r.clone()) or original(self, r))
    sys_ids = tok.encode(SYSTEM, add_special_tokens=True)
    docs = [tok.encode(d, add_special_tokens=False) for d in (ALICE, BOB, CAROL)]
    q = tok.encode(QUESTION, add_special_tokens=False)
    budget = min(map(len, docs[1:])) - 1
    options = {"fusion_pair": "lead", "fusion_pair_margin": 100.0, "fusion_max_joint": 3}
    options["fusion_joint_excerpt"] = budget
    out = llm.generate(chunked(SYSTEM, [ALICE, BOB, CAROL], QUESTION), GREEDY, chunk_options=options)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    cfg = dataclasses.replace(llm.engine.config.chunk, fusion_joint_excerpt=budget)
    later = [excerpt(d, q, llm.engine.intake.span_table(cfg), budget) for d in docs[1:]]
    assert [tok.decode(e) for e in later] == [
        "Bob lives in Rome.\nHe drinks coffee every day.",
        "Carol lives in Oslo.\nShe drinks milk.\n",
    ]
    ref = hf_first_token_logprobs(path, sys_ids + docs[0] + later[0] + later[1] + q)
    assert (torch.log_softmax(rows[0][3].float(), -1) - ref).abs().max() < 1e-4
    llm.check_integrity()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_an_excerpt_budget_is_a_non_negative_integer_and_blend_reads_whole_documents(checkpoint) -> None:
    llm = _llm(checkpoint(arch="llama"))
    prompt = chunked(SYSTEM, [ALICE, BOB], QUESTION)
    for bad in ({"fusion_joint_excerpt": -1}, {"fusion_joint_excerpt": 1.5}, {"fusion_joint_excerpt": True}):
        with pytest.raises(InvalidRequestError, match="fusion_joint_excerpt"):
            llm.generate(prompt, GREEDY, chunk_options=bad)
    # A model's excerpt default under a request's blended joint stream: the blend reads them whole.
    blended = {"fusion_joint_excerpt": 8, "fusion_joint_blend": True, "fusion_pair": "lead"}
    llm.generate(prompt, GREEDY, chunk_options=blended)
    cfg = llm.engine.config.chunk.with_request_options(ReuseOptions.from_mapping(blended), None)
    assert llm.engine.intake.span_table(cfg) is None
    llm.check_integrity()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_the_span_table_is_built_at_load_where_the_engines_options_read_excerpts(checkpoint) -> None:
    """So that the first request reading excerpts does not wait ~0.8 s for it (a 151k vocabulary)."""
    path = checkpoint(arch="llama")
    assert _llm(path, fusion_joint_excerpt=8).engine.intake._spans is not None
    assert _llm(path).engine.intake._spans is None  # built at first use, where a request asks
