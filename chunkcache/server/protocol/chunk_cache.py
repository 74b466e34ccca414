"""POST /v1/chunk_cache/prewarm and GET /v1/chunk_cache/prewarm/{id}
(`server/routes/chunk_cache.py`): chunkcache's own endpoints, computing a prompt's chunks into the
cache without generating."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from chunkcache.server.protocol.common import StrictModel


class PrewarmRequest(StrictModel):
    """POST /v1/chunk_cache/prewarm: a chunked prompt (its question is ignored), or a system part
    and its documents; computed and cached without generating."""

    model: str | None = None
    prompt: str | None = None
    system: str | None = None
    documents: list[str] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    # False: answer 202 with the job's id at once (its state at GET /v1/chunk_cache/prewarm/{id});
    # True (the default): answer when every entry is cached.
    wait: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> PrewarmRequest:
        if self.prompt is not None and (self.system is not None or self.documents is not None):
            raise ValueError("give either prompt or system and documents, not both")
        if self.prompt is None and (self.system is None or not self.documents):
            raise ValueError("give a chunked prompt, or system and a non-empty list of documents")
        return self


class PrewarmResponse(BaseModel):
    id: str
    prompt_tokens: int
    cached_tokens: int  # already cached before this request (in the pool or a lower tier)
    computed_tokens: int


class PrewarmJobStatus(BaseModel):
    """A prewarm started with `"wait": false` (GET /v1/chunk_cache/prewarm/{id}); the counts are
    PrewarmResponse's once it completed."""

    id: str
    object: Literal["chunk_cache.prewarm"] = "chunk_cache.prewarm"
    status: Literal["running", "completed", "failed", "cancelled"]
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    error: str | None = None
