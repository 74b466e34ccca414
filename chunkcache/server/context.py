"""What the routes of one server share: its engine and engine loop, the names it answers to, its
limits, and the checks every route makes (API key, model name, sampling fields).

`build_app` stores one `ServerContext` in `app.state.context`; routes receive it through the
`Context` dependency, so route modules are plain functions, not closures inside `build_app`.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from chunkcache.config import ReuseOptions
from chunkcache.sampling import SamplingParams
from chunkcache.server.choices import ChoiceGroup, Prompt, Submission
from chunkcache.server.engine_loop import EngineLoop
from chunkcache.server.errors import ApiError, invalid, param_named_in
from chunkcache.server.logprobs import LogprobWriter
from chunkcache.server.metrics import ServerMetrics
from chunkcache.server.prewarm_jobs import PrewarmJobs
from chunkcache.server.protocol.chat import ChatCompletionRequest
from chunkcache.server.protocol.completions import CompletionRequest
from chunkcache.server.text_limits import TextBound

if TYPE_CHECKING:
    from chunkcache.engine.engine import LLMEngine


@dataclass(frozen=True)
class ServerContext:
    engine: LLMEngine
    engine_loop: EngineLoop
    metrics: ServerMetrics
    names: tuple[str, ...]  # the model names served; the first is the default
    started: int  # unix time the app was built (the models' `created`)
    api_key: str | None
    metrics_without_api_key: bool
    max_prewarm_tokens: int
    text_bound: TextBound
    logprobs: LogprobWriter
    prewarm_jobs: PrewarmJobs  # prewarms that returned early ("wait": false)

    def resolve_model(self, name: str | None) -> str:
        if name is None:
            return self.names[0]
        if name not in self.names:
            raise ApiError(
                404,
                f"The model '{name}' does not exist; this server serves {list(self.names)}",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )
        return name

    def check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise ApiError(
                401,
                "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    async def submit_group(
        self,
        prefix: str,
        prompts: list[Prompt],
        params: SamplingParams,
        n: int,
        chunk_options: ReuseOptions | None,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
    ) -> ChoiceGroup:
        """The `n` choices of every prompt, choice 0 of each submitted now (bad input fails here)."""
        submission = Submission(prefix, chunk_options, add_special_tokens, cache_salt)
        return await ChoiceGroup.start(self.engine_loop, submission, prompts, params, n)


def sampling_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """The body's sampling parameters; a value they refuse is a 400 naming its field."""
    try:
        return body.to_sampling_params()
    except ValueError as e:
        raise invalid(str(e), param_named_in(str(e), list(type(body).model_fields))) from None


def server_context(request: Request) -> ServerContext:
    context: ServerContext = request.app.state.context
    return context


Context = Annotated[ServerContext, Depends(server_context)]


def require_api_key(request: Request, context: Context) -> None:
    """Dependency of every API route: 401 unless the request carries the server's key."""
    context.check_api_key(request)


def require_metrics_key(request: Request, context: Context) -> None:
    """`/metrics`' guard: cached-token counts tell one tenant about another's traffic, so the
    metrics sit behind the key unless the server was told otherwise."""
    if not context.metrics_without_api_key:
        context.check_api_key(request)
