"""A request's chunk plan, by stage: what intake decided, what admission pinned, what a fill
job computes. Each is a field of its own on the sequence (`chunk_plan`, `chunks`, `fill`), so
that no field changes type over a request's life and nothing dispatches on a plan's class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chunkcache.chunk.matcher import PlainPrompt
from chunkcache.chunk.parse import ChunkedPrompt
from chunkcache.chunk.pool import Entry
from chunkcache.config import ChunkConfig


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
