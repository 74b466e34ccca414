"""What a request returns: `RequestOutput` (vLLM-like), built by the engine after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # One dict per generated token: token id -> log-probability (the top-k plus the sampled token).
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Prompt tokens whose KV was not computed for this request: prefix cache plus chunk cache.
    num_cached_tokens: int = 0
    num_prefix_cached_tokens: int = 0
    num_chunk_cached_tokens: int = 0
    num_computed_tokens: int = 0
    # Layout "offset": chunk tokens whose cached KV was kept, and tokens run through every layer.
    num_blend_reused_tokens: int = 0
    num_blend_recomputed_tokens: int = 0
    blend_fallback: bool = False  # blend failed and the prompt was prefilled plainly
    # Tokens generated since the previous RequestOutput of this request (for streaming).
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # SamplingParams.prompt_logprobs: per prompt token, token id -> log-probability (None for the
    # first token, which has no context), as vLLM returns them.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Set when the engine failed this request (finish_reason "error"): what went wrong.
    error: str | None = None
