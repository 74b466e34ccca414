"""Errors a client can cause. Each message names the offending value; the engine keeps serving."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine will not run (HTTP 400). `param` names the request field to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt, or prompt plus max_tokens, exceeds max_model_len (HTTP 413)."""


class ModelLoadError(ValueError):
    """A checkpoint the engine cannot load: unknown architecture, unsupported feature, missing tensor."""
