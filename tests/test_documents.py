"""`documents` of a chat request: each one chunk of the prompt (chunk/documents.py), offline and
through the server with the official `openai` client."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from chunkcache import SamplingParams
from chunkcache.chunk.documents import (
    PromptParts,
    parse_documents,
    render_with_documents,
)
from chunkcache.chunk.parse import tokenize_parts
from chunkcache.config import DEFAULT_DOCUMENTS_FORMAT
from chunkcache.errors import InvalidRequestError
from tests.support.engines import tiny_llm as _llm
from tests.support.server_util import ServerThread, served_client

MODEL = "tiny-docs"
DOCS = [
    "Alice lives in Paris and drinks tea every morning before work.",
    {"title": "Coins", "text": "The red box holds 42 coins and a small brass key."},
    "Bob was born in 1990 in Rome, the capital of Italy, and he works as a baker.",
]
MESSAGES = [{"role": "user", "content": "Where does Alice live?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# A template that renders documents itself (as Command-R's and Granite's do), in a system turn.
DOC_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if documents %}<|im_start|>system\nUse these documents."
    "{% for d in documents %}{{ '\\n' }}{% if d.title %}{{ 'Title: ' + d.title + '\\n' }}{% endif %}"
    "{{ d.text }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _render(tokenizer: Any, template: str | None = None) -> Callable[..., str]:
    def render(messages: list[dict[str, Any]], docs: list[dict[str, str]] | None) -> str:
        extra = {} if docs is None else {"documents": docs}
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, chat_template=template, **extra
        )

    return render


def test_template_without_documents_gets_the_documents_format(checkpoint) -> None:
    llm = _llm(checkpoint())
    docs = parse_documents(DOCS, 8)
    parts = render_with_documents(_render(llm.tokenizer), MESSAGES, docs, DEFAULT_DOCUMENTS_FORMAT)
    assert isinstance(parts, PromptParts)
    # Exactly what the template renders with the documents written into the user message.
    block = DOCS[0] + "\n\n" + "Coins\n" + DOCS[1]["text"] + "\n\n" + DOCS[2] + "\n\n"
    oracle = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": block + MESSAGES[0]["content"]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert parts.text() == oracle
    assert parts.chunks == (DOCS[0] + "\n\n", "Coins\n" + DOCS[1]["text"] + "\n\n", DOCS[2] + "\n\n")
    assert parts.system.endswith("<|im_start|>user\n")
    assert parts.question.startswith(MESSAGES[0]["content"])


def test_template_that_renders_documents_is_used(checkpoint) -> None:
    llm = _llm(checkpoint())
    docs = parse_documents(DOCS, 8)
    render = _render(llm.tokenizer, DOC_TEMPLATE)
    parts = render_with_documents(render, MESSAGES, docs, DEFAULT_DOCUMENTS_FORMAT)
    assert isinstance(parts, PromptParts)
    assert parts.text() == render(MESSAGES, [d.for_template() for d in docs])
    assert parts.system.endswith("Use these documents.\n")
    # What the template writes between two documents goes with the one after it (its title too).
    assert parts.chunks == (DOCS[0], "\nTitle: Coins\n" + DOCS[1]["text"], "\n" + DOCS[2])
    assert parts.question.startswith("<|im_end|>\n<|im_start|>user\n")


def test_template_that_transforms_documents_is_rendered_uncut(checkpoint) -> None:
    llm = _llm(checkpoint())
    upper = DOC_TEMPLATE.replace("{{ d.text }}", "{{ d.text | upper }}")
    render = _render(llm.tokenizer, upper)
    docs = parse_documents(DOCS, 8)
    out = render_with_documents(render, MESSAGES, docs, DEFAULT_DOCUMENTS_FORMAT)
    # Sentinels upper-cased no longer match: the real rendering, as a plain prompt.
    assert out == render(MESSAGES, [d.for_template() for d in docs])


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ([], "must not be empty"),
        (["a"] * 5, "more than max_chunks 4"),
        ([1], "documents[0]"),
        ([{"text": "a", "url": "x"}], "documents[0]"),
        ([{"title": "t"}], "documents[0]"),
        ("text", "must be a list"),
    ],
)
def test_bad_documents_are_refused_naming_them(value: Any, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle.replace("[", r"\[").replace("]", r"\]")) as e:
        parse_documents(value, 4)
    assert e.value.param == "documents"


def test_documents_are_chunks_and_reused_in_any_order(checkpoint) -> None:
    llm = _llm(checkpoint(arch="qwen3"), chunk_layout="isolated")
    tok = llm.tokenizer
    first = llm.chat(MESSAGES, GREEDY, documents=DOCS)[0]
    parts = llm.engine.render_chat(MESSAGES, documents=DOCS)
    assert isinstance(parts, PromptParts)
    chunked = tokenize_parts(parts.system, parts.chunks, parts.question, tok, False)
    assert first.prompt_token_ids == chunked.all_token_ids()
    assert first.num_chunk_cached_tokens == 0
    # Reordered, with another question: every document is a chunk-cache hit.
    again = llm.chat(
        [{"role": "user", "content": "Who is a baker?"}], GREEDY, documents=[DOCS[2], DOCS[0], DOCS[1]]
    )[0]
    assert again.num_chunk_cached_tokens == sum(map(len, chunked.chunks))
    # The answer is the chunked prompt's: the same parts through the separator path agree.
    sep = " # # "
    same = llm.generate(
        sep.join([parts.system, *parts.chunks, parts.question]), GREEDY, add_special_tokens=False
    )[0]
    assert same.prompt_token_ids == first.prompt_token_ids
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    llm.check_integrity()


def test_documents_without_chunk_cache_are_one_plain_prompt(checkpoint) -> None:
    llm = _llm(checkpoint(), enable_chunk_cache=False)
    out = llm.chat(MESSAGES, GREEDY, documents=DOCS)[0]
    text = llm.engine.render_chat(MESSAGES, documents=DOCS)
    assert isinstance(text, PromptParts)
    assert out.prompt_token_ids == llm.tokenizer.encode(text.text(), add_special_tokens=False)
    assert out.num_chunk_cached_tokens == 0


# ---- through the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(checkpoint) -> Iterator[tuple[openai.OpenAI, ServerThread]]:
    options = {"kv_cache_tokens": 4096, "chunk_cache_size_gb": 0.01, "max_chunks": 4, "device": "cpu"}
    options["dtype"] = "float32"
    with served_client(checkpoint(), options, MODEL) as served:
        yield served


def _chat(client: openai.OpenAI, documents: Any, question: str = "Where does Alice live?") -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=4,
        temperature=0,
        extra_body={"documents": documents, "ignore_eos": True},
    )


def test_server_documents_hit_the_chunk_cache_reordered(client) -> None:
    cl, srv = client
    engine = srv.engine_loop.engine
    first = _chat(cl, DOCS)
    assert first.choices[0].finish_reason == "length"
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    reordered = [DOCS[1], DOCS[2], DOCS[0]]
    again = _chat(cl, reordered, "Who is a baker?")
    parts = engine.render_chat([{"role": "user", "content": "Who is a baker?"}], documents=reordered)
    chunked = tokenize_parts(parts.system, parts.chunks, parts.question, engine.tokenizer, False)
    assert again.usage.prompt_tokens == chunked.num_tokens
    # Every document is reused in its new place, and S (the template's head) too: the default
    # layout (offset + blend) counts the reused tokens blend did not recompute.
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0.5 * (len(chunked.sys_token_ids) + sum(map(len, chunked.chunks)))
    srv.wait_idle()


@pytest.mark.parametrize(
    ("documents", "needle"),
    [
        ([], "must not be empty"),
        (["d"] * 5, "more than max_chunks 4"),
        ([3], "documents"),
        ([{"text": "a", "extra": 1}], "documents"),
        ({"text": "a"}, "documents"),
    ],
)
def test_server_refuses_bad_documents_with_400(client, documents: Any, needle: str) -> None:
    cl, srv = client
    with pytest.raises(openai.BadRequestError) as e:
        _chat(cl, documents)
    assert needle in e.value.message
    assert e.value.body["param"].startswith("documents")
    srv.wait_idle()


def test_server_separator_free_request_option(client) -> None:
    """A plain chat (documents written into the message by the client, no separators) with the
    per-request `separator_free`: the second, reordered one reuses the first one's span."""
    cl, srv = client
    # Not the documents of the tests above: those are chunk entries already, found by content.
    texts = [(d if isinstance(d, str) else d["text"]).upper() for d in DOCS]

    def ask(order: list[int]) -> Any:
        content = "Context:\n\n" + "\n\n".join(texts[i] * 3 for i in order) + "\n\nWhere does Alice live?"
        return cl.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=2,
            temperature=0,
            # Offset's separator-free form (spans reused as slices), pinned: the default is fusion.
            extra_body={"separator_free": True, "chunk_layout": "offset"},
        )

    assert ask([0, 1, 2]).usage.prompt_tokens_details.cached_tokens == 0
    assert ask([2, 0]).usage.prompt_tokens_details.cached_tokens > 0
    engine = srv.engine_loop.engine
    stats = srv.on_engine(engine.chunk_cache_stats)
    assert stats["separator_free_cut"] == 2
    # The canonical entries the second one started are computed while the server is idle.
    deadline = time.monotonic() + 30
    while srv.on_engine(engine.has_background_work):
        assert time.monotonic() < deadline, "background work never ran on an idle server"
        time.sleep(0.02)
    assert srv.on_engine(engine.chunk_cache_stats)["separator_free_canonical_tokens"] > 0
    with pytest.raises(openai.BadRequestError) as e:
        cl.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"separator_free_min_tokens": 0},
        )
    assert "separator_free_min_tokens" in e.value.message
    srv.wait_idle()
