"""Prewarms that return early (`POST /v1/chunk_cache/prewarm` with `"wait": false`).

A prewarm of many documents takes as long as their prefill, and its fill jobs are background work
that yields to requests (engine/scheduler.py), so it may take longer still under load: a client
should not have to hold a connection open for it. Such a prewarm answers 202 with its id at once;
its state is read with `GET /v1/chunk_cache/prewarm/{id}` and it is cancelled with `DELETE`.
Finished jobs are remembered (the most recent `MAX_FINISHED`), running ones until they end.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import OrderedDict
from dataclasses import dataclass

from chunkcache.outputs import RequestOutput
from chunkcache.server.engine_loop import EngineDeadError, RequestFailedError, RequestStream
from chunkcache.server.protocol.chunk_cache import PrewarmJobStatus, PrewarmResponse

logger = logging.getLogger(__name__)

# Finished prewarms whose status can still be read; older ones are forgotten first.
MAX_FINISHED = 256


class PrewarmState(enum.Enum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class PrewarmJob:
    id: str
    state: PrewarmState = PrewarmState.RUNNING
    result: PrewarmResponse | None = None
    error: str | None = None
    task: asyncio.Task[None] | None = None

    def status(self) -> PrewarmJobStatus:
        counts = self.result.model_dump(exclude={"id"}) if self.result is not None else {}
        return PrewarmJobStatus(id=self.id, status=self.state.value, error=self.error, **counts)


def prewarm_response(request_id: str, out: RequestOutput) -> PrewarmResponse:
    return PrewarmResponse(
        id=request_id,
        prompt_tokens=len(out.prompt_token_ids),
        cached_tokens=out.num_cached_tokens,
        computed_tokens=out.num_computed_tokens,
    )


async def last_output(stream: RequestStream) -> RequestOutput:
    outputs = [out async for out in stream]
    return outputs[-1]


class PrewarmJobs:
    """The server's early-returning prewarms, by id (event loop only)."""

    def __init__(self, max_finished: int = MAX_FINISHED) -> None:
        self.max_finished = max_finished
        self._jobs: OrderedDict[str, PrewarmJob] = OrderedDict()

    def start(self, stream: RequestStream) -> PrewarmJob:
        job = PrewarmJob(stream.request_id)
        self._jobs[job.id] = job
        job.task = asyncio.get_running_loop().create_task(self._run(job, stream))
        return job

    def get(self, job_id: str) -> PrewarmJob | None:
        return self._jobs.get(job_id)

    def cancel(self, job_id: str) -> PrewarmJob | None:
        """Cancel a running prewarm: its engine request is aborted, which unpins its entries and
        cancels the fill jobs nobody else waits for. A finished one is left as it is."""
        job = self._jobs.get(job_id)
        if job is not None and job.state is PrewarmState.RUNNING and job.task is not None:
            job.task.cancel()
        return job

    async def close(self) -> None:
        """Cancel every running prewarm (server shutdown) and wait for them to let go."""
        tasks = [j.task for j in self._jobs.values() if j.task is not None and not j.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, job: PrewarmJob, stream: RequestStream) -> None:
        try:
            job.result = prewarm_response(job.id, await last_output(stream))
            job.state = PrewarmState.COMPLETED
        except asyncio.CancelledError:
            job.state, job.error = PrewarmState.CANCELLED, "cancelled"
            raise
        except (RequestFailedError, EngineDeadError) as e:
            job.state, job.error = PrewarmState.FAILED, str(e)
        except Exception as e:  # reported in the job's status; the server goes on
            logger.exception("prewarm %s failed", job.id)
            job.state, job.error = PrewarmState.FAILED, f"{type(e).__name__}: {e}"
        finally:
            stream.release()  # aborts it in the engine unless it finished
            self._forget_old()

    def _forget_old(self) -> None:
        finished = [k for k, j in self._jobs.items() if j.state is not PrewarmState.RUNNING]
        for key in finished[: max(0, len(finished) - self.max_finished)]:
            del self._jobs[key]
