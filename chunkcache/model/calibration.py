"""APE's attention calibration over independently encoded chunks (Yang et al. 2025): one option
of chunk reuse, applied by the attention of the tokens after the chunks (model/attention.py for
prefill and decode, engine/blend.py for the question's rows in a blend)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ContextCalibration:
    """APE's calibration (Yang et al. 2025) of attention over independently encoded chunks.

    KV-list entries [start, end) are chunks computed without seeing each other. A token after
    them attends to them with temperature T (logits / T inside the group; APE sharpens with
    T < 1) and with the group's total weight multiplied by s; the entries before and after the
    group are attended as usual. T = s = 1 is exact attention. Tokens before `end` are never
    calibrated. Measured on SmolLM2 it kept fewer of full prefill's answers (benchmarks/history/
    RESULTS-narrative.md "APE's attention calibration"), so the engine's default is the identity.
    """

    start: int
    end: int
    temperature: float
    scale: float


def calibration_for(start: int, end: int, temperature: float, scale: float) -> ContextCalibration | None:
    """The calibration of chunks at KV-list entries [start, end); None where it is the identity."""
    if temperature == 1.0 and scale == 1.0:
        return None
    return ContextCalibration(start, end, temperature, scale)


def calibrated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_index: torch.Tensor,
    cal: ContextCalibration,
    scale: float,
) -> torch.Tensor:
    """q [n, Hq, D] of the KV-list entries `query_index` [n] (each >= cal.end), causal over the
    KV list k/v [L, Hk, D]; returns [n, Hq, D]. Explicit softmax: SDPA cannot give a group a
    temperature that depends on the query through the group's log-sum-exp."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kk = k.float().repeat_interleave(heads // kv_heads, dim=1)
    vv = v.float().repeat_interleave(heads // kv_heads, dim=1)
    logits = torch.einsum("nhd,lhd->hnl", q.float(), kk).mul_(scale)
    visible = torch.arange(k.shape[0], device=k.device)[None, :] <= query_index[:, None]
    logits.masked_fill_(~visible, float("-inf"))
    # Within the group softmax(z / T); the group's total mass is that of exp(T * lse(z / T)) * s.
    # One softmax over all keys gives both when the group's logits are shifted by
    # (T - 1) * lse(z / T) + log s.
    group = logits[..., cal.start : cal.end] / cal.temperature
    lse = torch.logsumexp(group, dim=-1, keepdim=True)
    logits[..., cal.start : cal.end] = group + (cal.temperature - 1) * lse + math.log(cal.scale)
    probs = logits.softmax(dim=-1)
    return torch.einsum("hnl,lhd->nhd", probs, vv).to(q.dtype)
