"""Attention over a slot-addressed KV cache, driven by one explicit per-step metadata object.

A sequence's KV is a list of slots in the layer's cache tensor: the borrowed slots (a chunk-cache
entry, a system part) followed by the sequence's own slots (paged blocks). The tokens computed in
a step are always the last entries of that list, and each sees every entry up to itself: causal
over the list. Positions are explicit per token, so the same kernel serves a plain prompt, a
chunk computed after its system part, and a question attending to assembled chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chunkcache.model.calibration import ContextCalibration, calibrated_attention


@dataclass
class PrefillSegment:
    """One sequence with several new tokens in this step."""

    start: int  # first of its tokens in the flattened batch
    end: int
    # Slots of the KV list entries before this step's tokens; None when there are none.
    past_slots: torch.Tensor | None
    # [n, past + n] query i (list index past + i) sees entries 0..past + i; None = plain causal.
    mask: torch.Tensor | None = None
    calibration: ContextCalibration | None = None

    @classmethod
    def make(
        cls,
        start: int,
        end: int,
        past_slots: torch.Tensor | None,
        calibration: ContextCalibration | None = None,
    ) -> PrefillSegment:
        if past_slots is None or past_slots.numel() == 0:
            return cls(start, end, None, None)
        n, past = end - start, past_slots.numel()
        device = past_slots.device
        mask = (
            torch.arange(past + n, device=device)[None, :] <= (torch.arange(n, device=device) + past)[:, None]
        )
        return cls(start, end, past_slots, mask, calibration)


@dataclass
class DecodeBatch:
    """Sequences with exactly one new token each, attended in one padded call."""

    token_index: torch.Tensor  # [B] index of each sequence's token in the flattened batch
    slots: torch.Tensor  # [B, L] the whole KV list including the new token, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, L] True where a slot is real
    # (row, token index, KV-list length, calibration) of the sequences whose chunks are
    # calibrated; plain ints, so that no device tensor is read back per layer.
    calibrated: list[tuple[int, int, int, ContextCalibration]] = field(default_factory=list)
    # (first slot, length) when the batch is one sequence whose KV list is one run of slots: the
    # cache is then read in place, with no gather (two copies of the whole KV list per layer).
    span: tuple[int, int] | None = None


@dataclass
class AttentionMetadata:
    """Everything the model needs to know about one step besides token ids and positions."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    prefills: list[PrefillSegment]
    decode: DecodeBatch | None


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hk, D] of this step's tokens; returns [T, Hq, D].

    New K/V are written to the cache first, so a sequence computed in the same step as the
    system part it borrows already sees that part.
    """
    k_cache[meta.slot_mapping] = k
    v_cache[meta.slot_mapping] = v
    out = torch.empty_like(q)
    num_kv_heads = k.shape[1]
    for seg in meta.prefills:
        qs, ks, vs = q[seg.start : seg.end], k[seg.start : seg.end], v[seg.start : seg.end]
        if seg.past_slots is not None:
            # index_select, not k_cache[slots]: the advanced-indexing gather is ~5x slower on CPU.
            ks = torch.cat((k_cache.index_select(0, seg.past_slots), ks))
            vs = torch.cat((v_cache.index_select(0, seg.past_slots), vs))
        if seg.calibration is not None and seg.past_slots is not None:
            past = seg.past_slots.numel()
            index = torch.arange(past, past + seg.end - seg.start, device=q.device)
            out[seg.start : seg.end] = calibrated_attention(qs, ks, vs, index, seg.calibration, scale)
            continue
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1).unsqueeze(0),
            ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0),
            attn_mask=seg.mask,
            is_causal=seg.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[seg.start : seg.end] = o[0].transpose(0, 1)
    if meta.decode is not None:
        d = meta.decode
        b = d.token_index.numel()
        group = q.shape[1] // num_kv_heads
        # One query per sequence: fold the query heads of a KV head into the query axis (GQA
        # without repeating K/V), which is several times faster than enable_gqa on CPU.
        qd = q[d.token_index].view(b, num_kv_heads, group, -1)
        if d.span is not None:
            first, length = d.span
            kd = k_cache[first : first + length].unsqueeze(0).permute(0, 2, 1, 3)
            vd = v_cache[first : first + length].unsqueeze(0).permute(0, 2, 1, 3)
            mask = None
        else:
            # index_select over the flattened slots, not k_cache[d.slots]: the advanced-indexing
            # gather was ~5x slower on CPU and 7% of a 16-sequence decode step.
            flat = d.slots.flatten()
            kd = k_cache.index_select(0, flat).view(*d.slots.shape, *k_cache.shape[1:]).permute(0, 2, 1, 3)
            vd = v_cache.index_select(0, flat).view(*d.slots.shape, *v_cache.shape[1:]).permute(0, 2, 1, 3)
            mask = d.mask
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
        out[d.token_index] = o.reshape(b, q.shape[1], -1)
        for row, i, length, cal in d.calibrated:
            index = torch.tensor([length - 1], device=q.device)
            out[i : i + 1] = calibrated_attention(
                q[i : i + 1],
                kd[row, :, :length].transpose(0, 1),
                vd[row, :, :length].transpose(0, 1),
                index,
                cal,
                scale,
            )
    return out


def _sdpa_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, L, D], k/v [B, Hk, S, D] (GQA allowed) -> output [B, Hq, L, D] and the
    log-sum-exp of each row's scaled logits [B, Hq, L] in float32; `causal` is top-left aligned.

    The log-sum-exp lets two attentions of the same rows over disjoint key sets be merged exactly.
    Public SDPA does not return it; on CPU its own flash kernel does (CPU tensors only).
    """
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float()


def _masked_rows_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, scale: float
) -> torch.Tensor:
    """`attend_rows` as one SDPA call with the causal mask over [rows x keys]."""
    mask = torch.arange(k.shape[0], device=q.device)[None, :] <= rows[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


# What one more kernel call costs on CPU, in (query head x key) pairs of attention: the flash
# kernel takes ~0.3 ms a call on small inputs (its setup) and ~4 ns a pair (1 thread, measured
# with the Qwen2.5-0.5B and the bench_serve shapes).
CALL_COST_PAIRS = 75_000


def _segments(rows: list[int], first: int, last: int, span: int) -> list[tuple[int, int, int, int]]:
    """rows[first:last] cut greedily into (first entry, one past the last entry, first row, one
    past the last row): runs of consecutive entries joined while the entries they cover stay
    within `span`; a longer run is a segment of its own."""
    segments: list[tuple[int, int, int, int]] = []
    i = first
    while i < last:
        j = i + 1
        while j < last and rows[j] == rows[j - 1] + 1:
            j += 1
        if segments and rows[j - 1] + 1 - segments[-1][0] <= span:
            segments[-1] = (segments[-1][0], rows[j - 1] + 1, segments[-1][2], j)
        else:
            segments.append((rows[i], rows[j - 1] + 1, i, j))
        i = j
    return segments


def attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    block: int = 512,
    tile: int = 64,
    call_cost: int = CALL_COST_PAIRS,
) -> torch.Tensor:
    """Causal attention of some rows of a KV list: query i is list entry rows[i] and sees entries
    0..rows[i]. q [R, Hq, D], k/v [T, Hk, D], rows ascending; returns [R, Hq, D].

    No mask over [rows x keys]: the CPU kernel would compute every masked key block, and when the
    rows are a scattered share of the list most of them are masked. Instead each row's keys
    0..r are split into parts that need no mask, each attended on its own and merged exactly by
    their log-sum-exp. The rows are cut into segments (a contiguous run, or rows spread over at
    most `block` entries) starting at entry c: a segment's rows see entries 0..c-1 whole. A
    contiguous run then sees its own span by a square causal attention. A spread segment is cut
    again the same way into tiles of at most `tile` entries starting at f: the tile's rows see
    entries c..f-1 whole, and the tile's span by a square causal attention in which the span's
    other entries get zero queries (tiles padded to `tile` and batched). Few large calls for most
    of the keys, and little work wasted on the zero queries.

    A single run from near the head of the list is one causal attention of the whole list with
    zero queries before the run. Where the calls would cost more than the masked pairs they save
    (`call_cost` pairs a call: a short list, or few rows), and off CPU (no kernel returns the lse),
    one masked call does it.
    """
    device, n = q.device, rows.numel()
    r = rows.tolist()
    if r[-1] - r[0] + 1 == n and 8 * r[0] <= n:
        # One contiguous run starting near the head of the list (layer 0, ratio 1: every token
        # after S): zero queries for the entries before it make a plain causal attention of the
        # whole list, no merge; the zero rows cost r[0]**2 / 2 pairs, at most 1/64 of the run's.
        padded_q = q.new_zeros((r[-1] + 1, *q.shape[1:]))
        padded_q[r[0] :] = q
        o = F.scaled_dot_product_attention(
            padded_q.transpose(0, 1).unsqueeze(0),
            k[: r[-1] + 1].transpose(0, 1).unsqueeze(0),
            v[: r[-1] + 1].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return o[0, :, r[0] :].transpose(0, 1)
    whole: list[tuple[int, int, int, int, int]] = []  # (part, first row, last row, first key, last key)
    own: list[tuple[int, int, int, int]] = []  # contiguous runs: (first key, last key, first row, last row)
    padded: list[tuple[int, int, int]] = []  # tiles: (first entry, first row, last row)
    for start, end, first, last in _segments(r, 0, n, block):
        if start > 0:
            whole.append((0, first, last, 0, start))
        if end - start == last - first:
            own.append((start, end, first, last))
            continue
        for t_start, t_end, t_first, t_last in _segments(r, first, last, tile):
            if t_start > start:
                whole.append((1, t_first, t_last, start, t_start))
            if t_end - t_start > tile:  # a run longer than a tile
                own.append((t_start, t_end, t_first, t_last))
            else:
                padded.append((t_start, t_first, t_last))
    calls = len(whole) + len(own) + (1 if padded else 0)
    masked_in_vain = (n * k.shape[0] - sum(r) - n) * q.shape[1]
    if q.device.type != "cpu" or masked_in_vain < call_cost * calls:
        return _masked_rows_attention(q, k, v, rows, scale)
    # One plane per part: the entries before the segment (0), before the tile (1), its own span
    # (last); without tiles (all rows contiguous, as at ratio 1) there is no middle plane.
    planes = 3 if any(job[0] == 1 for job in whole) else 2
    own_plane = planes - 1
    outs = torch.zeros((planes, *q.shape), dtype=torch.float32, device=device)
    lses = torch.full((planes, *q.shape[:2]), float("-inf"), device=device)
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, R, D]
    kt, vt = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    for part, first, last, k0, k1 in whole:
        o, lse = _sdpa_with_lse(qt[:, :, first:last], kt[:, :, k0:k1], vt[:, :, k0:k1], False, scale)
        outs[part, first:last], lses[part, first:last] = o[0].transpose(0, 1), lse[0].transpose(0, 1)
    for k0, k1, first, last in own:
        o, lse = _sdpa_with_lse(qt[:, :, first:last], kt[:, :, k0:k1], vt[:, :, k0:k1], True, scale)
        outs[own_plane, first:last], lses[own_plane, first:last] = (
            o[0].transpose(0, 1),
            lse[0].transpose(0, 1),
        )
    if padded:
        starts = torch.tensor([p[0] for p in padded], device=device)
        # Entries past the end of the list are clamped to its last one: only zero queries see them.
        keys = (starts[:, None] + torch.arange(tile, device=device)).clamp_(max=k.shape[0] - 1)
        tile_of = torch.cat([torch.full((p[2] - p[1],), m, device=device) for m, p in enumerate(padded)])
        index = torch.cat([torch.arange(p[1], p[2], device=device) for p in padded])
        offset = rows[index] - starts[tile_of]
        qb = q.new_zeros((len(padded), q.shape[1], tile, q.shape[2]))
        qb[tile_of, :, offset] = q[index]
        o, lse = _sdpa_with_lse(qb, k[keys].transpose(1, 2), v[keys].transpose(1, 2), True, scale)
        outs[own_plane, index], lses[own_plane, index] = (
            o[tile_of, :, offset].float(),
            lse[tile_of, :, offset],
        )
    # Softmax over the union of the parts: each part weighted by its share of the total exp-sum.
    weights = torch.softmax(lses, dim=0)[..., None]
    return outs.mul_(weights).sum(dim=0).to(q.dtype)
