"""APE's calibration of attention over independently encoded chunks, against transformers run
with an attention function that computes APE as its authors do (oracle.register_ape_attention)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from chunkcache import LLM, SamplingParams
from chunkcache.errors import InvalidRequestError
from chunkcache.model.calibration import ContextCalibration, calibrated_attention
from tests.support.engines import tiny_llm as _llm
from tests.support.oracle import (
    causal_mask,
    chunk_isolated_mask,
    hf_greedy_with_mask,
    hf_logprobs_with_mask,
    register_ape_attention,
)
from tests.support.prompts import DOCS, QUESTION, SEP, SYSTEM

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
APE = {"calibration_temperature": 0.5, "calibration_scale": 1.5}


def _parts(llm: LLM, doc_ids: list[int]) -> tuple[str, list[int], list[list[int]], list[int]]:
    tok = llm.tokenizer
    prompt = SYSTEM + SEP + SEP.join(DOCS[i] for i in doc_ids) + SEP + QUESTION
    sys_ids = tok.encode(SYSTEM, add_special_tokens=True)
    chunks = [tok.encode(DOCS[i], add_special_tokens=False) for i in doc_ids]
    return prompt, sys_ids, chunks, tok.encode(QUESTION, add_special_tokens=False)


def _assert_matches(out, path, ids, mask, positions, attn: str) -> None:
    assert out.prompt_token_ids == ids
    ref = hf_logprobs_with_mask(path, ids, mask, positions, attn)
    for token, lp in out.outputs[0].logprobs[0].items():
        assert abs(ref[token].item() - lp) < 1e-4, (token, ref[token].item(), lp)
    assert out.outputs[0].token_ids == hf_greedy_with_mask(
        path, ids, mask, positions, GREEDY.max_tokens, attn
    )


@pytest.mark.parametrize(("temperature", "scale"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.6), (0.5, 1.8)])
def test_calibrated_attention_is_ape(temperature: float, scale: float) -> None:
    torch.manual_seed(0)
    n, length, heads, kv_heads, dim, start, end = 5, 23, 4, 2, 8, 3, 15
    q = torch.randn(n, heads, dim)
    k, v = torch.randn(length, kv_heads, dim), torch.randn(length, kv_heads, dim)
    index = torch.arange(length - n, length)
    out = calibrated_attention(q, k, v, index, ContextCalibration(start, end, temperature, scale), 0.3)
    # The oracle's APE over the whole list: rows before `end` are plain, the last n are ours.
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    additive = torch.zeros(length, length).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
    full_q = torch.randn(length, heads, dim)
    full_q[-n:] = q
    ape = register_ape_attention(start, end, temperature, scale)
    from transformers import AttentionInterface

    ref, _ = AttentionInterface()[ape](
        SimpleNamespace(num_key_value_groups=heads // kv_heads),
        full_q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        additive,
        scaling=0.3,
    )
    torch.testing.assert_close(out, ref[0, -n:], atol=1e-5, rtol=1e-5)
    if temperature == scale == 1.0:  # the identity: exactly causal attention
        plain = F.scaled_dot_product_attention(
            full_q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=0.3,
            enable_gqa=True,
        )
        torch.testing.assert_close(out, plain[0].transpose(0, 1)[-n:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_isolated_layout_with_calibration_matches_transformers(checkpoint, arch: str) -> None:
    path = checkpoint(arch=arch)
    llm = _llm(path, chunk_layout="isolated", **APE)
    prompt, sys_ids, chunks, q_ids = _parts(llm, [2, 0, 1])
    # A plain request (no separators, so no calibration) decodes in the same batches.
    other = SYSTEM + " " + DOCS[1]
    outs = llm.generate([prompt, other], GREEDY)
    mask, positions = chunk_isolated_mask(len(sys_ids), [len(c) for c in chunks], len(q_ids))
    ids = sys_ids + [t for c in chunks for t in c] + q_ids
    end = len(ids) - len(q_ids)
    _assert_matches(outs[0], path, ids, mask, positions, register_ape_attention(len(sys_ids), end, **_ape()))
    plain = outs[1].prompt_token_ids
    _assert_matches(outs[1], path, plain, *causal_mask(len(plain)), "eager")
    llm.check_integrity()


def test_blend_with_calibration_matches_transformers(checkpoint) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    # Ratio 1.0 at layer 0: every chunk token is recomputed, so only Q's attention differs.
    llm = _llm(path, chunk_layout="offset", blend_check_layers=[0], blend_recompute_ratios=[1.0], **APE)
    prompt, sys_ids, _, q_ids = _parts(llm, [0, 2])
    out = llm.generate(prompt, GREEDY)[0]
    ids = out.prompt_token_ids
    mask, positions = causal_mask(len(ids))
    attn = register_ape_attention(len(sys_ids), len(ids) - len(q_ids), **_ape())
    _assert_matches(out, path, ids, mask, positions, attn)
    llm.check_integrity()


def _ape() -> dict[str, float]:
    return {"temperature": APE["calibration_temperature"], "scale": APE["calibration_scale"]}


@pytest.mark.parametrize("options", [{"calibration_temperature": 0.0}, {"calibration_scale": float("nan")}])
def test_bad_calibration_is_rejected(checkpoint, options: dict) -> None:
    llm = _llm(checkpoint(arch="llama", num_hidden_layers=2))
    prompt, *_ = _parts(llm, [0, 1])
    with pytest.raises(InvalidRequestError, match=next(iter(options))):
        llm.generate(prompt, GREEDY, chunk_options=options)
    assert not llm.engine.has_unfinished_requests()
    llm.check_integrity()
