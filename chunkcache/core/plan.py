"""A request's chunk plan and what it is made of: the parts a prompt is cut into (S, chunks, Q),
the pool entries that hold their KV, and the plan by stage. Each stage is a field of its own on
the sequence (`chunk_plan`, `chunks`, `fill`), so that no field changes type over a request's life
and nothing dispatches on a plan's class. Below chunk/ and engine/, which both read these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chunkcache.config import ChunkConfig

if TYPE_CHECKING:
    # For annotations only: the router parses prompts (chunk/parse.py, these types) without torch.
    import torch


@dataclass(frozen=True)
class ChunkedPrompt:
    """A prompt as S, chunks and Q, each tokenized alone (chunk/parse.py, chunk/documents.py, or a
    separator-free cut, chunk/manager.py)."""

    sys_token_ids: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    question_token_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.sys_token_ids) + sum(map(len, self.chunks)) + len(self.question_token_ids)

    def all_token_ids(self) -> list[int]:
        """S, the chunks and Q concatenated: the request's prompt as reported to the user."""
        out = list(self.sys_token_ids)
        for chunk in self.chunks:
            out.extend(chunk)
        out.extend(self.question_token_ids)
        return out

    def question_position(self) -> int:
        """Layout "isolated": every chunk shares [s, s + len), so Q starts after the longest."""
        return len(self.sys_token_ids) + max(map(len, self.chunks))


@dataclass(frozen=True)
class PlainPrompt:
    """A plain prompt waiting for admission, where it is searched for cached chunks."""

    token_ids: tuple[int, ...]
    # The request's own max_tokens (None: open, capped where the prompt runs: as one plain
    # prefill, or, under layout "fusion", as several streams sharing the KV cache).
    max_tokens: int | None = None


@dataclass
class Entry:
    """One chunk-cache entry (a system part or a chunk after its S): its KV's pages in the pool
    (chunk/pool.py), or in paged KV blocks for a private one."""

    key: bytes
    kind: str  # "system" | "chunk"
    token_ids: tuple[tuple[int, ...], ...]  # what the key was computed from, compared on every hit
    num_tokens: int
    pages: list[int] = field(default_factory=list)
    pins: int = 0
    ready: bool = False
    private: bool = False  # computed for one request in paged KV blocks, never shared
    loading: bool = False  # being read from a lower tier (chunkcache/chunk/tiers/loader.py)
    from_tier: bool = False  # its KV was loaded from a lower tier, not computed here
    # A request waits for it (not only prewarms): its fill job is not background work.
    urgent: bool = False
    # [num_tokens] float32 on the CPU, a chunk's sensitivity (engine/sensitivity.py): measured the
    # first time a request ranks by it, then kept (and written down to the tiers) with the KV.
    sensitivity: torch.Tensor | None = None


@dataclass(frozen=True)
class ChunkPlan:
    """Intake's decision for a prompt the chunk cache serves: its parts (S, chunks, Q), or a plain
    prompt that separator-free matching cuts at admission, where the pool is known; and the
    chunk options it runs with (the engine's, or the request's own ReuseOptions merged in)."""

    prompt: ChunkedPrompt | PlainPrompt
    config: ChunkConfig


@dataclass
class RequestChunks:
    """What a question sequence holds: its entries (S first) and its layout."""

    prompt: ChunkedPrompt
    entries: list[Entry] = field(default_factory=list)
    # Per entry: (start, length) of the part of its own tokens this request uses (a separator-free
    # match borrows a slice of an entry; everything else uses all of it).
    slices: list[tuple[int, int]] = field(default_factory=list)
    assembled: bool = False
    # Layout "offset": where the cached KV of S and the chunks is, and how far to re-rotate it.
    cached_slots: torch.Tensor | None = None
    cached_delta: torch.Tensor | None = None
    # Layout "fusion": per stream, its borrowed KV list (S and its chunk; S alone for the
    # no-document stream), in the request's stream order (engine/fusion.py).
    stream_slots: list[torch.Tensor] | None = None
    # Per entry: whether it was already computed when the request arrived, or loaded from a
    # lower tier (a cache hit), so that tokens computed for this very request are never reported
    # as cached. None while its load is pending; settled in `settle_cached`.
    was_cached: list[bool | None] = field(default_factory=list)


@dataclass
class FillJob:
    """The entry a fill job computes into its pages."""

    entry: Entry
    sys_entry: Entry | None  # the S entry a chunk job borrows (pinned by the job)
    # A canonical entry's job pins its entry itself (no request does) until it ends.
    holds_entry: bool = False
