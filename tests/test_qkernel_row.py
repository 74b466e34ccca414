"""A decode row's norm and one sequence's attention in C (qkernel_row.c), bfloat16 and float32,
against the torch operators they replace: the RoPE'd K and the V written to the cache bit for
bit, the norm within a unit in the last place where it sums in another order, the attention no
farther from float64 than torch's, and the engine taking them for one-sequence decode steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chunkcache import LLM, SamplingParams
from chunkcache.model.attention import AttentionMetadata, DecodeBatch, attend
from chunkcache.model.kernels import build, qkernel
from chunkcache.model.rope import RopeSpec, RotaryEmbedding

pytestmark = pytest.mark.skipif(build.loaded()[0] is None, reason="the kernel library does not build here")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 units in the last place apart (same-signed finite values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("dim", [64, 576, 960, 1536])
def test_bf16_norm_is_torchs_within_a_unit_rarely(dim: int) -> None:
    """Against `RMSNorm`'s torch path (transformers' bits, tests/test_bf16.py), 960 rows in calls of
    1, 3 and 8: at most one unit apart, on at most 1e-4 of the elements (the sum of squares in
    another order; 4,000 rows a width measured 0-4 elements in a million)."""
    g = torch.Generator().manual_seed(dim)
    weight = (torch.randn(dim, generator=g) * 0.3 + 1).to(torch.bfloat16)
    differing = total = 0
    for rows in [1, 3, 8] * 80:
        x = (torch.randn(rows, dim, generator=g) * 4).to(torch.bfloat16)
        ours = qkernel.rms_norm_rows(x, weight, 1e-5)
        theirs = weight * F.rms_norm(x.float(), weight.shape, None, 1e-5).to(x.dtype)
        assert _ulps(ours, theirs).max() <= 1
        differing, total = differing + int((ours != theirs).sum()), total + ours.numel()
    assert differing <= 1e-4 * total


@pytest.mark.parametrize("dim", [64, 576, 1536])
def test_float32_norm_is_torchs_within_float_rounding(dim: int) -> None:
    """Against `F.rms_norm` with the weight (`RMSNorm`'s float32 path): the sum of squares in
    double, so a few units in the last place of float32 apart at most."""
    g = torch.Generator().manual_seed(dim)
    weight = torch.randn(dim, generator=g) * 0.3 + 1
    for rows in (1, 3, 8):
        x = torch.randn(rows, dim, generator=g) * 4
        ours = qkernel.rms_norm_rows(x, weight, 1e-5)
        torch.testing.assert_close(ours, F.rms_norm(x, weight.shape, weight, 1e-5), rtol=1e-6, atol=1e-6)


def _attention_case(hq: int, hk: int, d: int, length: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    slots_total = length + 40
    k_cache = torch.randn(slots_total, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(slots_total, hk, d, generator=g).to(dtype)
    slots = torch.randperm(slots_total, generator=g)[:length]  # a scattered KV list
    qkv = (torch.randn(1, (hq + 2 * hk) * d, generator=g) * 2).to(dtype)
    rotary = RotaryEmbedding(d, RopeSpec("default", 10000.0), 8192)
    return k_cache, v_cache, slots, qkv, rotary.table(torch.tensor([length + 3]), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("hq", "hk", "d", "length"),
    [(9, 3, 64, 1), (9, 3, 64, 200), (14, 2, 64, 700), (4, 4, 128, 37), (8, 1, 16, 5), (12, 2, 128, 1300)],
)
def test_attention_is_torchs(hq: int, hk: int, d: int, length: int, dtype: torch.dtype) -> None:
    """`attend_row` against `project`'s RoPE and `attend` (SDPA over the gathered list, the query
    heads of a KV head folded): the caches after it equal, the output as close to a float64
    attention as torch's, on average and at worst (lists past torch's KV split of 512 included;
    in bfloat16 93-100% of the outputs within a unit of torch's)."""
    k_cache, v_cache, slots, qkv, rope = _attention_case(hq, hk, d, length, hq * length + d, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    scale = d**-0.5
    ours = qkernel.attend_row(qkv, rope, (k_cache, v_cache), slots, (hq, hk), scale)

    q, k = RotaryEmbedding.apply(rope, qkv[:, : (hq + hk) * d].view(1, hq + hk, d)).split((hq, hk), dim=1)
    v = qkv[:, (hq + hk) * d :].view(1, hk, d)
    mask = torch.ones(1, 1, 1, length, dtype=torch.bool)
    meta = AttentionMetadata(slots[-1:], [], DecodeBatch(torch.tensor([0]), slots[None], mask))
    theirs = attend(q, k, v, k_ref, v_ref, meta, scale).reshape(1, -1)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)

    qd = q.double().view(hk, hq // hk, d)
    keys, values = (c[slots].double().permute(1, 0, 2) for c in (k_ref, v_ref))
    exact = (torch.softmax(qd @ keys.transpose(1, 2) * scale, -1) @ values).reshape(1, -1)
    for stat in (torch.mean, torch.amax):  # measured: ours 0.98-1.02x torch's mean error
        err_ours, err_theirs = (stat((o.double() - exact).abs()) for o in (ours, theirs))
        assert err_ours <= 1.1 * err_theirs + 1e-6, (stat, err_ours, err_theirs)
    if dtype == torch.float32:  # float32: summed in another order only
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_sequence_decode_takes_them(checkpoint, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """An engine's one-sequence decode steps run every layer's attention and every norm through
    the C calls (their accuracy against transformers: tests/test_bf16.py, tests/test_oracle.py);
    a batch of two keeps torch's attention."""
    calls = {"attend": 0, "norm": 0}
    real_attend, real_norm = qkernel.attend_row, qkernel.rms_norm_rows

    def attend_row(*args, **kwargs):
        calls["attend"] += 1
        return real_attend(*args, **kwargs)

    def norm(*args, **kwargs):
        calls["norm"] += 1
        return real_norm(*args, **kwargs)

    monkeypatch.setattr(qkernel, "attend_row", attend_row)
    monkeypatch.setattr(qkernel, "rms_norm_rows", norm)
    llm = LLM(str(checkpoint()), device="cpu", dtype=dtype, kv_cache_tokens=1024, enable_chunk_cache=False)
    layers = llm.engine.runner.model.spec.num_layers
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(["one two three four"], params)
    assert calls == {"attend": 5 * layers, "norm": 5 * (2 * layers + 1)}
    llm.generate(["one two three four", "five six seven"], params)
    assert calls["attend"] == 5 * layers
    llm.close()
