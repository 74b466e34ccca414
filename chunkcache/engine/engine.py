"""LLMEngine: requests in, one `step()` at a time, RequestOutputs out.

`add_request` and `abort_request` may be called from any thread: they only validate (intake.py)
and post to an inbox. `step()` runs on one thread and owns every other piece of state. What the
engine is built of (model, KV cache, chunk pool and tiers, event publisher) is made by build.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from chunkcache.config import EngineConfig, ReuseOptions
from chunkcache.core.sequence import Sequence, SequenceKind, Status
from chunkcache.engine.build import build_engine
from chunkcache.engine.chat import ChatRenderer
from chunkcache.engine.chunk_steps import ChunkSteps
from chunkcache.engine.detokenizer import Detokenizer
from chunkcache.engine.fusion import JointStats, StreamChanges
from chunkcache.engine.intake import Prompt, RequestIntake
from chunkcache.engine.postprocess import append_token, make_output, sample_batch
from chunkcache.engine.scheduler import ScheduledBatch, Scheduler
from chunkcache.errors import InvalidRequestError
from chunkcache.fidelity.shadow import ShadowChecks
from chunkcache.kv_events import AllBlocksCleared
from chunkcache.outputs import RequestOutput
from chunkcache.sampling import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        parts = build_engine(config)
        config = self.config = parts.config  # the fidelity gate may have chosen its chunk options
        self.spec, self.tokenizer, self.device = parts.spec, parts.tokenizer, parts.loaded.device
        self.model_name, self.max_model_len = parts.model_name, parts.max_model_len
        self.kernels = parts.kernels  # "c", "torch" or None (off CPU): which serve quantized products
        self.blocks, self.runner, self.chunks = parts.blocks, parts.runner, parts.chunks
        self.publisher = parts.publisher
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.spec.num_layers)
        self.detokenizer = Detokenizer(self.tokenizer, parts.loaded.eos_token_ids, self.max_model_len)
        self._generator = torch.Generator().manual_seed(config.seed)
        self.intake = RequestIntake(config, parts, self._generator)
        self.chunk_steps = None
        if self.chunks is not None:
            self.chunk_steps = ChunkSteps(
                self.chunks, config.chunk, self.blocks, self.runner, self._generator, self.intake
            )
        # Online shadow checks of chunked requests, and the controller they steer (fidelity/).
        self.shadows = ShadowChecks(
            config.fidelity, config.seed, self.blocks, self.max_model_len, parts.controller
        )
        # The chat rendered by the model's template (chat.py says how).
        self.render_chat = ChatRenderer(self.tokenizer, config.chunk).render
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._aborts: list[str] = []
        self._requests: dict[str, Sequence] = {}
        self._ids_in_use: set[str] = set()
        self.counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "cached_tokens": 0}
        self.joint = JointStats()  # fusion requests' joint-stream decisions, for /metrics

    @classmethod
    def from_options(cls, model: str, **options: Any) -> LLMEngine:
        return cls(EngineConfig.from_options(model, **options))

    # ---- requests in (any thread) ------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        add_special_tokens: bool = True,
        chunk_options: ReuseOptions | Mapping[str, object] | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request; raises InvalidRequestError naming what is wrong.

        A `PromptParts` prompt (a chat rendered with its documents) is already cut into S, chunks
        and Q: each part is tokenized alone, as a chunked prompt's parts are.

        `chunk_options` overrides the engine's chunk layout and blend options for this request
        (ReuseOptions, or a mapping of its names: chunk_layout, blend_recompute_ratios, ...).
        Requests share cached KV only with requests of the same `cache_salt` (vLLM's field; None
        shares with None).
        """
        self._post(
            self.intake.request(request_id, prompt, params, add_special_tokens, chunk_options, cache_salt)
        )

    def add_prewarm(
        self,
        request_id: str,
        prompt: str | None = None,
        system: str | None = None,
        documents: list[str] | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        max_tokens: int | None = None,
    ) -> None:
        """Compute and cache a system part and its documents without generating: either a chunked
        `prompt` (its question is ignored) or `system` and `documents`. The request finishes, with
        no tokens, once every entry is in the pool (and handed to the lower tiers); its output
        counts the tokens that were already cached. Raises InvalidRequestError naming what is wrong,
        PromptTooLongError if all its parts hold more than `max_tokens` tokens (None: no limit)."""
        seq = self.intake.prewarm(
            request_id, prompt, system, documents, cache_salt, add_special_tokens, max_tokens
        )
        self._post(seq)

    def _post(self, seq: Sequence) -> None:
        with self._lock:
            if seq.request_id in self._ids_in_use:
                raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
            self._ids_in_use.add(seq.request_id)
            self._inbox.append(seq)

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            pending = bool(self._inbox or self._aborts)
        # list() copies in one step under the GIL: safe against the step thread adding requests.
        # A tier load nobody waits for any more still ends in a step (its entry is settled).
        loading = self.chunks is not None and self.chunks.loads_pending > 0
        return pending or loading or any(not s.kind.is_fill for s in list(self._requests.values()))

    def has_background_work(self) -> bool:
        """Whether work nobody waits for is queued (canonical chunk entries, chunk/manager.py;
        prewarms' fill jobs; exact-prefix jobs): steps run it on the budget requests leave. Call
        from the stepping thread."""
        return self.scheduler.has_background_work()

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit what arrived (and what the chunk cache loaded), lay out what waiting sequences
        borrow, schedule, run, postprocess."""
        finished_now = self._admit()
        if self.chunk_steps is not None:
            self.chunk_steps.lay_out(self.scheduler.waiting)
        batch = self.scheduler.schedule()
        finished_now += self._execute(batch)
        finished_now += self._finish_prewarms()
        outputs = self._collect_outputs(batch, finished_now)
        self._publish_events()
        return outputs

    def _admit(self) -> list[Sequence]:
        """Take the inbox and the aborts; chunked requests pin their entries (their fill jobs are
        scheduled) and tier loads that ended become fill jobs. Returns the requests that ended."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            # Registered under the lock: has_unfinished_requests never sees a request nowhere.
            for seq in inbox:
                self._requests[seq.request_id] = seq
        ended = [seq for seq in inbox if not self._admit_one(seq)]
        for request_id in aborts:
            seq = self._requests.get(request_id)
            if seq is None or seq.is_finished or seq.kind.is_fill:
                continue
            seq.reply.finish_reason = "abort"
            self._finish(seq)
            ended.append(seq)
        if self.chunk_steps is not None:
            started, cancelled = self.chunk_steps.poll()
            self._start_jobs(started)
            for job in cancelled:
                self._finish(job)
        return ended

    def _admit_one(self, seq: Sequence) -> bool:
        """Queue one new sequence; False (the request failed) when its admission fails."""
        self.counters["requests"] += 1
        try:
            if self.chunk_steps is not None and seq.chunk_plan is not None:
                self._start_jobs(self.chunk_steps.admit(seq))
        except Exception as e:
            logger.exception("admitting %s failed", seq.request_id)
            self._fail(seq, f"admission failed: {type(e).__name__}: {e}")
            return False
        if seq.kind is SequenceKind.PREWARM:
            pass  # never scheduled: it ends once its entries are computed (ChunkSteps)
        elif seq.fusion is not None:
            for stream in seq.fusion.streams:
                self.scheduler.add(stream)
        else:
            self.scheduler.add(seq)
        self.shadows.admitted(seq)
        return True

    def _start_jobs(self, jobs: list[Sequence]) -> None:
        """Schedule the chunk cache's jobs; a fill job is tracked too (a failure of its batch
        finds the requests waiting for it). An exact-prefix job is nobody's request: no output."""
        for job in jobs:
            if job.kind.is_fill:
                self._requests[job.request_id] = job
            self.scheduler.add(job)

    def _finish_prewarms(self) -> list[Sequence]:
        """Finish the prewarms whose entries are all computed now."""
        done = [] if self.chunk_steps is None else self.chunk_steps.prewarms_done()
        for seq in done:
            self._finish(seq)
        return done

    def _execute(self, batch: ScheduledBatch) -> list[Sequence]:
        """Run the batch and postprocess it; returns the requests a failure of it ended. With
        nothing to run while chunk entries load, wait for a load (sleep, not spin)."""
        if not batch:
            if self.chunk_steps is not None:
                self.chunk_steps.wait_for_loads()
            return []
        try:
            started, cpu = time.perf_counter(), time.process_time()
            logits, rows = self.runner.run(batch)
            took = time.perf_counter() - started
            self.scheduler.step_took(batch, took)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("step: %s in %.3f s", batch.describe(), took)
            self.shadows.account(batch.seqs, batch.num_new_tokens, time.process_time() - cpu)
            self._postprocess(batch, logits, rows)
        except Exception as e:
            # One bad request must not stop the engine: fail this batch's requests (their KV is
            # in an unknown state), free what they held, and go on with the others.
            logger.exception("step failed; failing the %d sequences of its batch", len(batch))
            return self._fail_batch(batch, f"{type(e).__name__}: {e}")
        return []

    def _postprocess(self, batch: ScheduledBatch, logits: torch.Tensor, rows: list[int]) -> None:
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            self._computed(seq, n)
        now = time.time()
        eos = self.detokenizer.eos_token_ids
        sampled, changes = sample_batch(batch, logits, rows, eos) if rows else ([], StreamChanges())
        for stream in changes.joined:  # a pair stream: scheduled with its group from now on
            self.scheduler.join(stream)
        for stream in changes.dropped:  # a stream that left its group: nobody reads it
            self.scheduler.finish(stream)
        for seq, s in sampled:
            if s.error is not None:
                self._fail(seq, s.error)
                continue
            append_token(seq, s, now, self.detokenizer)
            if seq.reply.finish_reason is not None:
                self._finish(seq)

    def _computed(self, seq: Sequence, n: int) -> None:
        """`n` more own tokens of `seq` have their KV: register full blocks, store learned parts,
        finish a fill job that is done."""
        seq.num_computed += n
        if seq.learn is not None and seq.num_computed >= seq.num_own_prompt_tokens:
            assert self.chunks is not None
            self.chunks.learn(seq, self.runner.kv_caches)
        if seq.kind.is_fill:
            if seq.num_computed == seq.num_tokens:
                self._finish(seq)
            return
        registrable = seq.prefix_keys.registrable(seq.num_computed)
        if registrable:
            self.blocks.register_full_blocks(
                seq.block_table, seq.token_ids, seq.block_hashes, registrable, seq.prefix_keys.block_keys
            )

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if seq.fusion is not None:  # a fusion request: its streams' blocks go back with it
            for stream in seq.fusion.streams:
                self.scheduler.finish(stream)
            if seq.fusion.choice is not None:
                self.joint.observe(seq.fusion.choice)
        seq.metrics.finished_time = time.time()
        if self.chunk_steps is not None:  # then the fill jobs nobody waits for any more
            for job in self.chunk_steps.on_finish(seq):
                self._finish(job)
        if seq.kind.is_fill:
            self._requests.pop(seq.request_id, None)
        elif seq.kind is SequenceKind.SHADOW:
            self.shadows.finished(seq)
        elif seq.kind is SequenceKind.REQUEST:
            shadow = self.shadows.served(seq)
            if shadow is not None:  # drawn for a check: its plain prefill is background work
                self.scheduler.add(shadow)

    def _fail(self, seq: Sequence, message: str) -> None:
        if seq.is_finished:
            return
        reply = seq.reply
        reply.finish_reason, reply.stop_reason, reply.error = "error", None, message
        self._finish(seq)

    def _fail_batch(self, batch: ScheduledBatch, message: str) -> list[Sequence]:
        """Fail every request of `batch`, and every request waiting for a fill job of it."""
        # A fusion stream's failure is its request's (which finishes all its streams).
        failed = list({id(r): r for r in (s.request for s in batch.seqs if not s.kind.is_fill)}.values())
        jobs = [s for s in batch.seqs if s.fill is not None]
        if self.chunk_steps is not None:
            failed += [
                s for s in self.chunk_steps.waiting_for(jobs, self._requests.values()) if s not in failed
            ]
        for seq in failed:
            self._fail(seq, f"the engine failed on this request's batch: {message}")
        for job in jobs:  # jobs still wanted by a request outside the batch are not left half done
            self._fail(job, message)
        return failed

    def _collect_outputs(self, batch: ScheduledBatch, finished_now: list[Sequence]) -> list[RequestOutput]:
        outputs = []
        # A fusion request's streams stand for it; each request once.
        for seq in {id(s.request): s.request for s in [*batch.seqs, *finished_now]}.values():
            if seq.kind.is_fill or self._requests.get(seq.request_id) is not seq:
                continue
            if not seq.output_token_ids[seq.reply.num_sent_tokens :] and not seq.is_finished:
                continue
            outputs.append(make_output(seq))
            if seq.is_finished:
                del self._requests[seq.request_id]
                with self._lock:
                    self._ids_in_use.discard(seq.request_id)
                self.counters["prompt_tokens"] += len(seq.prompt_token_ids)
                self.counters["generated_tokens"] += seq.num_output_tokens
                self.counters["cached_tokens"] += seq.reuse.num_prefix_cached + seq.reuse.num_chunk_cached
        return outputs

    def _publish_events(self) -> None:
        events: list[Any] = self.blocks.events
        if self.chunks is not None:
            events = events + self.chunks.drain_events()
        self.blocks.events = []
        if self.publisher is not None and events:
            self.publisher.publish(events)

    # ---- introspection and control (between steps) -------------------------------------------

    def reset_prefix_cache(self) -> bool:
        ok = self.blocks.reset_prefix_cache()
        if ok and self.publisher is not None:
            self.publisher.publish([AllBlocksCleared()])
        return ok

    def reset_chunk_cache(self) -> int:
        """Evict every chunk pool entry no request holds (written down to the lower tiers first,
        where there are any); returns how many. Call between steps."""
        return 0 if self.chunks is None else self.chunks.pool.evict_all()

    def republish_state(self) -> int | None:
        """Publish the whole cache state (AllBlocksCleared, then every cached block and chunk), for
        a router whose index lost it (Redis restarted, a gap replay could not fill). Returns the
        number of events published, None without a publisher. Call between steps."""
        if self.publisher is None:
            return None
        events: list[Any] = [AllBlocksCleared(), *self.blocks.state_events()]
        if self.chunks is not None:
            events += self.chunks.state_events()
        self.publisher.publish(events)
        return len(events)

    def chunk_cache_stats(self) -> dict[str, Any] | None:
        if self.chunks is None or self.chunk_steps is None:
            return None
        r, f = self.runner, self.chunk_steps.follow_ups
        return {
            **self.chunks.stats(),
            "blend_reused_tokens": r.blend_reused_tokens,
            "blend_recomputed_tokens": r.blend_recomputed_tokens,
            "blend_fallbacks": r.blend_fallbacks,
            "blended_prefix_hits": f.blended_prefix_hits,
            "exact_prefix_hits": f.exact_prefix_hits,
            "exact_prefix_jobs": f.exact_prefix_jobs,
            "fusion_joint": self.joint.as_dict(),
            # Shadow checks per reuse configuration and the controller (fidelity/shadow.py).
            "fidelity": self.shadows.stats(),
        }

    def stats(self) -> dict[str, Any]:
        return {
            # Requests only: fill and exact-prefix jobs are the engine's own work, a fusion
            # request's streams one request (a load-aware router reads these).
            "num_waiting": sum(s.counts_as_request for s in self.scheduler.waiting) + len(self._inbox),
            "num_running": sum(s.counts_as_request for s in self.scheduler.running),
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_free": self.blocks.num_free_blocks,
            "kv_usage": self.blocks.usage(),
            "prefix_cache_blocks": self.blocks.num_cached_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "chunk_cache": self.chunk_cache_stats(),
            "kernels": self.kernels,
            **self.counters,
        }

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        if self.chunks is not None:
            self.chunks.check_integrity()
        for seq in self.scheduler.running:
            assert seq.status == Status.RUNNING, f"{seq.request_id} in running with status {seq.status}"
        for seq in self._requests.values():
            if seq.fusion is not None:
                seq.fusion.check_integrity()

    def flush_chunk_tiers(self) -> None:
        """Wait until every entry computed so far is written to the lower tiers."""
        if self.chunks is not None and self.chunks.tiers is not None:
            self.chunks.tiers.flush()

    def close(self) -> None:
        """Finish the lower tiers' writes and close them; close the event publisher."""
        if self.chunks is not None:
            self.chunks.close()
            # The tiers' last events (their writes just finished) still go out.
            self._publish_events()
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
