"""The engine requests behind one API request: `n` choices for each of its prompts.

Choice 0 of every prompt is submitted at once, so bad input fails before a response starts.
Choices 1..n-1 of a prompt are submitted when choice 0 gives its first output: by then its prompt's
full blocks are registered in the prefix cache (chunked prompts: its chunks are in the chunk pool),
so the other choices start from that KV instead of computing the same prompt n more times.
With a seed, choice i samples with seed + i (vLLM's rule for parallel sampling), so choices differ
and a request is reproducible.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from chunkcache.chunk.documents import PromptParts
from chunkcache.config import ReuseOptions
from chunkcache.outputs import RequestOutput
from chunkcache.sampling import SamplingParams
from chunkcache.server.engine_loop import EngineLoop, RequestStream

Prompt = str | list[int] | PromptParts


@dataclass(frozen=True)
class Submission:
    """What every engine request of one API request shares but its prompt and sampling params."""

    prefix: str  # of its request ids ("cmpl", "chatcmpl")
    chunk_options: ReuseOptions | None
    add_special_tokens: bool = True
    cache_salt: str | None = None


class ChoiceGroup:
    """Choice i of prompt p has index p * n + i (OpenAI's and vLLM's numbering). Made by `start`."""

    def __init__(
        self,
        loop: EngineLoop,
        submission: Submission,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        n: int,
    ) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self._loop = loop
        self._submission = submission
        self._params = params
        self.prompts = list(prompts)
        self.n = n
        self.streams: dict[int, RequestStream] = {}
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def start(
        cls,
        loop: EngineLoop,
        submission: Submission,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        n: int,
    ) -> ChoiceGroup:
        """A group with choice 0 of every prompt submitted (so bad input fails here)."""
        group = cls(loop, submission, prompts, params, n)
        try:
            for p, prompt in enumerate(group.prompts):
                group.streams[p * n] = await group._submit(prompt, 0)
        except BaseException:
            group.release()
            raise
        return group

    async def _submit(self, prompt: Prompt, choice: int) -> RequestStream:
        """One choice of `prompt`, submitted to the engine (EngineLoop.submit -> LLMEngine.add_request)."""
        s = self._submission
        return await self._loop.submit(
            self._loop.new_request_id(s.prefix),
            prompt,
            self.params_for(choice),
            add_special_tokens=s.add_special_tokens,
            chunk_options=s.chunk_options,
            cache_salt=s.cache_salt,
        )

    @property
    def request_id(self) -> str:
        return self.streams[0].request_id

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def params_for(self, choice: int) -> SamplingParams:
        seed = self._params.seed
        return dataclasses.replace(self._params, seed=None if seed is None else seed + choice)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as the engine produces them, until every choice has finished."""
        for p in range(len(self.prompts)):
            self._tasks.append(asyncio.ensure_future(self._pump(p * self.n, lead=True)))
        remaining = self.num_choices
        while remaining:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item[1].finished:
                remaining -= 1
            yield item

    async def _pump(self, index: int, lead: bool) -> None:
        try:
            started = not lead or self.n == 1
            async for output in self.streams[index]:
                if not started:
                    started = True
                    await self._start_followers(index)
                self._queue.put_nowait((index, output))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # engine death, a follower refused: the response ends with it
            self._queue.put_nowait(e)

    async def _start_followers(self, lead: int) -> None:
        prompt = self.prompts[lead // self.n]
        for i in range(1, self.n):
            self.streams[lead + i] = await self._submit(prompt, i)
            self._tasks.append(asyncio.ensure_future(self._pump(lead + i, lead=False)))

    def release(self) -> None:
        """Abort what has not finished and forget every stream. Idempotent."""
        for task in self._tasks:
            task.cancel()
        for stream in self.streams.values():
            stream.release()
