"""Token slots of the KV tensors: where a block table's tokens are, and copies of the K and V
there (the chunk manager's promotions and tier writes, the runner's reads)."""

from __future__ import annotations

import torch


def block_slots(
    block_table: list[int], block_size: int, num_tokens: int, device: torch.device
) -> torch.Tensor:
    """Slots of the first `num_tokens` tokens stored in `block_table`."""
    blocks = torch.tensor(block_table, dtype=torch.long, device=device)
    offsets = torch.arange(block_size, device=device)
    return (blocks[:, None] * block_size + offsets).flatten()[:num_tokens]


def consecutive(block_table: list[int], num_tokens: int, block_size: int) -> bool:
    """Whether the blocks holding the first `num_tokens` tokens are consecutive block ids."""
    used = -(-num_tokens // block_size)
    return all(block_table[i + 1] == block_table[i] + 1 for i in range(used - 1))


def gather_kv(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU copy of the K and V at `slots`, each [layers, len(slots), kv_heads, head_dim]."""
    k = torch.stack([k_layer[slots] for k_layer, _ in kv_caches]).cpu()
    v = torch.stack([v_layer[slots] for _, v_layer in kv_caches]).cpu()
    return k, v


def scatter_kv(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write K and V ([layers, len(slots), kv_heads, head_dim]) into `slots` of every layer."""
    for layer, (k_layer, v_layer) in enumerate(kv_caches):
        k_layer.index_copy_(0, slots, k[layer].to(k_layer.device))
        v_layer.index_copy_(0, slots, v[layer].to(v_layer.device))
