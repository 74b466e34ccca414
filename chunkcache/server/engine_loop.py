"""The bridge between asyncio request handlers and the engine's single stepping thread.

`LLMEngine.step()` must be called from one thread only and blocks for a whole model forward, so it
runs in a dedicated background thread that steps while there is work and sleeps otherwise. Each
request gets an asyncio queue; the engine thread hands it outputs with `loop.call_soon_threadsafe`
(asyncio queues are not thread-safe). Anything else that touches engine state (stats, integrity
checks) is run by that same thread between steps through `call()`, so no engine internals are read
while a step mutates them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from chunkcache.chunk.documents import PromptParts
from chunkcache.config import ReuseOptions
from chunkcache.outputs import RequestOutput
from chunkcache.sampling import SamplingParams

if TYPE_CHECKING:
    from chunkcache.engine.engine import LLMEngine
    from chunkcache.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_AFTER_WINDOW = 16
RETRY_AFTER_MAX = 60


class QueueFullError(RuntimeError):
    """More requests are waiting for their first token than `--max-queue` allows (HTTP 503 with
    `Retry-After`: 503, not 429, because the server is overloaded, not the client over a quota,
    and the router sends a request that got 503 to another replica)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds, the recent mean gap between first tokens


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error or is shutting down; no request can run (HTTP 503)."""


class ShuttingDownError(EngineDeadError):
    """The server was told to stop: a request arriving after that, or one whose drain timeout
    passed before it finished (HTTP 503 `server_shutting_down`, or an SSE error event)."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (its batch raised); the engine itself goes on (HTTP 500)."""


class RequestStream:
    """The outputs of one request, in order, as the engine thread produces them."""

    def __init__(self, request_id: str, owner: EngineLoop) -> None:
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # perf_counter() at admission; the engine thread reads it for the TTFT histogram.
        self.arrival_time = time.perf_counter()
        # Written by the engine thread only (latency metrics).
        self.last_token_time: float | None = None
        # Written on the event loop only.
        self.got_first_output = False
        self.finished = False
        self.released = False

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        # Runs on the event loop (scheduled by the engine thread).
        if self.released:
            return
        if not self.got_first_output:
            self.got_first_output = True
            self._owner._left_waiting()
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                if item.finished:
                    self.finished = True
                    if item.error is not None:
                        raise RequestFailedError(item.error)
                yield item
        finally:
            # Reached on normal completion, on cancellation (the client hung up) and on
            # `aclose()`: an unfinished request is aborted so its KV blocks are freed.
            self.release()

    def release(self) -> None:
        """Forget this request; abort it in the engine if it has not finished. Idempotent."""
        if self.released:
            return
        if not self.got_first_output:
            self._owner._left_waiting()
            self.got_first_output = True
        self.released = True
        self._owner._forget(self, abort=not self.finished)


class EngineLoop:
    """Owns the engine thread. Create it, `start()` it inside the running event loop, `shutdown()`."""

    def __init__(self, engine: LLMEngine, *, max_queue: int, metrics: ServerMetrics | None = None) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        # Bound on requests admitted but still waiting for their first token (queued or in
        # prefill); beyond it new requests are refused instead of piling up latency for everyone.
        self.max_queue = max_queue
        self.metrics = metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._num_waiting = 0  # event-loop side only
        # When the last requests left the waiting set (first output, or gone): a refused client's
        # Retry-After is the mean gap between them.
        self._left: deque[float] = deque(maxlen=RETRY_AFTER_WINDOW)
        self._wake = threading.Condition()
        self._work_pending = False
        self._calls: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._stopping = False
        self._accepting = True
        self._drain_timer: asyncio.TimerHandle | None = None
        # Held by the thread around every step; `paused()` takes it to freeze the engine.
        self._step_lock = threading.Lock()
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._prep_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunkcache-prep")
        # Called on the engine thread if it dies: the server exits so that a supervisor restarts it.
        self.on_death: Callable[[BaseException], None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EngineLoop already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="chunkcache-engine", daemon=True)
        self._thread.start()

    def begin_drain(self, drain_timeout: float | None) -> None:
        """Stop admitting requests; once `drain_timeout` seconds pass, end every one still in
        flight with ShuttingDownError, so that each gets a proper error (a JSON 503, or an SSE error
        event and [DONE]) before the HTTP server stops waiting for it. Thread-safe (a signal
        handler calls it); a second call changes nothing."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._start_drain_timer, drain_timeout)

    def _start_drain_timer(self, drain_timeout: float | None) -> None:
        self._accepting = False
        if drain_timeout is not None and self._drain_timer is None:
            assert self._loop is not None
            self._drain_timer = self._loop.call_later(drain_timeout, self._end_in_flight, drain_timeout)

    def _end_in_flight(self, drain_timeout: float) -> None:
        with self._streams_lock:
            streams = list(self._streams.values())
        if streams:
            logger.warning("drain timeout: ending %d in-flight requests with an error", len(streams))
        for stream in streams:
            # Delivered like any output: the consumer raises it, and releasing the stream aborts
            # the request in the engine.
            stream._deliver(
                ShuttingDownError(
                    f"the server is shutting down: this request did not finish within the drain "
                    f"timeout ({drain_timeout:g} s, --drain-timeout)"
                )
            )

    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish (up to `drain_timeout` seconds, then
        abort them), stop the thread and close the engine."""
        self._accepting = False
        deadline = None if drain_timeout is None else time.monotonic() + drain_timeout
        while self._streams and self._dead is None:
            if deadline is not None and time.monotonic() >= deadline:
                logger.warning("drain timeout: aborting %d in-flight requests", len(self._streams))
                for stream in list(self._streams.values()):
                    stream.release()
                break
            await asyncio.sleep(0.05)
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._prep_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    @property
    def alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests ----------------------------------------------------------------------------

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.time_ns():x}"

    async def submit(
        self,
        request_id: str,
        prompt: str | list[int] | PromptParts,
        params: SamplingParams,
        *,
        add_special_tokens: bool = True,
        chunk_options: ReuseOptions | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Admit a request. Call on the event loop. Raises QueueFullError / EngineDeadError, or the
        engine's InvalidRequestError (PromptTooLongError) from its synchronous validation, which
        (tokenization included) runs on a worker thread so that a long prompt stalls no other client."""
        return await self._admit(
            request_id,
            lambda: self.engine.add_request(
                request_id,
                prompt,
                params,
                add_special_tokens=add_special_tokens,
                chunk_options=chunk_options,
                cache_salt=cache_salt,
            ),
        )

    async def submit_prewarm(self, request_id: str, **fields: Any) -> RequestStream:
        """Admit a prewarm request (`LLMEngine.add_prewarm`'s fields), as `submit` admits others."""
        return await self._admit(request_id, lambda: self.engine.add_prewarm(request_id, **fields))

    async def _admit(self, request_id: str, add: Callable[[], None]) -> RequestStream:
        if self._dead is None and self.alive and not self._accepting:
            raise ShuttingDownError("the server is shutting down: it admits no new request")
        if self._dead is not None or not self.alive:
            raise EngineDeadError("the engine is not accepting requests (stopped or failed)")
        if self._num_waiting >= self.max_queue:
            raise QueueFullError(
                f"server busy: {self._num_waiting} requests are already waiting (max_queue={self.max_queue})",
                self.retry_after(),
            )
        stream = RequestStream(request_id, self)
        # Registered before add_request so that no output of it can arrive unrouted; counted as
        # waiting from now, so that requests being tokenized count against max_queue too.
        with self._streams_lock:
            self._streams[request_id] = stream
        self._num_waiting += 1
        added = asyncio.get_running_loop().run_in_executor(self._prep_pool, add)
        try:
            await asyncio.shield(added)
        except asyncio.CancelledError:
            # The client left while its prompt was prepared: abort the request once it is queued.
            added.add_done_callback(lambda f: self._abort_if_added(f, request_id))
            self._undo_submit(stream)
            raise
        except BaseException:
            self._undo_submit(stream)
            raise
        self._kick()
        return stream

    def _left_waiting(self) -> None:
        self._num_waiting -= 1
        self._left.append(time.perf_counter())

    def retry_after(self) -> int:
        """Seconds until a waiting slot is likely free: the mean gap between the last requests
        that left the waiting set, at least 1 and at most RETRY_AFTER_MAX (1 before any left)."""
        if len(self._left) < 2:
            return 1
        gap = (self._left[-1] - self._left[0]) / (len(self._left) - 1)
        return min(RETRY_AFTER_MAX, max(1, math.ceil(gap)))

    def _undo_submit(self, stream: RequestStream) -> None:
        with self._streams_lock:
            self._streams.pop(stream.request_id, None)
        self._left_waiting()
        stream.got_first_output = stream.released = True

    def _abort_if_added(self, future: asyncio.Future[None], request_id: str) -> None:
        if not future.cancelled() and future.exception() is None and self._dead is None:
            self.engine.abort_request(request_id)
            self._kick()

    async def run_off_loop(self, fn: Callable[[], T]) -> T:
        """Run CPU-bound request preparation (tokenizing, chat templates) on the one worker thread.

        One worker: the tokenizer is not made for concurrent use, and order is kept."""
        return await asyncio.get_running_loop().run_in_executor(self._prep_pool, fn)

    def _forget(self, stream: RequestStream, *, abort: bool) -> None:
        with self._streams_lock:
            self._streams.pop(stream.request_id, None)
        if abort and self._dead is None:
            self.engine.abort_request(stream.request_id)
            # The abort takes effect at the next step: make sure one runs.
            self._kick()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between two steps and return its result."""
        if not self.alive:
            # No thread to race with (not started, or stopped): run it here.
            return fn()
        future: Future[T] = Future()
        with self._wake:
            self._calls.append((fn, future))
            self._wake.notify()
        return await asyncio.wrap_future(future)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine between steps (for maintenance and tests); requests queue meanwhile."""
        with self._step_lock:
            yield

    # ---- engine thread -----------------------------------------------------------------------

    def _kick(self) -> None:
        with self._wake:
            self._work_pending = True
            self._wake.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._work_pending or self._calls or self._stopping):
                        self._wake.wait()
                    if self._stopping and not self._work_pending and not self._calls:
                        break
                    self._work_pending = False
                self._run_calls()
                # Background work (canonical chunk entries, prewarms) runs on what requests leave.
                while self.engine.has_unfinished_requests() or self.engine.has_background_work():
                    with self._step_lock:
                        outputs = self.engine.step()
                    self._dispatch(outputs)
                    self._run_calls()
                    if self._stopping and not self._streams:
                        break
        except BaseException as e:
            logger.exception("engine thread failed; the server cannot run requests any more")
            self._dead = e
            self._fail_all(e)
            if self.on_death is not None:
                self.on_death(e)
        finally:
            self._fail_pending_calls()

    @property
    def dead(self) -> BaseException | None:
        """The error that stopped the engine thread, if one did."""
        return self._dead

    def _run_calls(self) -> None:
        with self._wake:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)

    def _fail_pending_calls(self) -> None:
        with self._wake:
            calls, self._calls = self._calls, []
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine thread has stopped"))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        now = time.perf_counter()
        for output in outputs:
            with self._streams_lock:
                stream = self._streams.get(output.request_id)
            if self.metrics is not None:
                self.metrics.observe_output(output, stream, now)
            if stream is not None:
                if output.new_token_ids:
                    stream.last_token_time = now
                self._loop.call_soon_threadsafe(stream._deliver, output)

    def _fail_all(self, error: BaseException) -> None:
        if self._loop is None:
            return
        failure = EngineDeadError(f"the engine failed: {type(error).__name__}")
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            with contextlib.suppress(RuntimeError):  # the loop may already be closed
                self._loop.call_soon_threadsafe(stream._deliver, failure)
