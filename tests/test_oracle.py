"""Sanity tests of the test infrastructure itself: tiny checkpoints and the transformers oracle."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.support.oracle import (
    causal_mask,
    chunk_isolated_mask,
    hf_first_token_logprobs,
    hf_greedy,
    hf_greedy_with_mask,
    hf_logits_with_mask,
    hf_logprobs_with_mask,
    hf_model,
)
from tests.support.tiny_checkpoint import ARCHS, ROPE_TYPES, build_checkpoint, checkpoint_config

Factory = Callable[..., Path]

PROMPT = [0, 473, 645, 831, 652, 283, 459, 461, 18, 263]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_causal_mask_matches_plain_forward(checkpoint: Factory, arch: str) -> None:
    path = checkpoint(arch)
    mask, pos = causal_mask(len(PROMPT))
    expected = hf_first_token_logprobs(path, PROMPT)
    for impl in ("eager", "sdpa"):
        got = hf_logprobs_with_mask(path, PROMPT, mask, pos, attn_implementation=impl)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_chunk_isolated_mask_small() -> None:
    mask, pos = chunk_isolated_mask(2, [2, 3], 2)
    expected = torch.tensor(
        [
            # S0 S1 a0 a1 b0 b1 b2 q0 q1
            [1, 0, 0, 0, 0, 0, 0, 0, 0],  # S0
            [1, 1, 0, 0, 0, 0, 0, 0, 0],  # S1
            [1, 1, 1, 0, 0, 0, 0, 0, 0],  # chunk a, token 0
            [1, 1, 1, 1, 0, 0, 0, 0, 0],  # chunk a, token 1
            [1, 1, 0, 0, 1, 0, 0, 0, 0],  # chunk b, token 0: S and itself only
            [1, 1, 0, 0, 1, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 0],  # Q sees everything before it
            [1, 1, 1, 1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    assert pos.tolist() == [0, 1, 2, 3, 2, 3, 4, 5, 6]


def test_chunk_isolated_mask_edge_cases() -> None:
    mask, pos = chunk_isolated_mask(1, [], 2)  # no chunks: plain causal
    assert torch.equal(mask, causal_mask(3)[0]) and pos.tolist() == [0, 1, 2]
    mask, pos = chunk_isolated_mask(1, [1, 2], 0)  # no question
    assert pos.tolist() == [0, 1, 1, 2] and mask.shape == (4, 4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_isolated_chunk_equals_chunk_computed_alone(checkpoint: Factory, arch: str) -> None:
    # The property the chunk cache relies on (docs/design.md §2): under the isolated layout a chunk's
    # hidden states depend only on (S, Ci), so each chunk's last logits equal those of S + Ci
    # run as an ordinary prompt. This also proves the oracle honours mask *and* positions.
    path = checkpoint(arch)
    s, c1, c2, q = PROMPT[:3], PROMPT[3:6], PROMPT[6:8], PROMPT[8:]
    mask, pos = chunk_isolated_mask(len(s), [len(c1), len(c2)], len(q))
    logits = hf_logits_with_mask(path, s + c1 + c2 + q, mask, pos)
    lp = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(lp[len(s + c1) - 1], hf_first_token_logprobs(path, s + c1), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        lp[len(s + c1 + c2) - 1], hf_first_token_logprobs(path, s + c2), atol=1e-5, rtol=0
    )
    # ...and the question really is different from the plain causal prompt.
    assert (lp[-1] - hf_first_token_logprobs(path, s + c1 + c2 + q)).abs().max() > 1e-2
    # eager and sdpa agree on the custom mask.
    sdpa = hf_logits_with_mask(path, s + c1 + c2 + q, mask, pos, attn_implementation="sdpa")
    torch.testing.assert_close(sdpa, logits, atol=1e-4, rtol=0)


def test_greedy_with_causal_mask_matches_generate(checkpoint: Factory) -> None:
    path = checkpoint("llama")
    mask, pos = causal_mask(len(PROMPT))
    ref = hf_greedy(path, PROMPT, 8)
    assert len(ref) == 8
    assert hf_greedy_with_mask(path, PROMPT, mask, pos, 8) == ref
    # A random model should not be degenerate: greedy output is not one repeated token.
    assert len(set(ref)) > 2


def test_greedy_ignores_eos(checkpoint: Factory) -> None:
    path = checkpoint("llama")
    first = hf_greedy(path, PROMPT, 4)
    # Make the greedily chosen tokens EOS in the loaded model's generation config.
    model = hf_model(path)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [first[0], first[1]]
    try:
        assert hf_greedy(path, PROMPT, 4) == first
    finally:
        model.generation_config.eos_token_id = saved


def test_tokenizer_round_trip_and_bos(checkpoint: Factory) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint("llama"))
    assert len(tok) == 1000
    assert tok.bos_token == "<|bos|>" and tok.eos_token == "<|eos|>" and tok.pad_token == "<|pad|>"
    text = 'Zorvath sells 12 apples in Port Kellam. # # Who?\n  Unicode: ünï 😀 "quoted"  .'
    with_special = tok(text)["input_ids"]
    plain = tok(text, add_special_tokens=False)["input_ids"]
    assert with_special == [tok.bos_token_id, *plain]
    assert tok.bos_token_id not in plain
    assert tok.decode(plain) == text
    # Parts tokenize on their own, with no added prefix space (docs/design.md §2).
    assert tok.decode(tok(" # # ", add_special_tokens=False)["input_ids"]) == " # # "
    gen = json.loads((checkpoint("llama") / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]


def test_chat_template_renders(checkpoint: Factory) -> None:
    from transformers import AutoTokenizer

    path = checkpoint("llama")
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi # # there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi # # there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize("rope", ROPE_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_arch_rope_builds_and_loads(checkpoint: Factory, arch: str, rope: str) -> None:
    from transformers import AutoModelForCausalLM

    path = checkpoint(arch, rope)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["rope_parameters"]["rope_type"] == rope
    assert config["head_dim"] == 16 and config["num_key_value_heads"] == 2
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert type(model).__name__ == config["architectures"][0]
    assert model.config.vocab_size == 1024
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    if arch == "qwen3":
        assert hasattr(model.model.layers[0].self_attn, "q_norm")
    if arch == "mistral":
        assert config["sliding_window"] is None
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits
    assert torch.isfinite(logits).all()
    # Padding rows past the tokenizer's 1000 tokens give logit 0: never the greedy choice.
    assert torch.equal(logits[..., 1000:], torch.zeros_like(logits[..., 1000:]))
    assert int(logits.argmax(-1).max()) < 1000


def test_sharded_checkpoint(checkpoint: Factory) -> None:
    path = checkpoint("llama", sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) >= 2
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert not (path / "model.safetensors").exists()
    # Same seed, same weights as the single-file checkpoint.
    torch.testing.assert_close(
        hf_first_token_logprobs(path, PROMPT), hf_first_token_logprobs(checkpoint("llama"), PROMPT)
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_saved_as_such(checkpoint: Factory, dtype: str) -> None:
    path = checkpoint("qwen3", dtype=dtype)
    assert json.loads((path / "config.json").read_text())["dtype"] == dtype
    with safe_open(path / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {getattr(torch, dtype)}  # noqa: SIM118


def test_tied_embeddings(checkpoint: Factory) -> None:
    path = checkpoint("qwen2", tie_word_embeddings=True)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    assert torch.isfinite(hf_first_token_logprobs(path, PROMPT)).all()


def test_sliding_window_passthrough(checkpoint: Factory) -> None:
    config = json.loads((checkpoint("mistral", sliding_window=8) / "config.json").read_text())
    assert config["sliding_window"] == 8
    config = json.loads((checkpoint("qwen2", sliding_window=8) / "config.json").read_text())
    assert config["sliding_window"] == 8 and config["use_sliding_window"] is True


def test_build_is_deterministic_and_cached(tmp_path: Path) -> None:
    a = build_checkpoint(tmp_path / "a", arch="qwen2", seed=3)
    b = build_checkpoint(tmp_path / "b", arch="qwen2", seed=3)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # A second call with the same arguments reuses the directory as is.
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_checkpoint(tmp_path / "a", arch="qwen2", seed=3) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    # Different seed, different weights (and the cache notices the new arguments).
    build_checkpoint(tmp_path / "a", arch="qwen2", seed=4)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def test_qwen25_preset_config() -> None:
    config = checkpoint_config("qwen2", preset="qwen2.5-0.5b")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (896, 24, 14)
    assert (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (2, 4864, 151936)
    assert config.tie_word_embeddings is True and config.max_position_embeddings == 32768
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
    with pytest.raises(ValueError):
        checkpoint_config("llama", preset="qwen2.5-0.5b")
