"""A chat rendered by the model's template into a prompt: text, or PromptParts with one chunk per
document. The engine serves the result like any other prompt (intake.py); rendering is apart
because it is also asked for alone (`/tokenize` with messages) and by LLM.chat before batching."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chunkcache.chunk.documents import PromptParts, parse_documents, render_with_documents
from chunkcache.config import ChunkConfig
from chunkcache.errors import InvalidRequestError

# apply_chat_template's own arguments: a request's template variables must not reach them.
_RENDER_ARGUMENTS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
     "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
     "chat_template", "tools", "documents"}
)  # fmt: skip


class ChatRenderer:
    def __init__(self, tokenizer: Any, chunk_config: ChunkConfig) -> None:
        self.tokenizer = tokenizer
        self.chunk_config = chunk_config

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: Any = None,
    ) -> str | PromptParts:
        """The chat rendered by the model's template (LLMEngine.render_chat). `chat_template_kwargs`
        are the template's own variables (e.g. `enable_thinking`); they cannot override the
        rendering arguments. `tools` (OpenAI's function definitions) go to templates that define
        tool use. `documents` (a list of strings or {title, text} dicts) make the result
        PromptParts, one chunk per document (chunk/documents.py); more than max_chunks of them is
        refused."""
        _check_messages(messages)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("the model's tokenizer has no chat template")
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(set(extra) & _RENDER_ARGUMENTS)
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}")
        template = ChatTemplate(self.tokenizer, add_generation_prompt, continue_final_message, tools, extra)
        if documents is None:
            return template.render(messages, None)
        docs = parse_documents(documents, self.chunk_config.max_chunks)
        # The documents' place in the rendered text is found by rendering with sentinels in their
        # place (chunk/documents.py, shared with the router, which renders with its own tokenizer).
        return render_with_documents(template.render, messages, docs, self.chunk_config.documents_format)


@dataclass(frozen=True)
class ChatTemplate:
    """The model's chat template with one request's rendering arguments."""

    tokenizer: Any
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    variables: dict[str, Any] = field(default_factory=dict)  # the template's own (chat_template_kwargs)

    def render(self, messages: list[dict[str, Any]], documents: list[dict[str, str]] | None) -> str:
        """`messages` rendered, with `documents` passed to the template (None: not passed)."""
        extra = dict(self.variables)
        if documents is not None:
            extra["documents"] = documents
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                tools=self.tools,
                **extra,
            )
        except Exception as e:  # template errors are the client's messages being wrong
            raise InvalidRequestError(f"chat template failed on these messages: {e}") from None


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise InvalidRequestError(f"messages[{i}] must have a string 'role' and a string 'content'")
