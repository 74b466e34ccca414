"""Attention over a slot-addressed KV cache, driven by one explicit per-step metadata object.

A sequence's KV is a list of slots in the layer's cache tensor: the borrowed slots (a chunk-cache
entry, a system part) followed by the sequence's own slots (paged blocks). The tokens computed in
a step are always the last entries of that list, and each sees every entry up to itself: causal
over the list. Positions are explicit per token, so the same kernel serves a plain prompt, a
chunk computed after its system part, and a question attending to assembled chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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


def compiled_decode_meta(input_ids: torch.Tensor, meta: AttentionMetadata) -> AttentionMetadata | None:
    """The metadata a compiled decode step runs with, or None where the step is not of the one
    shape compiled (`LlamaForCausalLM.compile_decode`): one sequence decoding one token, no
    prefill beside it, no calibrated chunks. Its KV is always gathered (no `span`), so that one
    graph serves consecutive and scattered blocks alike."""
    d = meta.decode
    if input_ids.shape[0] != 1 or meta.prefills or d is None or d.calibrated:
        return None
    return meta if d.span is None else replace(meta, decode=replace(d, span=None))


def _decode_kv(
    d: DecodeBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The decode sequences' K and V [b, Hk, L, D] (a view of the cache where their slots are one
    span) and the mask of their padding (None for one sequence: every entry is real)."""
    if d.span is not None:
        first, length = d.span
        kd = k_cache[first : first + length].unsqueeze(0).permute(0, 2, 1, 3)
        vd = v_cache[first : first + length].unsqueeze(0).permute(0, 2, 1, 3)
        return kd, vd, None
    # index_select over the flattened slots, not k_cache[d.slots]: the advanced-indexing gather
    # was ~5x slower on CPU and 7% of a 16-sequence decode step.
    flat = d.slots.flatten()
    kd = k_cache.index_select(0, flat).view(*d.slots.shape, *k_cache.shape[1:]).permute(0, 2, 1, 3)
    vd = v_cache.index_select(0, flat).view(*d.slots.shape, *v_cache.shape[1:]).permute(0, 2, 1, 3)
    return kd, vd, d.mask if d.slots.shape[0] > 1 else None


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
    num_kv_heads = k.shape[1]
    d = meta.decode
    if d is not None and q.shape[0] == 1 and not meta.prefills and not d.calibrated:
        # A batch-1 decode step: its one query's attention is the output (no scatter into an
        # empty one: 3 fewer operators a layer, ~90 a SmolLM2 token).
        kd, vd, _ = _decode_kv(d, k_cache, v_cache)
        o = F.scaled_dot_product_attention(
            q.view(1, num_kv_heads, q.shape[1] // num_kv_heads, -1), kd, vd, scale=scale
        )
        return o.reshape(1, q.shape[1], -1)
    out = torch.empty_like(q)
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
        # One query per sequence: fold the query heads of a KV head into the query axis (GQA
        # without repeating K/V), which is several times faster than enable_gqa on CPU.
        qd = q[d.token_index].view(b, num_kv_heads, q.shape[1] // num_kv_heads, -1)
        kd, vd, mask = _decode_kv(d, k_cache, v_cache)
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
