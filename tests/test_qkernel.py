"""The AVX2 few-row kernel of quantized products (chunkcache/model/kernels/qkernel.py, qkernel.c).

Oracle: the weight dequantized from the same codes and factors, multiplied in float64 here.
Tolerance: the kernel sums in float32 (the 1-row int4 product as s sum(x q) + m sum(x) per
group), so against float64 it is off by float32 summation error: over the shapes and row counts
below, 5 seeds each, measured 8e-8 to 4.1e-6 (int4) and <= 3.8e-7 (int8) of the largest |y|;
2e-5 leaves room for other inputs, where a misread nibble or row is off by ~1e-2 or more.
torch's bfloat16 kernels sit at ~4e-3 of the same reference.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from chunkcache.model import dequant, quant
from chunkcache.model.gguf_blocks import affine_int4
from chunkcache.model.kernels import build, qkernel
from chunkcache.model.kernels.quant_blocks import BlocksPart
from chunkcache.model.quant import Int4Part, Int8Part, QuantProduct

pytestmark = pytest.mark.skipif(
    not qkernel.available(),
    reason="qkernel's decode products do not serve here: "
    + (build.kernels().reason or "torch packs int4 in AVX512 tiles of 64 rows, the kernel reads AVX2's 32"),
)

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from tests.test_quant import _raw, _reference  # noqa: E402

TOL = 2e-5  # of max |y|, against float64; measured <= 4.1e-6


def _close(y: torch.Tensor, exact: torch.Tensor) -> float:
    return ((y.double() - exact).abs().max() / exact.abs().max()).item()


# (rows of the weight, inputs): a single tile, odd tile and group counts, the 1.5B's down shape.
INT4_SHAPES = [(32, 32), (96, 160), (224, 1536), (64, 8960)]
ROW_COUNTS = [1, 2, 3, 5, 8, 11]  # 11: two calls (8 + 3)


@pytest.mark.parametrize("shape", INT4_SHAPES, ids=str)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_int4_kernel_against_float64_dequantize_then_matmul(shape: tuple[int, int], rows: int) -> None:
    out_f, in_f = shape
    g = torch.Generator().manual_seed(out_f * 7 + in_f + rows)
    q = torch.randint(0, 16, shape, dtype=torch.uint8, generator=g)
    scale = torch.rand(out_f, in_f // 32, generator=g) * 0.01
    minimum = -torch.rand(out_f, in_f // 32, generator=g) * 0.08
    part = Int4Part(q, scale, minimum)
    assert part.native
    x = torch.randn(rows, in_f, generator=g)
    w = q.double() * scale.double().repeat_interleave(32, 1) + minimum.double().repeat_interleave(32, 1)
    y = part.kernel(x)
    assert y.dtype == torch.float32 and y.shape == (rows, out_f)
    assert _close(y, x.double() @ w.t()) < TOL


@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (33, 100), (40, 1536)], ids=str)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_int8_kernel_against_float64_dequantize_then_matmul(shape: tuple[int, int], rows: int) -> None:
    """Any shape: inputs not a multiple of 8 or 32 take the kernel's scalar tail."""
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1] + rows)
    part = Int8Part.quantize(torch.randn(shape, generator=g))
    assert part.native
    x = torch.randn(rows, shape[1], generator=g)
    w = part.codes.double() * part.scales.double()[:, None]
    y = part.kernel(x)
    assert y.dtype == torch.float32 and y.shape == (rows, shape[0])
    assert _close(y, x.double() @ w.t()) < TOL


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
def test_each_gguf_type_served_by_the_kernel_is_the_files_weight(qtype: Q) -> None:
    """Per quant type, through `native_parts` as a load builds it: the int4 types exactly the
    file's values in float32 (their own codes and factors), so within float32 summation of a
    float64 product over gguf's dequantization; the int8 ones within the re-quantization's error
    as before, and exactly the int8 weight they hold (Q6_K without int8 x; Q8_0 its own blocks)."""
    raw = _raw(qtype, seed=20, shape=(96, 512))
    (part,) = quant.native_parts([raw], torch.float32, {})
    assert part.native
    x = torch.randn(3, 512)
    y = QuantProduct([part], None, torch.float32)(x)
    file_weight = _reference(raw).double()
    if isinstance(
        part, (Int4Part, BlocksPart)
    ):  # Q6_K, Q8_0: their own blocks (tests/test_qkernel_blocks.py)
        assert _close(y, x.double() @ file_weight.t()) < TOL
    else:
        held = part.codes.double() * part.scales.double()[:, None]
        assert _close(y, x.double() @ held.t()) < TOL
        assert _close(y, x.double() @ file_weight.t()) < 3e-2


def _int8_x(x: torch.Tensor) -> torch.Tensor:
    """x rounded as `int8_activations` rounds it, back in float64: per block of 32 inputs,
    d round(x / d) with d = max|x| / 127 (qkernel.c's `quantize_blocks`)."""
    blocks = x.double().view(x.shape[0], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True).float() / 127).double()
    inv = torch.where(d > 0, (127 / blocks.abs().amax(-1, keepdim=True).float()).double(), 0.0)
    return (torch.round((blocks.float() * inv.float()).double()) * d).view_as(x)


def _superblocks(out_f: int, in_f: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Q4_K-like factors per row: d and dmin float16 values [out, in / 256], 6-bit sc and m."""
    d, dmin = ((torch.rand(out_f, in_f // 256, generator=g) * 1e-3).half().float() for _ in range(2))
    sc, m = (torch.randint(0, 64, (out_f, in_f // 32), generator=g, dtype=torch.uint8) for _ in range(2))
    return d, dmin, sc, m


@pytest.mark.parametrize("shape", [(32, 256), (96, 512), (2048, 1536), (64, 8960)], ids=str)
@pytest.mark.parametrize("form", ["float32 factors", "Q4_K factors"])
def test_int8_activations_int4_kernel_is_the_product_over_rounded_x(shape, form) -> None:
    """One row with `int8_x`: the codes times x rounded to int8 per block (summed as integers,
    so exact), the minimum's term over x itself (its float sum): within float32 rounding of
    that product in float64. Measured 7e-8 to 9e-7 of max |y|; the rounding of x itself moves y
    by ~6e-3 of max |y| on these random inputs (the same order as torch's bfloat16 kernels).
    More rows: each the row's 1-row product, bit for bit."""
    out_f, in_f = shape
    g = torch.Generator().manual_seed(out_f + in_f)
    q = torch.randint(0, 16, shape, dtype=torch.uint8, generator=g)
    blocks = _superblocks(out_f, in_f, g) if form == "Q4_K factors" else None
    if blocks is None:
        scale, minimum = (
            torch.rand(out_f, in_f // 32, generator=g) * 0.01,
            -torch.rand(out_f, in_f // 32) * 0.08,
        )
    else:
        d, dmin, sc, m = blocks
        scale, minimum = d.repeat_interleave(8, 1) * sc.float(), -(dmin.repeat_interleave(8, 1) * m.float())
    part = Int4Part(q, scale, minimum, int8_x=True, superblocks=blocks)
    assert (part.multipliers is not None) == (blocks is not None)
    x = torch.randn(1, in_f, generator=g) * torch.rand(1, in_f, generator=g) * 4  # uneven blocks
    s64, m64 = (a.double().repeat_interleave(32, 1) for a in (scale, minimum))
    exact = _int8_x(x) @ (q.double() * s64).t() + x.double() @ m64.t()
    y = part.kernel(x)
    assert _close(y, exact) < TOL
    assert _close(y, x.double() @ (q.double() * s64 + m64).t()) > 10 * TOL  # x was rounded
    assert_rows_as_alone(part.kernel, torch.randn(11, in_f, generator=g))


@pytest.mark.parametrize("shape", [(5, 7), (40, 1536), (300, 8960)], ids=str)
def test_int8_activations_int8_kernel_is_the_product_over_rounded_x(shape) -> None:
    """The int8 part's 1-row product on int8 x: |code| times x carrying the code's sign
    (`maddubs`), within float32 rounding of the float64 product over the rounded x; inputs not a
    multiple of 32 keep float32 x. More rows: each the row's 1-row product, bit for bit."""
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    part = Int8Part.quantize(torch.randn(shape, generator=g), int8_x=True)
    x = torch.randn(1, shape[1], generator=g)
    w = part.codes.double() * part.scales.double()[:, None]
    rounded = _int8_x(x) if shape[1] % 32 == 0 else x.double()
    assert _close(part.kernel(x), rounded @ w.t()) < TOL
    if shape[1] % 32 == 0:
        assert_rows_as_alone(part.kernel, torch.randn(11, shape[1], generator=g))


def assert_rows_as_alone(kernel, x: torch.Tensor) -> None:
    """In a decode step (`qkernel.decode_step`) each row of an int8-x `kernel(x)` is `kernel` of
    that row alone, bit for bit (a sequence's decode does not depend on the batch it runs in);
    outside one (a prompt's rows) more rows keep float32 x, other numbers."""
    with qkernel.decode_step():
        y = kernel(x)
    for r in range(x.shape[0]):
        assert torch.equal(y[r : r + 1], kernel(x[r : r + 1])), r
    assert not torch.equal(kernel(x), y)


def test_q4k_factors_are_the_float32_ones_in_fewer_bytes() -> None:
    """A Q4_K tensor through `native_parts` holds its own factors (d, dmin per 256 inputs, sc and
    m per 32: 3 bytes per 32 weights instead of 8) whose products are exactly `affine_int4`'s
    scale and minimum, and its products match the float32-factor part's at 1-8 rows."""
    raw = _raw(Q.Q4_K, seed=22, shape=(64, 512))
    (part,) = quant.native_parts([raw], torch.float32, {})
    q, scale, minimum = (torch.from_numpy(a) for a in affine_int4(raw))
    plain = Int4Part(q, scale, minimum)
    assert part.multipliers is not None and plain.multipliers is None
    held = sum(t.numel() * t.element_size() for t in part.tensors()[1:])
    assert held * 8 == sum(t.numel() * t.element_size() for t in plain.tensors()[1:]) * 3
    for ours, theirs in zip(part.affine(), (scale.t(), minimum.t()), strict=True):
        assert torch.equal(ours, theirs)
    x = torch.randn(8, 512)
    for rows in (1, 3, 8):
        torch.testing.assert_close(part.kernel(x[:rows]), plain.kernel(x[:rows]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_prefill_blocks_are_torchs_unpacking_bit_for_bit(qtype: Q) -> None:
    """`qkernel.int4_dequantize` (prefill's blocks of a native part, over the factors it holds:
    float32 ones for Q4_1, Q4_K's own) gives `dequant.int4_block`'s floats over `affine()` exactly,
    block by block (a whole one of 256 rows and a partial one of 64), and so the same products:
    the faster path changes no number a prefill computes."""
    raw = _raw(qtype, seed=23, shape=(dequant.BLOCK_ROWS + 64, 512))
    (part,) = quant.native_parts([raw], torch.float32, {})
    assert part.native and (part.multipliers is not None) == (qtype == Q.Q4_K)
    scale, minimum = part.affine()
    for start in (0, dequant.BLOCK_ROWS):
        rows = min(dequant.BLOCK_ROWS, part.rows - start)
        ours = qkernel.int4_dequantize(
            part.packed, part.factors, part.multipliers, start, torch.empty(512, rows)
        )
        theirs = dequant.int4_block(part.packed, scale, minimum, start, rows, dequant.int4_layout())
        assert torch.equal(ours, theirs)
    x = torch.randn(dequant.INT4_MIN_ROWS + 3, 512)
    assert torch.equal(part(x), dequant.int4_product(x, part.packed, scale, minimum))


def test_the_kernel_is_more_exact_than_torchs_bfloat16_one() -> None:
    """The same Q4_K tensor through `qkernel` and through torch's kernel (its bfloat16 x,
    scales, zeros and output), both against the file's values in float64."""
    raw = _raw(Q.Q4_K, seed=21, shape=(128, 512))
    q, scale, minimum = (torch.from_numpy(a) for a in affine_int4(raw))
    x = torch.randn(1, 512)
    exact = x.double() @ _reference(raw).double().t()
    ours = _close(Int4Part(q, scale, minimum).kernel(x), exact)
    torchs = _close(Int4Part(q, scale, minimum, native=False).kernel(x), exact)
    assert ours < TOL and torchs > 10 * ours, (ours, torchs)


def test_the_custom_ops_run_inside_a_compiled_graph() -> None:
    """`compile_decode` traces the products: the ops have fake kernels, and the compiled
    function gives the eager numbers."""
    g = torch.Generator().manual_seed(3)
    int4 = Int4Part(
        torch.randint(0, 16, (64, 64), dtype=torch.uint8, generator=g), torch.rand(64, 2), -torch.rand(64, 2)
    )
    int8 = Int8Part.quantize(torch.randn(32, 64, generator=g))
    product = QuantProduct([int4, int8], torch.randn(96, generator=g), torch.float32)
    x = torch.randn(1, 64, generator=g)
    compiled = torch.compile(lambda v: torch.nn.functional.silu(product(v)), fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.nn.functional.silu(product(x)))


def test_without_the_kernel_parts_take_torchs_kernels(monkeypatch) -> None:
    """Where `qkernel` is unavailable, new parts hold torch's forms (bfloat16 scale and zero) and
    serve through its kernels: the numbers of a part built with native=False."""
    monkeypatch.setattr(qkernel, "available", lambda: False)
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (64, 96), dtype=torch.uint8, generator=g)
    scale, minimum = torch.rand(64, 3, generator=g) * 0.01, -torch.rand(64, 3, generator=g) * 0.1
    int4 = Int4Part(q, scale, minimum)
    int8 = Int8Part.quantize(torch.randn(32, 96, generator=g))
    assert not int4.native and not int8.native and len(int4.tensors()) == 2
    x = torch.randn(2, 96, generator=g)
    torch.testing.assert_close(int4(x), Int4Part(q, scale, minimum, native=False)(x))
    bf16 = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), int8.codes, int8.scales).float()
    torch.testing.assert_close(int8(x), bf16)


def test_no_compiler_means_torchs_kernels_and_one_log_line(monkeypatch, caplog, tmp_path) -> None:
    """A machine without a C compiler and without the library built (an empty kernel cache: a
    built one loads without a compiler, as in the container image): `library()` is None, saying
    why once, nothing raised."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("CHUNKCACHE_KERNEL_DIR", str(tmp_path))
    qkernel.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="chunkcache.model.kernels"):
            assert not qkernel.available() and not qkernel.available()
        lines = [r.getMessage() for r in caplog.records if "torch's bfloat16 kernels" in r.getMessage()]
        assert len(lines) == 1 and "/nonexistent/cc" in lines[0]
    finally:
        monkeypatch.undo()
        qkernel.cache_clear()
    assert qkernel.available()


def test_a_failing_build_is_reported_not_raised(monkeypatch, tmp_path, caplog) -> None:
    """A compiler that fails (here: a source it cannot compile) leaves torch's kernels serving,
    with the compiler's message in the log line; the cache directory holds no partial library."""
    bad = tmp_path / "qkernel.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(build, "SOURCE", bad)
    monkeypatch.setenv("CHUNKCACHE_KERNEL_DIR", str(tmp_path / "kernels"))
    qkernel.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="chunkcache.model.kernels"):
            assert qkernel.library() is None
        assert any("building qkernel.c failed" in r.getMessage() for r in caplog.records)
        assert not list((tmp_path / "kernels").glob("*.so"))
    finally:
        monkeypatch.undo()
        qkernel.cache_clear()


def test_the_library_is_cached_by_source_hash(monkeypatch, tmp_path) -> None:
    """Built once per source: a second process (here: a cleared cache) loads the same file."""
    monkeypatch.setenv("CHUNKCACHE_KERNEL_DIR", str(tmp_path))
    qkernel.cache_clear()
    try:
        assert qkernel.available()
        (built,) = tmp_path.glob("qkernel-*.so")
        stamp = built.stat().st_mtime_ns
        qkernel.cache_clear()
        assert qkernel.available() and built.stat().st_mtime_ns == stamp
    finally:
        monkeypatch.undo()
        qkernel.cache_clear()


def test_parts_with_a_partial_tile_keep_torchs_kernel() -> None:
    """The kernel reads whole tiles of 32 rows: 48 rows stay on torch's kernel."""
    q = torch.randint(0, 16, (48, 64), dtype=torch.uint8)
    part = Int4Part(q, torch.rand(48, 2), -torch.rand(48, 2))
    assert not part.native and not dequant.int4_blocks_apply(48)
    assert np.isfinite(part(torch.randn(1, 64)).numpy()).all()


def test_threads_split_output_rows_and_give_the_same_numbers() -> None:
    """The engine's thread count (torch's) is the kernel's OpenMP team: each output row is still
    one thread's sum in the same order, so the numbers are bit for bit the 1-thread ones."""
    g = torch.Generator().manual_seed(5)
    int4 = Int4Part(
        torch.randint(0, 16, (256, 128), dtype=torch.uint8, generator=g),
        torch.rand(256, 4),
        -torch.rand(256, 4),
    )
    int8 = Int8Part.quantize(torch.randn(300, 128, generator=g))
    x = torch.randn(3, 128, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [int4.kernel(x[:1]), int4.kernel(x), int8.kernel(x[:1]), int8.kernel(x)]
        torch.set_num_threads(2)
        two = [int4.kernel(x[:1]), int4.kernel(x), int8.kernel(x[:1]), int8.kernel(x)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


INT4_GGUF_CASES = [
    ("llama", Q.Q4_K, {"hidden_size": 256, "intermediate_size": 256}),
    ("qwen2", Q.Q4_1, {}),  # tied lm_head in int4, qkv bias
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "qtype", "overrides"), INT4_GGUF_CASES, ids=[f"{a}-{q.name}" for a, q, _ in INT4_GGUF_CASES]
)
def test_native_int4_decode_gives_transformers_greedy_tokens(
    checkpoint, tmp_path, monkeypatch, arch, qtype, overrides
):
    """End to end on a tiny GGUF whose projections are all 4-bit: served `native` in float32,
    every product of the prompt and the decode through `qkernel` (the blocks' thresholds raised),
    the greedy tokens are those of the same file loaded dense in float32, which is transformers'
    own GGUF dequantization (tests/test_gguf.py), and every step's top-5 log-probs are within
    float32 summation of it. Measured: no token changed; log-probs within 1.8e-5 / 8.8e-6
    (llama-Q4_K / qwen2-Q4_1), where torch's bfloat16 kernels (the same run without `qkernel`)
    moved them by 0.053 / 0.058 and changed a qwen2 token. With `int8_activations` the
    decode's rounded x moves them as the assertion below says."""
    from tests import test_gguf
    from tests.test_quant import _deviation, _generate_in_forms
    from tests.test_quant import _random_k_quant as small_k_quant

    for name in ("INT4_MIN_ROWS", "NATIVE_INT4_MIN_ROWS", "INT8_MIN_ROWS"):
        monkeypatch.setattr(dequant, name, 10**9)
    served = []
    monkeypatch.setattr(qkernel, "int4", lambda *a, f=qkernel.int4: served.append(1) or f(*a))
    src = checkpoint(arch=arch, tie_word_embeddings=arch == "qwen2", **overrides)
    monkeypatch.setattr(test_gguf, "_random_k_quant", lambda *a, **k: small_k_quant(*a, **{**k, "d": 1e-4}))
    test_gguf.write_gguf(src, tmp_path / "model.gguf", qtype)
    forms = [("dense", "float32", False), ("native", "float32", False), ("native", "float32", True)]
    outs, _ = _generate_in_forms(tmp_path, src, forms)
    assert served, "qkernel served no product"
    dense, native = outs["dense", "float32", False], outs["native", "float32", False]
    assert native.token_ids == dense.token_ids
    assert _deviation(native, dense) < 2e-4
    # int8 activations (decode's 1-row products on x rounded per block of 32): measured 0.005
    # (llama-Q4_K, no token changed) and 0.137 (qwen2-Q4_1, whose tied 64-wide lm_head is int4 too;
    # the 7th token of 8 changed at a near-tie); a misread code or factor moves them by units.
    int8_x = outs["native", "float32", True]
    assert int8_x.token_ids[0] == dense.token_ids[0]  # the prompt's float32 products
    assert _deviation(int8_x, dense) < 0.3
