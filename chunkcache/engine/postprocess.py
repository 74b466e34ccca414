"""The step's last stage, apart from the engine's bookkeeping: a batch's logits -> sampled tokens
(a fusion request's streams combined into one row), a token appended to its sequence, and a
sequence's RequestOutput (what it produced since the last one it sent)."""

from __future__ import annotations

import torch

from chunkcache.core.sequence import Sequence
from chunkcache.engine.detokenizer import Detokenizer
from chunkcache.engine.fusion import StreamChanges, fuse_rows
from chunkcache.engine.sampler import History, Sampled, sample
from chunkcache.engine.scheduler import ScheduledBatch
from chunkcache.outputs import CompletionOutput, RequestOutput


def sample_batch(
    batch: ScheduledBatch,
    logits: torch.Tensor,
    rows: list[int],
    eos_token_ids: frozenset[int],
) -> tuple[list[tuple[Sequence, Sampled]], StreamChanges]:
    """One token for each sequence of `batch` that samples (`rows`); a fusion request's streams'
    rows become one row, its combined distribution, sampled for the request (none the step its
    pair stream is added). Also the streams that joined their group (the engine schedules them
    with it) or left it (the engine finishes them)."""
    logits, seqs, changes = fuse_rows(logits, [batch.seqs[r] for r in rows])
    if not seqs:
        return [], changes
    histories = [History(s.prompt_token_ids, s.output_token_ids, s.reply.grammar) for s in seqs]
    sampled = sample(
        logits, [s.params for s in seqs], [s.reply.generator for s in seqs], histories, eos_token_ids
    )
    for row, (seq, s) in enumerate(zip(seqs, sampled, strict=True)):
        _shadow_step(seq, s, logits[row])
    return list(zip(seqs, sampled, strict=True)), changes


def _shadow_step(seq: Sequence, s: Sampled, logits: torch.Tensor) -> None:
    """A shadow check's part of a step (fidelity/shadow.py): keep the raw next-token distribution
    of a sequence that records its first steps (a sampled request drawn for a check, its shadow),
    and make a teacher-forced shadow take the served reply's token instead of its own."""
    check = seq.fidelity
    if check is None:
        return
    if check.step_logprobs is not None and len(check.step_logprobs) < check.record_steps:
        check.step_logprobs.append(torch.log_softmax(logits.float(), dim=-1))
    if check.forced_token_ids is not None and s.error is None:
        s.token_id = check.forced_token_ids[seq.num_output_tokens]


def append_token(seq: Sequence, s: Sampled, now: float, detokenizer: Detokenizer) -> None:
    """Append a sampled token (to every stream of a fusion request), detokenize, check stops."""
    seq.token_ids.append(s.token_id)
    if seq.fusion is not None:
        seq.fusion.append(s.token_id)
    if s.logprobs is not None:
        seq.reply.output_logprobs.append(s.logprobs)
    if seq.metrics.first_token_time is None:
        seq.metrics.first_token_time = now
    detokenizer.update(seq)


def make_output(seq: Sequence) -> RequestOutput:
    """The output of `seq` now, its new tokens and text marked as sent."""
    r, u = seq.reply, seq.reuse
    new_tokens = seq.output_token_ids[r.num_sent_tokens :]
    r.num_sent_tokens = seq.num_output_tokens
    # While running, hold back text that could still turn out to be the start of a stop string.
    hold = 0 if seq.is_finished or not seq.params.stop else max(map(len, seq.params.stop)) - 1
    visible = max(r.sent_text_len, len(r.text) - hold)
    new_text = r.text[r.sent_text_len : visible]
    r.sent_text_len = visible
    cached = u.num_prefix_cached + u.num_chunk_cached
    completion = CompletionOutput(
        index=0,
        text=r.text,
        token_ids=list(seq.output_token_ids),
        logprobs=list(r.output_logprobs) if seq.params.logprobs is not None else None,
        finish_reason=r.finish_reason,
        stop_reason=r.stop_reason,
    )
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=list(seq.prompt_token_ids),
        outputs=[completion],
        finished=seq.is_finished,
        metrics=seq.metrics,
        num_cached_tokens=cached,
        num_prefix_cached_tokens=u.num_prefix_cached,
        num_chunk_cached_tokens=u.num_chunk_cached,
        num_computed_tokens=len(seq.prompt_token_ids) - cached,
        num_blend_reused_tokens=u.blend_reused_tokens,
        num_blend_recomputed_tokens=u.blend_recomputed_tokens,
        blend_fallback=u.blend_fallback,
        new_token_ids=new_tokens,
        new_text=new_text,
        prompt_logprobs=list(r.prompt_logprobs) if r.prompt_logprobs is not None else None,
        error=r.error,
    )
