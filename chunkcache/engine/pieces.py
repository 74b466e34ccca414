"""How much of its work a unit of the scheduler does in one step (engine/scheduler.py).

A unit is what is scheduled together: a sequence, or a fusion request's streams (engine/fusion.py),
which are admitted, given tokens and preempted as one so that they stay in step. A step gives a
unit at most one piece's worth of tokens (`long_prefill_token_threshold`) within the budget left;
a fusion unit's members together, so that a group of many streams holds the others no longer than
one long prompt's piece does. A blend prefill (engine/blend.py's `BlendRun`) is sized by its
layers: a layer that R tokens run through costs about R / num_layers of a token's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkcache.core.sequence import Sequence


@dataclass(frozen=True)
class Piece:
    """What a unit does in a step: per member, the own tokens it computes (blocks are grown for
    them), and what that takes of the budget. A blend's piece that does not reach its last layer
    runs its layers up to `layers` only: it holds blocks for every token from its first piece on,
    and its tokens count as computed in the piece that runs its last layer."""

    counts: list[int]
    cost: int
    layers: int | None = None


def unit_of(seq: Sequence) -> list[Sequence]:
    """What is scheduled together with `seq`: a fusion request's streams (engine/fusion.py) are
    admitted, given tokens and preempted as one, so that they stay in step; else `seq` alone."""
    return seq.fusion.streams if seq.fusion is not None else [seq]


def units(seqs: list[Sequence]) -> list[list[Sequence]]:
    """`seqs` grouped into units, in order of each unit's first member."""
    seen: set[int] = set()
    grouped = []
    for seq in seqs:
        if id(seq) not in seen:
            unit = unit_of(seq)
            seen.update(map(id, unit))
            grouped.append(unit)
    return grouped


# A prefill's last piece of at most `threshold // TAIL_SHARE` tokens joins the one before (`piece_for`).
TAIL_SHARE = 8


def remaining(seq: Sequence) -> int:
    return seq.num_tokens - seq.num_computed


def unit_remaining(seq: Sequence) -> int:
    """Tokens `seq`'s unit has left to compute (a fusion request's streams together)."""
    return sum(map(remaining, unit_of(seq)))


def piece_for(
    unit: list[Sequence], budget: int, threshold: int, num_layers: int, long_running: bool
) -> Piece:
    """The unit's piece in this step: what is left, within one piece's worth of tokens
    (`long_prefill_token_threshold`, together) and the budget left. A fusion pair stream has a
    document to compute before its Q (engine/fusion.py): the others get 0 until their Q ends
    in the same step as its, so that every stream yields its first logits in one step."""
    # A blend prefill: a layout-offset request, or a fusion unit's blended joint stream
    # (engine/fusion.py), whose other streams then wait with nothing left to compute.
    blending = [m for m in unit if m.blend is not None and m.num_computed == 0]
    if blending:
        piece = _blend_piece(blending[0], budget, threshold, num_layers, long_running)
        return Piece([piece.counts[0] if m is blending[0] else 0 for m in unit], piece.cost, piece.layers)
    left = [remaining(m) for m in unit]
    most = max(left)

    def counts(lead: int) -> list[int]:  # the longest member's count is `lead`
        return [max(0, lead - (most - r)) for r in left]

    # At least a token to each of the longest members, so that a unit of more members than a
    # piece has tokens still moves. A tail of at most `threshold // TAIL_SHARE` joins the piece
    # before it: a step has costs of its own whatever its tokens (native weights dequantize every
    # weight per prefill step, ~0.45 s on the 1.5B), and a fusion pair stream's document and
    # question (250 + 16 tokens) took 256 and 10 in two steps, 1.7 s and 0.9 s.
    piece = threshold if sum(left) > threshold + threshold // TAIL_SHARE else sum(left)
    room = min(budget, max(piece, sum(counts(1))))
    lo, hi = 0, most
    while lo < hi:  # the largest lead whose total fits the room
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(counts(mid)) <= room else (lo, mid - 1)
    tokens = counts(lo)
    return Piece(tokens, sum(tokens))


def _blend_piece(seq: Sequence, budget: int, threshold: int, num_layers: int, long_running: bool) -> Piece:
    """A blend prefill's next layers: as many as one piece's worth of tokens (and the budget
    left) holds, a layer of R running tokens costing R / num_layers (before its first layer
    every token counts as running). At least one layer where no other long prefill runs in
    this step, so that a layer larger than a piece still runs (and a blend never waits behind
    long prefills for ever)."""
    assert seq.blend is not None
    run = seq.blend.run
    done, rows = (run.next_layer, run.rows) if run is not None else (0, remaining(seq))
    left, rows = num_layers - done, max(rows, 1)
    room = min(budget, threshold)
    layers = min(left, room * num_layers // rows)
    if layers == 0 and not long_running and budget > 0:
        layers = 1
    if layers == 0:
        return Piece([0], 0)
    cost = -(-layers * rows // num_layers)
    return Piece([remaining(seq)], cost, None if layers == left else done + layers)
