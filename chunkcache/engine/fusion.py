"""Layout "fusion": a chunked request decoded as one stream per document, combined per token.

Why: stitching documents' cached KV side by side (layouts "isolated" and "offset") binds facts to
the wrong document when documents are alike (issue 32). A stream S + Ci + Q reads exactly the KV
the chunk pool holds for (S, Ci), so every stream is exact and only Q is computed per stream.
The documents' evidence is combined at decode time instead (PCED, arXiv 2601.08670): every step
the streams' next-token distributions become one distribution (a `Combiner`), the request's
sampling options apply to that one, and the token chosen is appended to every stream.

The request's own Sequence holds the reply (text, stop conditions, logprobs, usage) and pins the
pool entries; it is never scheduled. Its streams are sequences that the scheduler moves as one
unit (admitted, preempted and finished together), so they always hold the same tokens and all
yield their logits in the same step.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from chunkcache.config import ChunkConfig, SchedulerConfig
from chunkcache.core.plan import ChunkedPrompt
from chunkcache.core.sequence import Sequence, SequenceKind, Status
from chunkcache.engine.prompt_logprobs import prompt_slices
from chunkcache.errors import InvalidRequestError


class FusionRule(enum.Enum):
    MAX_CONFIDENCE = "max_confidence"
    PRODUCT = "product"
    CONTRASTIVE = "contrastive"


class Combiner(abc.ABC):
    """One rule: the streams' next-token log-probs [streams, vocab] (the no-document stream last,
    where there is one) and their relevance [streams] -> one distribution's log-probs [vocab]."""

    @abc.abstractmethod
    def combine(self, logprobs: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor: ...


class MaxConfidence(Combiner):
    """The most confident stream (highest top probability) decides alone: a document that holds
    the answer usually makes its stream sure of it, the others hedge."""

    def combine(self, logprobs: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
        return logprobs[int(logprobs.max(-1).values.argmax())]


class Product(Combiner):
    """A weighted product of experts: sum_k w_k log p_k, renormalised, with w = softmax over the
    streams of their relevance, so that the documents that explain the question weigh most."""

    def combine(self, logprobs: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(relevance, 0)
        return torch.log_softmax((weights[:, None] * logprobs).sum(0), -1)


@dataclass(frozen=True)
class Contrastive(Combiner):
    """PCED's retrieval-aware contrastive rule: each document stream's scores contrasted with
    the no-document stream's, e_k = (1 + beta) log p_k - beta log p_0 (what the document adds to
    what the model knows anyway); the stream with the highest max_v e_k(v) + gamma * r_k decides,
    r = softmax of the document streams' relevance (PCED's retrieval scores, which a serving
    engine does not have), and its softmax(e_k) is the distribution. Log-probs, not raw logits,
    are contrasted so that streams compare on one scale."""

    beta: float
    gamma: float

    def combine(self, logprobs: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
        experts, prior = logprobs[:-1], logprobs[-1]
        scores = (1 + self.beta) * experts - self.beta * prior
        support = scores.max(-1).values + self.gamma * torch.softmax(relevance[:-1], 0)
        return torch.log_softmax(scores[int(support.argmax())], -1)


def combiner_for(config: ChunkConfig) -> Combiner:
    rule = FusionRule(config.fusion_rule)
    if rule is FusionRule.MAX_CONFIDENCE:
        return MaxConfidence()
    if rule is FusionRule.PRODUCT:
        return Product()
    return Contrastive(config.fusion_contrast_weight, config.fusion_relevance_weight)


def num_streams(prompt: ChunkedPrompt, config: ChunkConfig, limits: SchedulerConfig) -> int:
    """How many streams a fusion request decodes; they run in one batch, so they must fit one."""
    streams = len(prompt.chunks) + int(config.fusion_amateur)
    if streams > min(limits.max_num_seqs, limits.max_num_batched_tokens):
        raise InvalidRequestError(
            f"layout fusion decodes {streams} streams (one per document) in one batch, more than "
            f"max_num_seqs {limits.max_num_seqs} or max_num_batched_tokens {limits.max_num_batched_tokens}",
            "prompt",
        )
    return streams


@dataclass(eq=False)
class FusionGroup:
    request: Sequence
    streams: list[Sequence]
    combiner: Combiner
    # Per stream, log p(Q[j] | its S, Ci, Q[:j]) for j >= 1 by position (a stream recomputed after
    # a preemption overwrites, never appends): the stream's relevance is their mean.
    question_logprobs: list[list[float | None]] = field(default_factory=list)

    @classmethod
    def create(cls, request: Sequence, prompt: ChunkedPrompt, config: ChunkConfig) -> FusionGroup:
        """The group of a request whose own tokens are Q: one stream per chunk (S + Ci + Q, Q at
        position len(S) + len(Ci), as the fill job left Ci), then S + Q where `fusion_amateur`."""
        s = len(prompt.sys_token_ids)
        contexts = [(prompt.sys_token_ids + c, s + len(c)) for c in prompt.chunks]
        if config.fusion_amateur:
            contexts.append((prompt.sys_token_ids, s))
        q = list(prompt.question_token_ids)
        streams = [
            Sequence(
                request_id=f"{request.request_id}/stream-{i}",
                prompt_token_ids=[*context, *q],
                token_ids=list(q),
                params=request.params,
                position_base=base,
                kind=SequenceKind.FUSION_STREAM,
                prefix_cacheable=False,
                cache_salt=request.cache_salt,
            )
            for i, (context, base) in enumerate(contexts)
        ]
        group = cls(request, streams, combiner_for(config), [[None] * max(len(q) - 1, 0) for _ in streams])
        for seq in (request, *streams):
            seq.fusion = group
        return group

    def ready(self, request_ready: Callable[[Sequence], bool]) -> bool:
        """Whether the streams may run: the request's entries are computed (then each stream
        borrows S and its chunk, as the chunk manager laid them out)."""
        if not request_ready(self.request):
            return False
        if self.streams[0].borrowed_slots is None:
            assert self.request.chunks is not None and self.request.chunks.stream_slots is not None
            slots = self.request.chunks.stream_slots
            for stream, stream_slots in zip(self.streams, slots, strict=True):
                stream.borrowed_slots = stream_slots
        return True

    def relevance(self) -> torch.Tensor:
        """Per stream, the mean log-likelihood it gives Q's tokens (0 where Q has one token)."""
        means = []
        for values in self.question_logprobs:
            known = [v for v in values if v is not None]
            means.append(sum(known) / len(known) if known else 0.0)
        return torch.tensor(means, dtype=torch.float32)

    def combine(self, stream_logits: torch.Tensor) -> torch.Tensor:
        """The streams' raw logits [streams, vocab] (stream order) -> combined log-probs [vocab]."""
        logprobs = torch.log_softmax(stream_logits.float(), -1)
        return self.combiner.combine(logprobs, self.relevance())

    def append(self, token_id: int) -> None:
        for stream in self.streams:
            stream.token_ids.append(token_id)

    def check_integrity(self) -> None:
        first = self.streams[0]
        for stream in self.streams:
            assert stream.status == first.status, f"{stream.request_id}: streams scheduled apart"
            assert stream.num_computed == first.num_computed, f"{stream.request_id}: streams out of step"
            assert stream.token_ids == self.request.token_ids, f"{stream.request_id}: tokens differ"
        if self.request.is_finished:
            assert all(s.status == Status.FINISHED and not s.block_table for s in self.streams)


def fuse_rows(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
    """Sampling rows of a step with each group's stream rows replaced by one combined row, at
    its first stream's place, owned by the group's request."""
    if all(s.fusion is None for s in seqs):
        return logits, seqs
    rows_of: dict[int, dict[int, int]] = {}
    for row, seq in enumerate(seqs):
        if seq.fusion is not None:
            rows_of.setdefault(id(seq.fusion), {})[id(seq)] = row
    out_rows: list[torch.Tensor] = []
    out_seqs: list[Sequence] = []
    for row, seq in enumerate(seqs):
        group = seq.fusion
        if group is None:
            out_rows.append(logits[row])
            out_seqs.append(seq)
            continue
        rows = rows_of.pop(id(group), None)
        if rows is None:
            continue  # combined at its first stream
        if len(rows) != len(group.streams):
            raise RuntimeError(f"{group.request.request_id}: its streams reached a token in different steps")
        out_rows.append(group.combine(logits[[rows[id(s)] for s in group.streams]]))
        out_seqs.append(group.request)
    return torch.stack(out_rows), out_seqs


def record_question_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    seqs: Seq[Sequence],
    num_new_tokens: Seq[int],
) -> None:
    """Each stream's log-likelihood of Q's tokens as its prefill computes them (`hidden`
    [tokens, hidden] of one forward over `seqs`' new tokens, in order): its relevance."""
    for part in prompt_slices(compute_logits, hidden, seqs, num_new_tokens, lambda s: s.fusion is not None):
        group = part.seq.fusion
        assert group is not None
        values = group.question_logprobs[next(i for i, s in enumerate(group.streams) if s is part.seq)]
        picked = part.picked()
        values[part.start : part.start + len(picked)] = picked
