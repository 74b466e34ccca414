"""Blend's attention: causal attention of some rows of a KV list, without a mask over all keys.

Query i is list entry rows[i] and sees entries 0..rows[i]. Blend recomputes a scattered share of
a prompt's tokens, so a mask over [rows x keys] would be mostly False, and the CPU kernel
computes every masked key block. Instead the rows are cut into blocks, and each block's keys
into two parts, attended on their own and merged exactly by their log-sum-exp:
- the entries before the block's first row, which every row of the block sees whole: one
  unmasked call, with the query heads of a KV head folded into extra query rows (bigger GEMMs,
  each KV head read once);
- the block's own span, first to last row: a causal call for consecutive rows, else a call
  masked per row (small, as blocks of spread rows are kept short).

The rows stay the same from one layer to the next (they change only at a check layer), so the
cut, the masks and the choice of path are a `RowPlan`, made once and used by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# What one more part costs on CPU beyond its own work, in (row x key) pairs of one query head:
# the kernel call (~20 us on small inputs) and the Python and copies around it, ~50-80 us in all
# at ~4 ns a pair (1 thread, Qwen2.5-0.5B shapes).
CALL_COST_PAIRS = 1_000
# A masked pair costs ~1.15 unmasked ones (the kernel adds the mask; measured 4.4 vs 3.9 ns).
MASKED_PAIR_COST = 1.15
# Blocks of spread rows are closed once rows x span would exceed this (the span is masked, so
# that product is computed); joined while below it, so that each call has rows enough for the
# kernel's GEMMs. 1k-16k measured within 3% of each other on bench_blend's rows; 4k the best.
MAX_TAIL_PAIRS = 4096
# A run of at least this many consecutive entries is a block of its own, however long.
MIN_RUN = 32


@dataclass(frozen=True)
class RowBlock:
    first_row: int  # rows[first_row:last_row] are the block's
    last_row: int
    first: int  # its span of entries: rows[first_row] .. rows[last_row - 1]
    end: int
    # [1, 1, group * rows, span] additive mask of a spread block, in the folded row order; None
    # for consecutive rows (a causal call).
    mask: torch.Tensor | None


@dataclass(frozen=True)
class RowPlan:
    """How `attend_rows` computes one set of rows; see `plan_rows`."""

    rows: torch.Tensor  # [R] ascending list entries
    # "head": one causal call over entries 0..rows[-1], zero queries before rows[0];
    # "masked": one call with the causal mask over [rows x entries 0..rows[-1]];
    # "blocks": the mask-free plan.
    kind: str
    blocks: tuple[RowBlock, ...] = ()
    mask: torch.Tensor | None = None  # "masked": [R, rows[-1] + 1] bool


def _row_blocks(rows: list[int], max_tail: int, min_run: int) -> list[tuple[int, int, bool]]:
    """Ascending rows cut into blocks (first row, one past the last row, consecutive entries). A
    run of at least `min_run` consecutive entries is a block of its own, however long (its span
    is a causal attention); other rows are joined greedily while the block's rows x span stays
    within `max_tail` (its span is a masked attention, so that product is what it computes)."""
    n = len(rows)
    runs: list[tuple[int, int]] = []  # maximal runs of consecutive entries
    i = 0
    while i < n:
        j = i + 1
        while j < n and rows[j] == rows[j - 1] + 1:
            j += 1
        runs.append((i, j))
        i = j
    blocks: list[tuple[int, int]] = []
    open_first = -1  # first row of the spread block being filled, -1 if none
    for i, j in runs:
        if j - i >= min_run:
            if open_first >= 0:
                blocks.append((open_first, i))
                open_first = -1
            blocks.append((i, j))
            continue
        for m in range(i, j):
            if open_first >= 0 and (m + 1 - open_first) * (rows[m] + 1 - rows[open_first]) > max_tail:
                blocks.append((open_first, m))
                open_first = -1
            if open_first < 0:
                open_first = m
    if open_first >= 0:
        blocks.append((open_first, n))
    return [(a, b, rows[b - 1] - rows[a] + 1 == b - a) for a, b in blocks]


def plan_rows(
    rows: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    max_tail: int = MAX_TAIL_PAIRS,
    min_run: int = MIN_RUN,
    call_cost: int = CALL_COST_PAIRS,
) -> RowPlan:
    """The plan for query rows `rows` (ascending entries of the KV list), for queries of
    `num_heads` heads over `num_kv_heads` KV heads in `dtype`.

    A single run from near the head of the list (layer 0, or ratio 1: every token after S) is one
    causal call of the whole list with zero queries before the run. Where the block calls would
    cost more than the masked pairs they save (`call_cost` pairs a call: a short list, or few
    rows), and off CPU (no kernel there returns the log-sum-exp), one masked call does it.
    """
    device, n = rows.device, rows.numel()
    r = rows.tolist()
    if r[-1] - r[0] + 1 == n and 8 * r[0] <= n:
        # The zero rows cost r[0]**2 / 2 pairs, at most 1/64 of the run's.
        return RowPlan(rows, "head")
    cut = _row_blocks(r, max_tail, min_run)
    work = sum((b - a) * (r[a] + MASKED_PAIR_COST * (r[b - 1] - r[a] + 1)) for a, b, _ in cut)
    masked = MASKED_PAIR_COST * n * (r[-1] + 1)
    if device.type != "cpu" or masked <= work + call_cost * 2 * len(cut):
        return RowPlan(rows, "masked", mask=torch.arange(r[-1] + 1, device=device)[None, :] <= rows[:, None])
    group = num_heads // num_kv_heads
    blocks = []
    for a, b, consecutive in cut:
        first, end = r[a], r[b - 1] + 1
        mask = None
        if not consecutive:
            # Row i of the block sees the span's entries up to rows[i]; repeated per query head
            # of a KV head, as the folded rows are.
            visible = torch.arange(first, end, device=device)[None, :] <= rows[a:b, None]
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(
                ~visible, float("-inf")
            )
            mask = mask.repeat(group, 1)[None, None]
        blocks.append(RowBlock(a, b, first, end, mask))
    return RowPlan(rows, "blocks", tuple(blocks))


def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[n, Hq, D] -> [1, Hk, group * n, D]: the query heads of a KV head as extra query rows."""
    n, heads, dim = x.shape
    return x.view(n, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, -1, dim)


def _unfold_into(
    out: torch.Tensor, lse_out: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, kv_heads: int
) -> None:
    """A folded call's output [1, Hk, group * n, D] and lse [1, Hk, group * n] into out [n, Hq, D]
    and lse_out [n, Hq]."""
    n, heads, dim = out.shape
    group = heads // kv_heads
    out.view(n, kv_heads, group, dim).copy_(o[0].view(kv_heads, group, n, dim).permute(2, 0, 1, 3))
    lse_out.view(n, kv_heads, group).copy_(lse[0].view(kv_heads, group, n).permute(2, 0, 1))


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, Hq, L, D], k/v [1, Hk, S, D] -> output [1, Hq, L, D] and each row's log-sum-exp of its
    scaled logits [1, Hq, L]; `causal` is top-left aligned. Public SDPA does not return the
    log-sum-exp; on CPU its own flash kernel does (CPU tensors only)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )


def attend_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RowPlan | torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of some rows of a KV list: query i is entry plan.rows[i] and sees entries
    0..rows[i]. q [R, Hq, D], k/v [T, Hk, D]; returns [R, Hq, D]. `plan` may be the rows
    themselves (ascending), planned with the defaults."""
    if isinstance(plan, torch.Tensor):
        plan = plan_rows(plan, q.shape[1], k.shape[1], q.dtype)
    rows, kv_heads = plan.rows, k.shape[1]
    if plan.kind == "head":
        r0, end = int(rows[0]), int(rows[-1]) + 1
        padded_q = q.new_empty((end, *q.shape[1:]))
        padded_q[:r0].zero_()
        padded_q[r0:] = q
        o = F.scaled_dot_product_attention(
            padded_q.transpose(0, 1).unsqueeze(0),
            k[:end].transpose(0, 1).unsqueeze(0),
            v[:end].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return o[0, :, r0:].transpose(0, 1)
    if plan.kind == "masked":
        assert plan.mask is not None
        end = plan.mask.shape[1]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k[:end].transpose(0, 1).unsqueeze(0),
            v[:end].transpose(0, 1).unsqueeze(0),
            attn_mask=plan.mask,
            scale=scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)
    # Part 0: the entries before each block (none for a block at the head: lse -inf, weight 0);
    # part 1: the block's own span.
    outs = torch.empty((2, *q.shape), dtype=torch.float32, device=q.device)
    lses = torch.empty((2, *q.shape[:2]), dtype=torch.float32, device=q.device)
    kt, vt = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    for blk in plan.blocks:
        a, b, first, end = blk.first_row, blk.last_row, blk.first, blk.end
        if first > 0:
            o, lse = _flash(_fold(q[a:b], kv_heads), kt[:, :, :first], vt[:, :, :first], False, scale)
            _unfold_into(outs[0, a:b], lses[0, a:b], o, lse, kv_heads)
        else:
            outs[0, a:b], lses[0, a:b] = 0.0, float("-inf")
        if blk.mask is None:
            o, lse = _flash(
                q[a:b].transpose(0, 1).unsqueeze(0), kt[:, :, first:end], vt[:, :, first:end], True, scale
            )
            outs[1, a:b], lses[1, a:b] = o[0].transpose(0, 1), lse[0].transpose(0, 1)
        else:
            o, lse = _flash(
                _fold(q[a:b], kv_heads), kt[:, :, first:end], vt[:, :, first:end], False, scale, blk.mask
            )
            _unfold_into(outs[1, a:b], lses[1, a:b], o, lse, kv_heads)
    # Softmax over the union of the two parts: each weighted by its share of the total exp-sum.
    weights = torch.softmax(lses, dim=0)[..., None]
    return outs.mul_(weights).sum(dim=0).to(q.dtype)
