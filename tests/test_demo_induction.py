"""The induction circuit written into the demo model's fresh weights (chunkcache/demo/induction.py):
it must copy before any training, and its loss must tell a working circuit from a random one."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from chunkcache.demo.induction import CircuitLoss, install, repeat_accuracy


def _fresh(hidden: int = 256, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Qwen3ForCausalLM:
    """A randomly initialised model of the demo size (or another head layout)."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        hidden_size=hidden,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=768,
        vocab_size=4096,
        max_position_embeddings=2048,
        rope_theta=1e6,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def _repeat_batch(length: int = 60, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(5, 4096, (2, length), generator=gen)
    ids = torch.cat([torch.zeros(2, 1, dtype=torch.long), seq, seq], dim=1)
    n = ids.shape[1]
    return ids, torch.ones(n, n, dtype=torch.bool).tril().expand(2, n, n)


def test_installed_circuit_copies_a_repeated_random_sequence() -> None:
    model = _fresh()
    assert repeat_accuracy(model) < 0.05  # a random model does not copy
    install(model)
    # Measured 0.86 on this init; the circuit alone, before any training.
    assert repeat_accuracy(model) > 0.7


def test_circuit_loss_is_low_for_the_installed_heads_and_high_for_random_ones() -> None:
    ids, mask = _repeat_batch()
    losses = []
    for installed in (False, True):
        model = _fresh()
        if installed:
            install(model)
        probe = CircuitLoss(model)
        with torch.no_grad():
            model(input_ids=ids)
            losses.append(float(probe(ids, mask)))
    random_loss, installed_loss = losses
    assert installed_loss < 1.0 < 4.0 < random_loss, losses


def test_circuit_loss_trains_the_heads_and_needs_no_repeats() -> None:
    model = _fresh()
    install(model)
    probe = CircuitLoss(model)
    ids = torch.arange(5, 125).reshape(2, 60)  # no token occurs twice: only the previous-token term
    mask = torch.ones(60, 60, dtype=torch.bool).tril().expand(2, 60, 60)
    model(input_ids=ids)
    loss = probe(ids, mask)
    loss.backward()
    assert torch.isfinite(loss)
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_install_rejects_heads_too_wide_for_the_hidden_size() -> None:
    with pytest.raises(ValueError, match="hidden_size >= 3 \\* head_dim"):
        install(_fresh(hidden=128, heads=2, kv_heads=1))
