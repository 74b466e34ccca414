"""The model runner: owns the model and the KV tensors; turns a scheduled batch into one forward.

The KV tensors hold `num_slots` token slots per layer: the paged blocks first, then the chunk
pool's pages, so that a sequence can read pool entries in place (no copy on a chunk hit).
"""

from __future__ import annotations

import torch

from chunkcache.engine.scheduler import ScheduledBatch
from chunkcache.model.attention import AttentionMetadata, DecodeBatch, PrefillSegment
from chunkcache.model.loader import LoadedModel


def block_slots(
    block_table: list[int], block_size: int, num_tokens: int, device: torch.device
) -> torch.Tensor:
    """Slots of the first `num_tokens` tokens stored in `block_table`."""
    blocks = torch.tensor(block_table, dtype=torch.long, device=device)
    offsets = torch.arange(block_size, device=device)
    return (blocks[:, None] * block_size + offsets).flatten()[:num_tokens]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_slots: int, block_size: int) -> None:
        self.model = loaded.model
        self.spec = loaded.spec
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = block_size
        shape = (num_slots, self.spec.num_kv_heads, self.spec.head_dim)
        # torch.empty: pages untouched by any sequence cost no memory on CPU.
        self.kv_caches = [
            (
                torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.spec.num_layers)
        ]

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Token ids, positions, attention metadata and, per sequence, the index of the token
        whose logits are sampled (-1 when the sequence samples nothing this step)."""
        dev = self.device
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        prefills: list[PrefillSegment] = []
        decode_index: list[int] = []
        decode_slots: list[torch.Tensor] = []
        sample_index: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            c = seq.num_computed
            start = len(ids)
            ids.extend(seq.token_ids[c : c + n])
            positions.append(torch.arange(seq.position_base + c, seq.position_base + c + n, device=dev))
            own = block_slots(seq.block_table, self.block_size, c + n, dev)
            slot_mapping.append(own[c:])
            past = own[:c] if seq.borrowed_slots is None else torch.cat((seq.borrowed_slots, own[:c]))
            if n == 1 and past.numel() > 0:
                decode_index.append(start)
                decode_slots.append(torch.cat((past, own[c:])))
            else:
                prefills.append(PrefillSegment(start, start + n, past if past.numel() else None))
            done = c + n == seq.num_tokens
            sample_index.append(start + n - 1 if done and not seq.is_fill else -1)
        decode = None
        if decode_index:
            max_len = max(s.numel() for s in decode_slots)
            slots = torch.zeros(len(decode_slots), max_len, dtype=torch.long, device=dev)
            mask = torch.zeros(len(decode_slots), 1, 1, max_len, dtype=torch.bool, device=dev)
            for row, s in enumerate(decode_slots):
                slots[row, : s.numel()] = s
                mask[row, 0, 0, : s.numel()] = True
            decode = DecodeBatch(torch.tensor(decode_index, device=dev), slots, mask)
        meta = AttentionMetadata(torch.cat(slot_mapping), prefills, decode)
        return torch.tensor(ids, device=dev), torch.cat(positions), meta, sample_index

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Logits [num sampling sequences, vocab] and the batch rows they belong to."""
        input_ids, positions, meta, sample_index = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        rows = [r for r, i in enumerate(sample_index) if i >= 0]
        if not rows:
            return torch.empty(0, self.spec.vocab_size), rows
        logits = self.model.compute_logits(
            hidden[torch.tensor([sample_index[r] for r in rows], device=self.device)]
        )
        return logits.cpu(), rows
