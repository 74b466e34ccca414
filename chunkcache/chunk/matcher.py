"""Separator-free matching: cached chunk KV found inside a plain prompt, wherever it sits.

Anchors are content-defined, as in content-defined chunking: a polynomial rolling hash over every
window of `WINDOW` tokens, and a window is an anchor when its mixed hash is 0 modulo `INTERVAL`
(one window in `INTERVAL` on average). Whether a window is an anchor depends on its tokens only,
so the same text yields the same anchors wherever it sits and whatever surrounds it.

Every chunk entry of the pool (a separator prompt's chunk, a chat document, a span learned from a
plain prompt) registers its anchors in a `SpanIndex`: anchor hash -> (entry, offset). A plain
prompt's anchors are looked up there; each candidate is verified token by token and extended to
the left and right as long as the prompt and the entry agree (a run that starts at its entry's
first token is preferred to a longer one from inside an entry: see ChunkManager's canonical
entries), so a match is exact token ids, and
tokenization that differs at a document's edges (a space or a newline merged into the first
token) simply ends the match there: the interior is reused, the edges are computed. Runs shorter
than `min_tokens` are not worth a chunk and are computed too.

`plan` turns the matches into the parts of the one chunked-prompt machinery (`ChunkedPrompt`):
S = the tokens before the first anchor, then alternately matched runs (borrowed as slices of their
entries) and gaps (new chunks, computed and cached: that is how the cache learns the documents of
plain prompts), and Q = the tokens after the last anchor (always computed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chunkcache.core.plan import Entry

WINDOW = 8
INTERVAL = 16
_MOD = (1 << 61) - 1
_BASE = 1_000_003
_TOP = pow(_BASE, WINDOW - 1, _MOD)
_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
# A run that starts within this many tokens of its entry's start counts as aligned with it: a
# run's edges are where two prompts stopped agreeing, so an entry made from one often opens with a
# token or two of its neighbour's end (a full stop, a blank line) that the next prompt lacks.
ALIGN_SLACK = 4
# Candidates kept per anchor hash (the most recent): repeated boilerplate must not make a lookup
# verify every entry that ever held it.
_MAX_CANDIDATES = 4


def window_hashes(token_ids: Sequence[int]) -> list[int]:
    """Rolling hash of every window of WINDOW tokens: entry i covers token_ids[i : i + WINDOW]."""
    n = len(token_ids)
    if n < WINDOW:
        return []
    h = 0
    for t in token_ids[:WINDOW]:
        h = (h * _BASE + t + 1) % _MOD
    out = [h]
    for i in range(WINDOW, n):
        h = ((h - (token_ids[i - WINDOW] + 1) * _TOP) * _BASE + token_ids[i] + 1) % _MOD
        out.append(h)
    return out


def anchors(token_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(position, hash) of every anchor window, in order."""
    return [
        (i, h) for i, h in enumerate(window_hashes(token_ids)) if ((h * _MIX & _MASK64) >> 40) % INTERVAL == 0
    ]


@dataclass(frozen=True)
class Run:
    """Prompt tokens [start, start + length) equal entry chunk tokens [entry_start, ...)."""

    start: int
    length: int
    entry: Entry
    entry_start: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def aligned(self) -> bool:
        """Whether the run starts at (or within ALIGN_SLACK tokens of) its entry's start."""
        return self.entry_start <= ALIGN_SLACK

    def computed_after(self, sys_ids: tuple[int, ...]) -> bool:
        """Whether the run's KV was computed right after `sys_ids`, as a separator chunk's would
        be: its entry's S and the entry's tokens before it are `sys_ids` (exact), or it is aligned
        with an entry computed after `sys_ids`."""
        entry_sys, entry_tokens = self.entry.token_ids
        if self.aligned and entry_sys == sys_ids:
            return True
        n = len(entry_sys)
        return (
            n + self.entry_start == len(sys_ids) and entry_sys + entry_tokens[: self.entry_start] == sys_ids
        )

    def after(self, sys_ids: tuple[int, ...]) -> Run | None:
        """The part of the run whose KV was computed right after exactly `sys_ids` (its entry's S
        and the entry's tokens before it), so that S + that part read from the pool is exactly a
        prefill's KV (layout "fusion"); None where no part was. The part starts where the
        entry's context is `sys_ids`: a run extended left over glue that its entry also holds
        (a blank line) loses those tokens."""
        entry_sys, entry_tokens = self.entry.token_ids
        skip = len(sys_ids) - len(entry_sys) - self.entry_start
        at = self.entry_start + skip
        if not 0 <= skip < self.length or entry_sys + entry_tokens[:at] != sys_ids:
            return None
        return Run(self.start + skip, self.length - skip, self.entry, at)


@dataclass(frozen=True)
class Plan:
    """A plain prompt as parts: S, then chunks (each a matched run or a gap), then Q."""

    sys_end: int
    # (start, end, run or None for a gap) of every chunk, in order, covering [sys_end, q_start)
    # (but for a fusion plan's glue, `fusion_documents`).
    parts: tuple[tuple[int, int, Run | None], ...]
    q_start: int


class SpanIndex:
    """Anchor hash -> the chunk entries holding that window, and where.

    Contract: an entry is found only while `alive(entry)` (the pool still holds it) and only where
    its tokens equal the prompt's (verified token by token); dead references are dropped lazily,
    when met, and in bulk when the index has grown to twice its size after the last sweep.
    """

    def __init__(self, alive: Callable[[Entry], bool]) -> None:
        self._alive = alive
        self._refs: dict[int, list[tuple[Entry, int]]] = {}
        self._size = 0
        self._swept_size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, entry: Entry) -> None:
        """Register the anchors of a chunk entry's own tokens."""
        for pos, h in anchors(entry.token_ids[-1]):
            refs = self._refs.setdefault(h, [])
            refs.append((entry, pos))
            self._size += 1
            if len(refs) > _MAX_CANDIDATES:
                del refs[0]
                self._size -= 1
        if self._size > 2 * self._swept_size + 4096:
            self._sweep()

    def _sweep(self) -> None:
        for h in list(self._refs):
            live = [(e, p) for e, p in self._refs[h] if self._alive(e)]
            if live:
                self._refs[h] = live
            else:
                del self._refs[h]
        self._size = sum(map(len, self._refs.values()))
        self._swept_size = self._size

    def match(
        self,
        token_ids: Sequence[int],
        found: list[tuple[int, int]],
        min_tokens: int,
        start: int = 0,
        fit: Callable[[Run], Run | None] | None = None,
    ) -> list[Run]:
        """Non-overlapping runs of `token_ids` from `start` on found in entries, left to right,
        each the best verified extension of an anchor's candidates of at least `min_tokens`
        (aligned with its entry's start first, then the longest; an aligned one may take back the
        previous run's tail); `found` are the prompt's anchors. `fit` keeps a part of each
        candidate (None: none of it)."""
        runs: list[Run] = []
        covered = start
        for pos, h in found:
            if pos < covered:
                continue
            # An aligned run may take back the tail of the previous run (the blank line between
            # two documents that both runs' entries hold), down to min_tokens of it.
            floor = runs[-1].start + min_tokens if runs else start
            best: Run | None = None
            for entry, off in self._live_refs(h):
                run = _extend(token_ids, pos, entry, off, floor, covered)
                if run is not None and fit is not None:
                    run = fit(run)
                # An aligned run (from its entry's start) is KV computed right after that entry's
                # S, as a separator chunk's is: preferred to a longer slice from inside another
                # entry, whose KV carries the context it was learned in.
                if run is not None and run.length >= min_tokens and _better(run, best):
                    best = run
            if best is not None:
                if best.start < covered:
                    last = runs[-1]
                    runs[-1] = Run(last.start, best.start - last.start, last.entry, last.entry_start)
                runs.append(best)
                covered = best.end
        return runs

    def _live_refs(self, h: int) -> list[tuple[Entry, int]]:
        """The references of anchor hash `h` whose entries are alive; dead ones are dropped."""
        refs = self._refs.get(h)
        if not refs:
            return []
        live = [(entry, off) for entry, off in refs if self._alive(entry)]
        if len(live) < len(refs):
            self._size -= len(refs) - len(live)
            if live:
                self._refs[h] = live
            else:
                del self._refs[h]
        return live

    def check_integrity(self) -> None:
        assert self._size == sum(map(len, self._refs.values())), "span index size drifted"
        for h, refs in self._refs.items():
            assert 0 < len(refs) <= _MAX_CANDIDATES
            for entry, pos in refs:
                if self._alive(entry):
                    assert window_hashes(entry.token_ids[-1][pos : pos + WINDOW]) == [h]


def _better(run: Run, best: Run | None) -> bool:
    return best is None or (run.aligned, run.length) > (best.aligned, best.length)


def _extend(
    token_ids: Sequence[int], pos: int, entry: Entry, off: int, floor: int, covered: int
) -> Run | None:
    """The run of `token_ids` around anchor `pos` equal to `entry`'s tokens around `off`, extended
    left (not below `floor`, nor below `covered` unless aligned with the entry's start) and right;
    None on a hash collision."""
    tokens = entry.token_ids[-1]
    if tuple(token_ids[pos : pos + WINDOW]) != tuple(tokens[off : off + WINDOW]):
        return None  # a hash collision
    left = 0
    while pos - left > floor and off - left > 0 and token_ids[pos - left - 1] == tokens[off - left - 1]:
        left += 1
    if off - left > ALIGN_SLACK:
        left = min(left, pos - covered)  # not aligned: it takes nothing back
    right = WINDOW
    n = len(token_ids)
    while pos + right < n and off + right < len(tokens) and token_ids[pos + right] == tokens[off + right]:
        right += 1
    return Run(pos - left, left + right, entry, off - left)


def plan(
    token_ids: Sequence[int],
    index: SpanIndex,
    min_tokens: int,
    max_chunks: int,
    system_end: Callable[[int, int], int] | None = None,
) -> Plan | None:
    """How to cut a plain prompt into S, chunks and Q; None when it has no room for a chunk.

    S is the prompt up to its first anchor, extended over a first run that continues that very S
    in its entry (the prompt's prefix is then exactly the entry's: the instructions before the
    documents, in practice), so that documents are computed after the same S as in a separator
    prompt; `system_end(lo, hi)` picks where S ends in (lo, hi] (a known S), by default at hi."""
    n = len(token_ids)
    found = anchors(token_ids)
    if not found:
        return None
    runs = index.match(token_ids, found, min_tokens)
    # Each run can add a gap before it: keep the chunk count within max_chunks.
    runs = runs[: max(0, (max_chunks - 1) // 2)]
    sys_end = max(1, min([found[0][0], *(r.start for r in runs[:1])]))
    if runs and runs[0].entry_start == 0 and runs[0].start == sys_end:
        first = runs[0]
        if first.entry.token_ids[0] == tuple(token_ids[:sys_end]):
            sys_end = first.end if system_end is None else system_end(sys_end, first.end)
    q_start = min(n - 1, max([found[-1][0] + WINDOW, *(r.end for r in runs[-1:])]))
    if q_start <= sys_end:
        return None
    parts: list[tuple[int, int, Run | None]] = []
    at = sys_end
    for run in runs:
        start, end = max(run.start, sys_end), min(run.end, q_start)
        if end - start < min_tokens:
            continue
        trimmed = Run(start, end - start, run.entry, run.entry_start + start - run.start)
        if start > at:
            parts.append((at, start, None))
        parts.append((start, end, trimmed))
        at = end
    if at < q_start:
        parts.append((at, q_start, None))
    return Plan(sys_end, tuple(parts), q_start)


@dataclass(frozen=True)
class FusionDocuments:
    """A cut plain prompt as layout "fusion"'s documents: `plan`'s parts are the documents, each an
    exact run (borrowed: S + the run is a prefill's KV) or None (computed right after S)."""

    plan: Plan
    # Per document: whether it was found in the pool (matched), exact or not.
    matched: tuple[bool, ...]
    # Tokens between documents that no stream holds (glue, as a separator prompt's separators).
    dropped: int


# A plan's part: (start, end, the run it borrows or None), as in `Plan.parts`.
_Part = tuple[int, int, Run | None]


def fusion_documents(
    token_ids: Sequence[int], cut: Plan, index: SpanIndex, min_tokens: int
) -> FusionDocuments | None:
    """`cut`'s span as fusion documents; None when fewer than two were matched (one stream or
    none would hold what the cache knows: a plain prefill serves the prompt as well).

    Every stream is S + Ci + Q and must be exactly a prefill of those tokens, so a document is
    borrowed only where its KV was computed right after this very S (`Run.after`): the span is
    matched again on `index` keeping only such runs, and what they leave is cut where `cut`'s
    parts end. A piece matched in `cut` but not exact (a slice from inside a learned span, KV
    computed after other documents) is computed after S as its own entry, keyed as a separator
    chunk (the canonical entry: found exact next time), never re-read from another context. A gap
    before the first document shorter than `min_tokens` joins S (the instructions' tail); the gap
    after the last one joins Q (the question's head, or a new document every stream then reads);
    an unmatched piece between documents shorter than `min_tokens` is glue (a blank line, a token
    tokenized apart at an edge: dropped, as a separator prompt's separators are), a longer one is
    a new document, computed after S and cached."""
    parts, sys_end, q_start = _fusion_edges(cut, min_tokens)
    exact = _runs_after_s(token_ids, index, sys_end, q_start, min_tokens)
    docs, matched, dropped = _fusion_pieces(parts, exact, sys_end, q_start, min_tokens)
    if sum(matched) < 2:
        return None
    return FusionDocuments(Plan(sys_end, tuple(docs), q_start), tuple(matched), dropped)


def _fusion_edges(cut: Plan, min_tokens: int) -> tuple[list[_Part], int, int]:
    """`cut`'s parts, S's end and Q's start, with the unmatched gap before the first document
    joined to S where shorter than `min_tokens` (the instructions' tail) and the one after the
    last joined to Q (the question's head)."""
    parts = list(cut.parts)
    sys_end, q_start = cut.sys_end, cut.q_start
    if parts and parts[0][2] is None and parts[0][1] - parts[0][0] < min_tokens:
        sys_end = parts.pop(0)[1]
    if parts and parts[-1][2] is None:
        q_start = parts.pop()[0]
    return parts, sys_end, q_start


def _runs_after_s(
    token_ids: Sequence[int], index: SpanIndex, sys_end: int, q_start: int, min_tokens: int
) -> list[Run]:
    """The span [sys_end, q_start) matched again on `index`, keeping only runs whose KV was
    computed right after this very S (`Run.after`), cut at Q and at least `min_tokens` long:
    the runs a stream S + Ci + Q may borrow exactly."""
    sys_ids = tuple(token_ids[:sys_end])
    found = [(p, h) for p, h in anchors(token_ids[:q_start]) if p >= sys_end]
    return [
        Run(r.start, min(r.end, q_start) - r.start, r.entry, r.entry_start)
        for r in index.match(token_ids, found, min_tokens, sys_end, lambda r: r.after(sys_ids))
        if min(r.end, q_start) - r.start >= min_tokens
    ]


def _fusion_pieces(
    parts: list[_Part], exact: list[Run], sys_end: int, q_start: int, min_tokens: int
) -> tuple[list[_Part], list[bool], int]:
    """The span cut at the exact runs' edges and at `parts`' ends not inside a run: the documents
    (an exact run, or None: computed after S), whether each was found in the pool (matched in
    `parts`, exact or not), and how many tokens of glue (unmatched, shorter than `min_tokens`)
    were dropped between them."""
    docs: list[_Part] = []
    matched: list[bool] = []
    dropped, at = 0, sys_end
    for end in (e for e in _piece_ends(parts, exact) if sys_end < e <= q_start):
        run = next((r for r in exact if r.start == at), None)
        known = run is not None or any(r is not None and a <= at < b for a, b, r in parts)
        if run is None and end - at < min_tokens:
            dropped += end - at  # glue
        else:
            docs.append((at, end, run))
            matched.append(known)
        at = end
    return docs, matched, dropped


def _piece_ends(parts: list[_Part], exact: list[Run]) -> list[int]:
    """Where the span is cut, in order: every exact run's start and end, and each of `parts`'
    ends that falls outside the runs (a run is never split)."""
    cuts = {b for _, b, _ in parts if not any(r.start < b < r.end for r in exact)}
    return sorted(cuts | {r.start for r in exact} | {r.end for r in exact})
