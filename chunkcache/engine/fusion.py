"""Layout "fusion": a chunked request decoded as one stream per document, combined per token.

Why: stitching documents' cached KV side by side (layouts "isolated" and "offset") binds facts to
the wrong document when documents are alike (issue 32). A stream S + Ci + Q reads exactly the KV
the chunk pool holds for (S, Ci), so every stream is exact and only Q is computed per stream.
The documents' evidence is combined at decode time instead (PCED, arXiv 2601.08670): every step
the streams' next-token distributions become one distribution (a `Combiner`), the request's
sampling options apply to that one, and the token chosen is appended to every stream.

A question that joins facts of several documents has no stream that sees them all, and a
token-level combination then mixes streams inside one value ("39 and 8" for "39 and 88") or lets
a stream without the second document answer it from memory. `fusion_pair` adds the exact joint
stream S + Ci + ... + Ck + Q over the documents whose streams find Q most likely (known after the
first step: the joint stream joins then, borrowing the first one's slots and computing the others
and Q; the other streams wait, their first rows kept, until its first row), as one more expert or
as the only document stream. It reads every document whose relevance is within
`fusion_pair_margin` of the most relevant one's, at most `fusion_max_joint` (2: the pair stream):
a question about one document names it, and its stream stands out, so the request decodes on
without a joint stream, as plain fusion, and saves its prefill; a question comparing three
documents names three. `fusion_max_streams` bounds the document streams that decode past the
first step to the most relevant ones. `fusion_joint_excerpt` has the joint stream read only the
spans of its later documents that share the question's words (engine/excerpt.py).

The request's own Sequence holds the reply (text, stop conditions, logprobs, usage) and pins the
pool entries; it is never scheduled. Its streams are sequences that the scheduler moves as one
unit (admitted, preempted and finished together), so they always hold the same tokens and all
yield their logits in the same step (but for the pair stream's first, above).
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
import enum
import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from chunkcache.chunk.assemble import offset_deltas
from chunkcache.config import ChunkConfig, SchedulerConfig
from chunkcache.core.plan import ChunkedPrompt, RequestChunks
from chunkcache.core.sequence import Sequence, SequenceKind, Status
from chunkcache.core.sequence_state import BlendState, KVList, PrefixKeys
from chunkcache.engine.excerpt import SpanTable, excerpt
from chunkcache.engine.prompt_logprobs import prompt_slices

logger = logging.getLogger(__name__)


class FusionRule(enum.Enum):
    MAX_CONFIDENCE = "max_confidence"
    PRODUCT = "product"
    CONTRASTIVE = "contrastive"


class FusionPair(enum.Enum):
    NONE = "none"
    EXPERT = "expert"
    LEAD = "lead"


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


def wants_pair(prompt: ChunkedPrompt, config: ChunkConfig) -> bool:
    return FusionPair(config.fusion_pair) is not FusionPair.NONE and len(prompt.chunks) >= 2


def pair_tokens(prompt: ChunkedPrompt, config: ChunkConfig) -> int:
    """Own tokens the joint stream may compute beyond Q (its documents after the first, not known
    before the streams' relevance: the longest that many), for the KV fit."""
    if not wants_pair(prompt, config):
        return 0
    if config.fusion_joint_blend:  # S and every document of it in its own blocks
        most = min(config.fusion_max_joint, len(prompt.chunks))
        return len(prompt.sys_token_ids) + sum(sorted(map(len, prompt.chunks), reverse=True)[:most])
    # Exact: its documents after the first (borrowed), the longest ones (an excerpt may be the
    # whole document: `excerpt.excerpt`).
    most = min(config.fusion_max_joint, len(prompt.chunks)) - 1
    return sum(sorted(map(len, prompt.chunks), reverse=True)[:most])


@dataclass(frozen=True)
class JointChoice:
    """A request's joint stream, decided after its first step: the documents it reads (prompt
    indices, most relevant first; one: no joint stream) and the relevance margin between the two
    most relevant documents (what `fusion_pair_margin` is compared with first)."""

    documents: tuple[int, ...]
    margin: float

    @classmethod
    def choose(cls, relevance: Seq[float], margin: float, most: int) -> JointChoice:
        """Every document within `margin` of the most relevant one, at most `most`."""
        order = sorted(range(len(relevance)), key=lambda k: (-relevance[k], k))
        top = relevance[order[0]]
        within = [k for k in order if top - relevance[k] <= margin][:most]
        return cls(tuple(within), top - relevance[order[1]])


# /metrics buckets of the joint stream's document count and of the top two documents' margin.
JOINT_DOCUMENT_BUCKETS = (1, 2, 3, 4, 6, 8, 16)
JOINT_MARGIN_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0)


@dataclass
class JointStats:
    """The joint-stream decisions of the requests served (`FusionGroup.choice`): histograms of how
    many documents the joint stream read (1: none joined) and of the top two documents' relevance
    margin, cumulative, for /metrics."""

    documents: list[int] = field(default_factory=lambda: [0] * (len(JOINT_DOCUMENT_BUCKETS) + 1))
    documents_sum: int = 0
    margin: list[int] = field(default_factory=lambda: [0] * (len(JOINT_MARGIN_BUCKETS) + 1))
    margin_sum: float = 0.0

    def observe(self, choice: JointChoice) -> None:
        k = len(choice.documents)
        self.documents[bisect.bisect_left(JOINT_DOCUMENT_BUCKETS, k)] += 1
        self.documents_sum += k
        self.margin[bisect.bisect_left(JOINT_MARGIN_BUCKETS, choice.margin)] += 1
        self.margin_sum += choice.margin

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def stream_count(prompt: ChunkedPrompt, config: ChunkConfig) -> int:
    """How many streams a fusion request over `prompt` decodes (document, pair, no-document)."""
    return len(prompt.chunks) + int(wants_pair(prompt, config)) + int(config.fusion_amateur)


def fits_one_batch(streams: int, limits: SchedulerConfig) -> bool:
    return streams <= min(limits.max_num_seqs, limits.max_num_batched_tokens)


@dataclass(eq=False)
class FusionGroup:
    request: Sequence
    streams: list[Sequence]
    combiner: Combiner
    prompt: ChunkedPrompt
    # Per stream, which of the chunk manager's stream slots (S + Ci, or S for the no-document
    # stream) it borrows: the pair stream borrows its first document's.
    slot_of: list[int] = field(default_factory=list)
    # Per stream, own tokens before Q (the pair stream's second document; 0 for the others).
    skip: list[int] = field(default_factory=list)
    # `fusion_pair`: the pair stream joins after the first step (`add_pair`); `pair` is its index
    # in `streams` (after the document streams, before the no-document one) once it exists, and
    # `first_rows` the other streams' first logits, kept until the pair stream yields its own.
    pair_mode: FusionPair = FusionPair.NONE
    pair_margin: float = 100.0
    max_joint: int = 2
    max_streams: int = 0  # document streams that decode past the first step (0: all)
    amateur: bool = False  # the last stream is the no-document one
    choice: JointChoice | None = None  # the joint stream's documents, once decided
    joint_blend: ChunkConfig | None = None  # `fusion_joint_blend`: the blend's options
    # `fusion_joint_excerpt`: the joint stream reads at most this many tokens of each document after
    # the first (0: all), the spans (`spans`: lines, sentences) that share most words with Q.
    excerpt: int = 0
    spans: SpanTable | None = None
    slots_given: bool = False  # the streams' borrowed slots are set (`ready`)
    pair: int | None = None
    first_rows: torch.Tensor | None = None
    # Per stream, log p(Q[j] | its context, Q[:j]) for j >= 1 by position (a stream recomputed after
    # a preemption overwrites, never appends): the stream's relevance is their mean.
    question_logprobs: list[list[float | None]] = field(default_factory=list)

    @classmethod
    def create(
        cls, request: Sequence, prompt: ChunkedPrompt, config: ChunkConfig, spans: SpanTable | None = None
    ) -> FusionGroup:
        """The group of a request whose own tokens are Q: one stream per chunk (S + Ci + Q, Q at
        position len(S) + len(Ci), as the fill job left Ci), then S + Q where `fusion_amateur`.
        `spans`: the tokenizer's span table, where the joint stream reads excerpts."""
        s = len(prompt.sys_token_ids)
        contexts = [(prompt.sys_token_ids + c, s + len(c)) for c in prompt.chunks]
        if config.fusion_amateur:
            contexts.append((prompt.sys_token_ids, s))
        q = list(prompt.question_token_ids)
        group = cls(
            request,
            [],
            combiner_for(config),
            prompt,
            pair_mode=FusionPair(config.fusion_pair) if wants_pair(prompt, config) else FusionPair.NONE,
            pair_margin=config.fusion_pair_margin,
            max_joint=config.fusion_max_joint,
            max_streams=config.fusion_max_streams,
            amateur=config.fusion_amateur,
            joint_blend=config if config.fusion_joint_blend else None,
            excerpt=config.fusion_joint_excerpt if spans is not None else 0,
            spans=spans,
        )
        for k, (context, base) in enumerate(contexts):
            group._add_stream(k, [*context, *q], [], base, k)
        request.fusion = group
        return group

    def _add_stream(self, at: int, prompt_ids: list[int], before: Seq[int], base: int, slot: int) -> Sequence:
        """A stream computing `before` + Q (+ the reply so far) after its borrowed slots."""
        stream = Sequence(
            request_id=f"{self.request.request_id}/stream-{len(self.streams)}",
            prompt_token_ids=prompt_ids,
            token_ids=[*before, *self.request.token_ids],
            params=self.request.params,
            kv_list=KVList(position_base=base),
            kind=SequenceKind.FUSION_STREAM,
            prefix_keys=PrefixKeys(cacheable=False, cache_salt=self.request.prefix_keys.cache_salt),
        )
        stream.num_own_prompt_tokens = len(before) + len(self.prompt.question_token_ids)
        stream.fusion = self
        self.streams.insert(at, stream)
        self.slot_of.insert(at, slot)
        self.skip.insert(at, len(before))
        self.question_logprobs.insert(at, [None] * max(len(self.prompt.question_token_ids) - 1, 0))
        return stream

    def joint_part(self, k: int) -> list[int]:
        """What the joint stream reads of document k after its first: all of it, or its excerpt."""
        chunk = list(self.prompt.chunks[k])
        if not self.excerpt or self.spans is None:
            return chunk
        return excerpt(chunk, self.prompt.question_token_ids, self.spans, self.excerpt)

    def pair_wanted(self) -> bool:
        """After the first step: choose the joint stream's documents (`JointChoice.choose`); it
        joins where there are two or more, else the group decodes on without one."""
        relevance = self.relevance()[: len(self.prompt.chunks)].tolist()
        self.choice = JointChoice.choose(relevance, self.pair_margin, self.max_joint)
        logger.debug(
            "%s: joint stream over %d of %d documents %s (at most %d): relevance %s, top two %.3f apart, "
            "margin %.3f",
            self.request.request_id,
            len(self.choice.documents),
            len(relevance),
            list(self.choice.documents),
            self.max_joint,
            [round(r, 3) for r in relevance],
            self.choice.margin,
            self.pair_margin,
        )
        if len(self.choice.documents) >= 2:
            return True
        self.pair_mode = FusionPair.NONE
        return False

    def add_pair(self, rows: torch.Tensor) -> Sequence:
        """After the first step (every stream's Q computed, so their relevance known): keep their
        logits `rows` and add the exact joint stream S + Ci + ... + Ck + Q over the chosen
        documents, in prompt order, Ci borrowed (its stream's slots), the others and Q computed."""
        assert self.choice is not None
        prompt = self.prompt
        n = len(prompt.chunks)
        documents = sorted(self.choice.documents)
        first = documents[0]
        context = prompt.sys_token_ids + prompt.chunks[first]
        before = [t for k in documents[1:] for t in self.joint_part(k)]
        if self.excerpt:
            logger.debug(
                "%s: joint stream reads %d of %d tokens after its first document",
                self.request.request_id,
                len(before),
                sum(len(prompt.chunks[k]) for k in documents[1:]),
            )
        ids = [*context, *before, *prompt.question_token_ids]
        if self.joint_blend is not None:  # all of it in its own blocks, blended from the pool's KV
            stream = self._add_stream(n, ids, [*context, *before], 0, first)
            stream.blend, stream.chunks = BlendState(self.joint_blend), self._joint_chunks(documents)
        else:
            stream = self._add_stream(n, ids, before, len(context), first)
            stream.kv_list.borrowed_slots = self.streams[first].kv_list.borrowed_slots
        stream.status = self.streams[0].status
        self.pair, self.first_rows = n, rows
        return stream

    def _joint_chunks(self, documents: list[int]) -> RequestChunks:
        """What a blended joint stream reads (engine/runner.py's blend input): S and `documents`
        as a chunked prompt of their own, their pool slots and how far each moves."""
        request = self.request.chunks
        assert request is not None and request.stream_slots is not None
        s = len(self.prompt.sys_token_ids)
        parts = [0, *(d + 1 for d in documents)]  # S's entry, then the documents'
        state = RequestChunks(
            ChunkedPrompt(
                self.prompt.sys_token_ids,
                tuple(self.prompt.chunks[d] for d in documents),
                self.prompt.question_token_ids,
            ),
            entries=[request.entries[k] for k in parts],
            slices=[request.slices[k] for k in parts],
            assembled=True,
            was_cached=[request.was_cached[k] for k in parts],
        )
        slots = [request.stream_slots[documents[0]], *(request.stream_slots[d][s:] for d in documents[1:])]
        state.cached_slots = torch.cat(slots)
        state.cached_delta = offset_deltas(state).to(state.cached_slots.device)
        return state

    def drop_unread(self) -> list[Sequence]:
        """After a combined row, the document streams that need not decode on leave the group
        (their KV blocks and decode rows are freed): under "lead", once the joint stream has
        spoken, all of them; else those beyond the `max_streams` most relevant. The streams it
        takes out."""
        documents = self.pair if self.pair is not None else len(self.streams) - self.amateur
        if self.pair_mode is FusionPair.LEAD and self.pair:
            keep = list(range(self.pair, len(self.streams)))
        elif 0 < self.max_streams < documents:
            relevance = self.relevance()[:documents].tolist()
            top = sorted(range(documents), key=lambda k: (-relevance[k], k))[: self.max_streams]
            keep = [*sorted(top), *range(documents, len(self.streams))]
        else:
            return []
        dropped = [s for k, s in enumerate(self.streams) if k not in keep]
        if self.pair is not None:
            self.pair = keep.index(self.pair)
        self.streams = [self.streams[k] for k in keep]
        self.slot_of = [self.slot_of[k] for k in keep]
        self.skip = [self.skip[k] for k in keep]
        self.question_logprobs = [self.question_logprobs[k] for k in keep]
        return dropped  # still pointing at the group: the request they answered

    def give_slots(self) -> None:
        """Once the chunk manager has laid out the request's view of its entries (all computed),
        each stream borrows S and its chunk from it; the streams are then ready to run."""
        state = self.request.chunks
        if self.slots_given or state is None or not state.assembled:
            return
        assert state.stream_slots is not None
        for stream, k in zip(self.streams, self.slot_of, strict=True):
            stream.kv_list.borrowed_slots = state.stream_slots[k]
        self.slots_given = True

    def relevance(self) -> torch.Tensor:
        """Per stream, the mean log-likelihood it gives Q's tokens (0 where Q has one token)."""
        means = []
        for values in self.question_logprobs:
            known = [v for v in values if v is not None]
            means.append(sum(known) / len(known) if known else 0.0)
        return torch.tensor(means, dtype=torch.float32)

    def combine(self, stream_logits: torch.Tensor) -> torch.Tensor:
        """The streams' raw logits [streams, vocab] (stream order) -> combined log-probs [vocab].
        A leading pair stream is the only document stream the rule reads."""
        logprobs = torch.log_softmax(stream_logits.float(), -1)
        relevance = self.relevance()
        if self.pair_mode is FusionPair.LEAD:
            assert self.pair is not None
            read = [self.pair, *range(self.pair + 1, len(self.streams))]  # and the no-document one
            logprobs, relevance = logprobs[read], relevance[read]
        return self.combiner.combine(logprobs, relevance)

    def append(self, token_id: int) -> None:
        for stream in self.streams:
            stream.token_ids.append(token_id)

    def check_integrity(self) -> None:
        first = self.streams[0]
        done = [s.num_computed >= s.num_own_prompt_tokens for s in self.streams]
        left = [s.num_tokens - s.num_computed for s in self.streams]
        for k, stream in enumerate(self.streams):
            assert stream.status == first.status, f"{stream.request_id}: streams scheduled apart"
            if self.first_rows is not None:  # the others wait for the pair stream's first row
                assert k == self.pair or left[k] == 0, f"{stream.request_id}: ran ahead of the pair stream"
            elif any(done):  # out of prefill together, then one token each per step
                assert done[k] and left[k] == left[self.pair or 0], f"{stream.request_id}: out of step"
            assert stream.token_ids[self.skip[k] :] == self.request.token_ids, f"{stream.request_id}: tokens"
        if self.request.is_finished:
            assert all(s.status == Status.FINISHED and not s.block_table for s in self.streams)


@dataclass
class StreamChanges:
    """Streams a step added to their groups (pair streams, to be scheduled with them) and took out
    of them (under "lead", the document streams nobody reads once the pair stream speaks)."""

    joined: list[Sequence] = field(default_factory=list)
    dropped: list[Sequence] = field(default_factory=list)


def fuse_rows(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[torch.Tensor, list[Sequence], StreamChanges]:
    """Sampling rows of a step with each group's stream rows replaced by one combined row, at
    its first stream's place, owned by the group's request; and the streams that joined or left a
    group (a group samples nothing the step its pair stream joins, `FusionGroup.add_pair`)."""
    changes = StreamChanges()
    if all(s.fusion is None for s in seqs):
        return logits, seqs, changes
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
        if len(rows) == len(group.streams):
            stream_rows = logits[[rows[id(s)] for s in group.streams]]
            if group.pair_mode is not FusionPair.NONE and group.pair is None and group.pair_wanted():
                changes.joined.append(group.add_pair(stream_rows))
                continue
        elif group.first_rows is not None and list(rows) == [id(group.streams[group.pair or 0])]:
            pair_row = logits[rows[id(group.streams[group.pair or 0])]][None]
            stream_rows = torch.cat(
                (group.first_rows[: group.pair], pair_row, group.first_rows[group.pair :])
            )
        else:
            raise RuntimeError(f"{group.request.request_id}: its streams reached a token in different steps")
        group.first_rows = None
        out_rows.append(group.combine(stream_rows))
        out_seqs.append(group.request)
        changes.dropped.extend(group.drop_unread())
    if not out_rows:
        return logits[:0], out_seqs, changes
    return torch.stack(out_rows), out_seqs, changes


def record_question_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    seqs: Seq[Sequence],
    num_new_tokens: Seq[int],
) -> None:
    """Each stream's log-likelihood of Q's tokens as its prefill computes them (`hidden`
    [tokens, hidden] of one forward over `seqs`' new tokens, in order): its relevance."""

    def index(seq: Sequence) -> int:
        assert seq.fusion is not None
        return next(i for i, s in enumerate(seq.fusion.streams) if s is seq)

    def first(seq: Sequence) -> int:
        assert seq.fusion is not None
        return seq.fusion.skip[index(seq)]

    wanted = lambda s: s.fusion is not None  # noqa: E731
    for part in prompt_slices(compute_logits, hidden, seqs, num_new_tokens, wanted, first):
        group = part.seq.fusion
        assert group is not None
        k = index(part.seq)
        values = group.question_logprobs[k]
        picked = part.picked()
        at = part.start - group.skip[k]
        values[at : at + len(picked)] = picked
