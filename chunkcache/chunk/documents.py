"""Documents of a chat request (`documents=[...]`) rendered into the conversation as chunks.

The convention is transformers' and vLLM's `apply_chat_template(documents=...)`: a list of
`{"title", "text"}` dicts (strings are texts without a title). A chat template that renders
documents places them itself; with one that does not, each document is written with the
documents format (`ChunkConfig.documents_format`) at the start of the last user message.

Where a document sits in the rendered text is found by rendering once with unique sentinel
strings in place of its title and text. The prompt is then cut into S (before the first document),
one chunk per document and Q (after the last), and substituting the real strings must give
exactly the text the template renders with the real documents: a template that transforms what
it is given (escapes it, trims it) fails that check and its rendering is used as a plain prompt,
uncut, never a prompt the template would not have written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from chunkcache.errors import InvalidRequestError


@dataclass(frozen=True)
class Document:
    text: str
    title: str | None = None

    def for_template(self) -> dict[str, str]:
        return {"text": self.text} if self.title is None else {"title": self.title, "text": self.text}


@dataclass(frozen=True)
class PromptParts:
    """A prompt already cut into S, chunks and Q as text; the engine tokenizes each part alone."""

    system: str
    chunks: tuple[str, ...]
    question: str

    def text(self) -> str:
        return self.system + "".join(self.chunks) + self.question


def format_document(document: Document, documents_format: str) -> str:
    title = "" if document.title is None else document.title + "\n"
    return documents_format.format(title=title, text=document.text)


def parse_documents(value: Any, max_documents: int) -> list[Document]:
    """Documents from a request's JSON value (or Documents); InvalidRequestError (param
    "documents") for anything else, an empty list or more than `max_documents`."""
    if not isinstance(value, list):
        raise InvalidRequestError("documents must be a list of strings or {title, text} objects", "documents")
    if not value:
        raise InvalidRequestError("documents must not be empty", "documents")
    if len(value) > max_documents:
        raise InvalidRequestError(
            f"documents has {len(value)} entries, more than max_chunks {max_documents}", "documents"
        )
    out: list[Document] = []
    for i, item in enumerate(value):
        if isinstance(item, Document):
            out.append(item)
            continue
        if isinstance(item, str):
            out.append(Document(item))
            continue
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("text"), str)
            or not set(item) <= {"title", "text"}
            or not isinstance(item.get("title", ""), str)
        ):
            raise InvalidRequestError(
                f"documents[{i}] must be a string or an object with a string 'text' and an optional "
                "string 'title' (and nothing else)",
                "documents",
            )
        out.append(Document(item["text"], item.get("title")))
    return out


def _sentinel(i: int, field: str) -> str:
    # Private-use code points: no template writes them, no user text is likely to hold them.
    return f"\ue000chunkcache-document-{i}-{field}\ue001"


def render_with_documents(
    render: Callable[[list[dict[str, Any]], list[dict[str, str]] | None], str],
    messages: list[dict[str, Any]],
    documents: Sequence[Document],
    documents_format: str,
) -> PromptParts | str:
    """The conversation with its documents, cut into parts; a plain string when the cut cannot be
    verified. `render(messages, documents)` is the chat template (documents None: not passed)."""
    marked = [
        Document(_sentinel(i, "text"), None if d.title is None else _sentinel(i, "title"))
        for i, d in enumerate(documents)
    ]
    probe = render(messages, [d.for_template() for d in marked])
    if probe != render(messages, None):  # the template renders documents
        real = render(messages, [d.for_template() for d in documents])
        return _cut(probe, documents, marked, real) or real
    # The template ignores documents: write them into the last user message.
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None:
        raise InvalidRequestError("documents need a user message to be rendered into", "documents")

    def with_docs(blocks: Sequence[str]) -> list[dict[str, Any]]:
        out = [dict(m) for m in messages]
        out[last_user]["content"] = "".join(blocks) + (out[last_user].get("content") or "")
        return out

    # One sentinel per whole formatted document: the chunk is exactly the formatted document.
    whole = [Document(_sentinel(i, "text")) for i in range(len(documents))]
    probe = render(with_docs([d.text for d in whole]), None)
    formatted = [Document(format_document(d, documents_format)) for d in documents]
    real = render(with_docs([d.text for d in formatted]), None)
    return _cut(probe, formatted, whole, real) or real


def _cut(
    probe: str,
    documents: Sequence[Document],
    marked: Sequence[Document],
    real: str,
) -> PromptParts | None:
    """S, one chunk per document and Q from a rendering with sentinels; None unless substituting
    the documents gives exactly `real`. A chunk runs from the end of the previous document to the
    end of its own (what the template writes between two documents, such as a title, goes with
    the one after it); the first starts at its own first sentinel."""
    starts: list[int] = []
    ends: list[int] = []
    for d in marked:
        fields = [s for s in (d.title, d.text) if s is not None]
        found = [(probe.find(s), s) for s in fields]
        if any(pos < 0 or probe.count(s) != 1 for pos, s in found):
            return None
        starts.append(min(pos for pos, _ in found))
        ends.append(max(pos + len(s) for pos, s in found))
    if any(b < a for a, b in zip(ends, starts[1:], strict=False)):
        return None  # documents not rendered in order, or overlapping
    bounds = [starts[0], *ends]
    pieces = [probe[bounds[i] : bounds[i + 1]] for i in range(len(documents))]
    chunks = []
    for piece, d, m in zip(pieces, documents, marked, strict=True):
        piece = piece.replace(m.text, d.text)
        if m.title is not None and d.title is not None:
            piece = piece.replace(m.title, d.title)
        chunks.append(piece)
    parts = PromptParts(probe[: bounds[0]], tuple(chunks), probe[bounds[-1] :])
    return parts if parts.text() == real else None
