"""The offline API: `LLM(model).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from chunkcache.chunk.documents import PromptParts
from chunkcache.config import EngineConfig, ReuseOptions
from chunkcache.engine.engine import LLMEngine
from chunkcache.errors import InvalidRequestError
from chunkcache.model.loader import default_model
from chunkcache.outputs import RequestOutput
from chunkcache.sampling import SamplingParams

Prompt = str | list[int] | PromptParts


class LLM:
    def __init__(
        self, model: str | None = None, device: str = "auto", dtype: str = "auto", **engine_options: Any
    ) -> None:
        """`model`: a short name (`chunkcache models`), a checkpoint directory, a .gguf file (or a
        directory holding one), or a hub id; None = the default model, Qwen2.5-Coder-1.5B-Instruct."""
        if model is None:
            model = default_model()
        self.engine = LLMEngine(
            EngineConfig.from_options(model, device=device, dtype=dtype, **engine_options)
        )
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_special_tokens: bool = True,
        chunk_options: ReuseOptions | Mapping[str, object] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in input order. A prompt is a string or a list of token ids.

        `chunk_options` sets this call's chunk layout and blend options (ReuseOptions, or a dict of
        its names).
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        order: dict[str, int] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                request_id = f"offline-{next(self._ids)}"
                self.engine.add_request(
                    request_id, prompt, p, add_special_tokens=add_special_tokens, chunk_options=chunk_options
                )
                order[request_id] = i
        except Exception:
            self._abandon(order)
            raise
        results: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="generating", disable=not use_tqdm)
        self._run_until_done(order, results, bar)
        bar.close()
        return [results[i] for i in range(len(prompts))]

    def _abandon(self, order: dict[str, int]) -> None:
        """Abort the requests of a call that failed half-way through adding them, and let them end."""
        for request_id in order:
            self.engine.abort_request(request_id)
        self._run_until_done({}, None)

    def _run_until_done(
        self, order: dict[str, int], results: dict[int, RequestOutput] | None, bar: tqdm | None = None
    ) -> None:
        # Then the background work these requests started (canonical chunk entries), so that the
        # next call finds it done and none of its requests shares a step with it.
        while self.engine.has_unfinished_requests() or self.engine.has_background_work():
            for out in self.engine.step():
                if out.finished and results is not None and out.request_id in order:
                    results[order[out.request_id]] = out
                    if bar is not None:
                        bar.update(1)

    def prewarm(
        self, items: Sequence[dict[str, Any]], use_tqdm: bool = False, window: int = 8
    ) -> list[RequestOutput]:
        """Compute and cache each item's system part and documents without generating; an item is
        `{"prompt": chunked prompt}` or `{"system": str, "documents": [str, ...]}`. At most `window`
        items are in flight at once, so their entries fit the pool; every entry is written to the
        lower tiers before this returns. Outputs in input order (failed ones carry `error`)."""
        results: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(items), desc="prewarming", unit="item", disable=not use_tqdm)
        for start in range(0, len(items), window):
            order: dict[str, int] = {}
            try:
                for i in range(start, min(start + window, len(items))):
                    item = items[i]
                    unknown = sorted(set(item) - {"prompt", "system", "documents", "cache_salt"})
                    if unknown:
                        raise InvalidRequestError(f"unknown fields {unknown}")
                    request_id = f"prewarm-{next(self._ids)}"
                    try:
                        self.engine.add_prewarm(request_id, **item)
                    except InvalidRequestError as e:
                        raise InvalidRequestError(f"item {i}: {e}") from None
                    order[request_id] = i
            except Exception:
                self._abandon(order)
                raise
            self._run_until_done(order, results, bar)
        bar.close()
        self.engine.flush_chunk_tiers()
        return [results[i] for i in range(len(items))]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
        documents: list[Any] | None = None,
        chunk_options: ReuseOptions | Mapping[str, object] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template, then generate. `documents`
        (strings or {title, text} dicts, given to every conversation) become one chunk each."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.engine.render_chat(list(c), documents=documents)  # type: ignore[arg-type]
            for c in conversations
        ]
        # The template writes the special prefix (BOS) itself.
        return self.generate(
            prompts,  # type: ignore[arg-type]
            sampling_params,
            use_tqdm=use_tqdm,
            add_special_tokens=False,
            chunk_options=chunk_options,
        )

    def chunk_cache_stats(self) -> dict[str, Any] | None:
        return self.engine.chunk_cache_stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def close(self) -> None:
        """Finish writing computed chunks to the lower tiers (disk, remote) and release them."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
