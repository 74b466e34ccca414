"""A question's view of the KV it borrows, once every entry it needs is computed.

The chunk manager keeps entries alive and computed; what a question attends to is a view of their
pool pages, and how that view is laid out depends on the request's layout:

- isolated / the default: one borrowed KV list [S | C1 | ... | Cn] at the positions each part was
  computed at (with the calibration of the cached context's attention, model/calibration.py);
- offset: the same slots, plus per token how far its KV must be re-rotated to sit at its natural
  position in this prompt (a chunk entry's tokens were computed right after its own S);
- fusion: one stream per document, [S | Ci], and S alone for the no-document stream
  (engine/fusion.py combines the streams at decode time).
"""

from __future__ import annotations

import torch

from chunkcache.core.plan import RequestChunks
from chunkcache.core.sequence import Sequence
from chunkcache.model.calibration import calibration_for


def assemble(seq: Sequence, parts: list[torch.Tensor], device: torch.device) -> None:
    """Lay out `seq`'s borrowed KV from `parts`, the slots of each entry's slice (S first)."""
    assert seq.chunk_plan is not None and seq.chunks is not None
    cfg, state = seq.chunk_plan.config, seq.chunks
    slots = torch.cat(parts)
    if cfg.layout == "fusion":
        state.stream_slots = [torch.cat((parts[0], p)) for p in parts[1:]]
        if cfg.fusion_amateur:
            state.stream_slots.append(parts[0])
    elif cfg.layout == "offset":
        state.cached_slots = slots
        state.cached_delta = offset_deltas(state).to(device)
    else:
        seq.kv_list.borrowed_slots = slots
        seq.kv_list.calibration = calibration_for(
            len(state.prompt.sys_token_ids),
            slots.numel(),
            cfg.calibration_temperature,
            cfg.calibration_scale,
        )
    state.assembled = True


def offset_deltas(state: RequestChunks) -> torch.Tensor:
    """Per cached token: its natural position minus the position its KV was computed at (a chunk
    entry's tokens were computed after its own S, from position len(S))."""
    s = len(state.prompt.sys_token_ids)
    deltas = [torch.zeros(s, dtype=torch.long)]
    offset = s
    for entry, (start, n) in zip(state.entries[1:], state.slices[1:], strict=True):
        computed_at = len(entry.token_ids[0]) + start
        deltas.append(torch.full((n,), offset - computed_at, dtype=torch.long))
        offset += n
    return torch.cat(deltas)
