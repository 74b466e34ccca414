"""Q6_K, Q4_K and Q8_0 served as the file's own blocks (chunkcache/model/kernels/quant_blocks.py,
qkernel_q6k.c, qkernel_q4k.c, qkernel_q8_0.c).

Oracle: gguf's own dequantization of the same bytes (`Q6_K.dequantize_blocks`, Q8_0's), multiplied in
float64 here. The prefill dequantization must be it bit for bit; the products within float32
summation of it (the kernel's w are exactly gguf's values, so only the sums' rounding remains):
measured 7e-8 to 7e-7 of the largest |y| over the shapes and row counts below, against test_qkernel's
2e-5 (TOL), where a misread code or scale is off by ~1e-2 or more. With int8 x: the float64
product over x rounded as qkernel rounds it (`_int8_x`), measured <= 3.5e-7. Q8_0 the same way
(measured below in each test's docstring where it differs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from chunkcache.model import quant
from chunkcache.model.kernels import build, qkernel, quant_blocks
from chunkcache.model.kernels.quant_blocks import BlocksPart
from chunkcache.model.quant import Int4Part, Int8Part, QuantProduct

pytestmark = pytest.mark.skipif(
    not qkernel.blocks_available(), reason="qkernel unavailable here (no AVX2/FMA or no C compiler)"
)

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from tests.test_qkernel import TOL, _close, _int8_x, assert_rows_as_alone  # noqa: E402
from tests.test_quant import _raw, _reference  # noqa: E402

# (rows of the weight, inputs): one block, odd row counts, the 1.5B's down (8960 in) and o shapes.
SHAPES = [(1, 256), (33, 512), (40, 1536), (64, 8960)]
TYPES = ["Q6_K", "Q4_K", "Q8_0", "Q4_1", "Q4_0"]
TILED = list(qkernel.TILED)  # held in tiles of 16 rows (`qkernel.blocks_held`)
# Where d sits in each type's block (its float16 bytes).
_D_OFFSET = {"Q6_K": 208, "Q4_K": 0, "Q8_0": 0, "Q4_1": 0, "Q4_0": 0}


def _blocks(
    shape: tuple[int, int], seed: int, specials: bool = False, qtype: str = "Q6_K"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes of `qtype` (every code, and Q6_K's every int8 scale, -128 included) as the
    kernels hold them (`qkernel.blocks_held`: Q4_0 and Q4_1 regrouped in tiles of 16 rows, the rows
    then rounded up to whole tiles) and gguf's float32 weight of them. `specials`: d takes
    float16's edge values (zero, subnormals, negatives, the largest)."""
    if not qkernel.holds(qtype, shape[0]):
        shape = (-(-shape[0] // qkernel.TILE_ROWS) * qkernel.TILE_ROWS, shape[1])
    raw = _raw(Q[qtype], seed=seed, shape=shape)
    if specials:
        d = np.array([1e-4, 0.0, 6e-8, -6e-8, 3e-5, -1e-3, 2.0, -65504.0], np.float16)
        blocks = raw.data.reshape(-1, qkernel.BLOCK_TYPES[qtype][0])
        at = _D_OFFSET[qtype]
        blocks[:, at : at + 2] = np.resize(d, len(blocks)).view(np.uint8).reshape(-1, 2)
    held = qkernel.blocks_held(qtype, torch.from_numpy(raw.data.copy()).view(shape[0], -1))
    return held, _reference(raw)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("specials", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_is_ggufs_bit_for_bit(shape, specials, qtype) -> None:
    blocks, reference = _blocks(shape, seed=shape[0] + shape[1], specials=specials, qtype=qtype)
    ours = qkernel.blocks_dequantize(qtype, blocks)
    assert ours.dtype == torch.float32 and ours.shape == reference.shape
    assert torch.equal(ours.view(torch.int32), reference.view(torch.int32))
    # A row range into a given buffer (prefill's reused one; whole tiles where tiled): the same rows.
    half = (
        reference.shape[0] // 2 // qkernel.TILE_ROWS * qkernel.TILE_ROWS if qtype in TILED else shape[0] // 2
    )
    out = torch.empty(reference.shape[0] - half, shape[1])
    qkernel.blocks_dequantize(qtype, blocks[half:], out)
    assert torch.equal(out, reference[half:])
    # bfloat16 blocks (a native bfloat16 GEMM's): torch's rounding of gguf's values, bit for bit.
    ours = qkernel.blocks_dequantize(qtype, blocks, dtype=torch.bfloat16)
    assert torch.equal(ours.view(torch.int16), reference.bfloat16().view(torch.int16))


@pytest.mark.skipif(
    " avx512_bf16" not in Path("/proc/cpuinfo").read_text(), reason="the CPU has no AVX512-BF16"
)
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_bf16_dequantize_avx512_gives_the_avx2_paths_bits(qtype) -> None:
    """Prefill's bfloat16 blocks by AVX512-BF16 (`vcvtne2ps2bf16`, what serves on such CPUs, and
    what the test above checked against gguf there) and by the AVX2 path (the rounding in integers,
    what serves elsewhere): the same bits, d's edge values included, on 2 threads too."""
    import ctypes

    lib = build.loaded()[0]
    blocks, reference = _blocks((70, 1536), seed=43, specials=True, qtype=qtype)
    name = qtype.lower().replace("_", "")
    outs = [torch.empty(70, 1536, dtype=torch.bfloat16) for _ in range(2)]
    for fn, out in zip((f"{name}_dequantize_avx2", f"{name}_dequantize"), outs, strict=True):
        getattr(lib, fn)(ctypes.c_void_p(blocks.data_ptr()), 1536, 70, ctypes.c_void_p(out.data_ptr()), 2, 1)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert torch.equal(outs[1].view(torch.int16), reference.bfloat16().view(torch.int16))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 11])  # 11: two calls (8 + 3)
def test_float_x_products_against_float64_over_ggufs_weight(shape, rows, qtype) -> None:
    """Against the scale of the sums (max of |x| |w|), not of |y|: a single output (1 x 256) can
    cancel to near zero, where any float32 summation is relatively far off."""
    blocks, reference = _blocks(shape, seed=3 * shape[0] + rows, qtype=qtype)
    part = BlocksPart(blocks, qtype)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    y = part.kernel(x)
    assert y.dtype == torch.float32 and y.shape == (rows, reference.shape[0])
    w = reference.double()
    scale = (x.double().abs() @ w.abs().t()).max()
    assert ((y.double() - x.double() @ w.t()).abs().max() / scale).item() < TOL


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_x_is_the_product_over_x_rounded_per_block(shape, qtype) -> None:
    """One row with `int8_x`: integer sums of the codes against x rounded to int8 per block of 32
    (the -32 offset through sums of the rounded x), within float32 rounding of that product in
    float64; x was rounded (float x's product is further off); more rows (11: two calls) each the
    row's 1-row product, bit for bit."""
    blocks, reference = _blocks(shape, seed=shape[1] - shape[0], specials=True, qtype=qtype)
    g = torch.Generator().manual_seed(shape[0])
    x = torch.randn(1, shape[1], generator=g) * torch.rand(1, shape[1], generator=g) * 4  # uneven blocks
    part = BlocksPart(blocks, qtype, int8_x=True)
    y, w = part.kernel(x), reference.double()
    assert _close(y, _int8_x(x) @ w.t()) < TOL
    assert _close(y, x.double() @ w.t()) > 10 * TOL
    assert_rows_as_alone(part.kernel, torch.randn(11, shape[1], generator=g))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("below", [1, 0, -114])  # the threshold's row count minus this
def test_products_of_many_rows_take_the_blocks(below, qtype) -> None:
    """From the format's `min_rows` rows, GEMMs over dequantized blocks (a whole block of 256
    weight rows and a partial one): float32 x times gguf's weight up to the GEMM's summation order."""
    min_rows = quant_blocks.BLOCK_FORMATS[qtype].min_rows
    tokens = min_rows - below
    blocks, reference = _blocks((320, 512), seed=tokens, qtype=qtype)
    x = torch.randn(tokens, 512)
    y = BlocksPart(blocks, qtype)(x)
    assert _close(y, x.double() @ reference.double().t()) < TOL
    if tokens >= min_rows:
        torch.testing.assert_close(y, x @ reference.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", TYPES)
def test_bfloat16_prefill_multiplies_bfloat16_blocks(monkeypatch, qtype) -> None:
    """A bfloat16 x of many rows where the CPU multiplies bfloat16 natively: bfloat16 GEMMs over
    the blocks rounded to bfloat16, the GEMM a whole bfloat16 weight would run (the same numbers up
    to its blocking: bfloat16's rounding of the sums, measured exact here); without a native
    GEMM, float32 blocks rounded once to bfloat16."""
    from chunkcache.model import dequant

    blocks, reference = _blocks((320, 512), seed=37, qtype=qtype)
    x = torch.randn(40, 512).bfloat16()
    for native in (True, False):
        monkeypatch.setattr(dequant, "bf16_gemm", lambda native=native: native)
        y = BlocksPart(blocks, qtype)(x)
        assert y.dtype == torch.bfloat16
        expected = x @ reference.bfloat16().t() if native else (x.float() @ reference.t()).bfloat16()
        torch.testing.assert_close(y, expected, rtol=1.6e-2, atol=1e-2)


def test_native_parts_hold_q6k_as_its_blocks_with_no_error() -> None:
    """With int8 activations a Q6_K tensor takes `BlocksPart` (the file's bytes, 210 per 256 weights:
    ~18% fewer than int8 per channel's codes and scales), and the load's report says no
    re-quantization error."""
    raw = _raw(Q.Q6_K, seed=30, shape=(96, 1536))
    report: dict[str, quant.Conversion] = {}
    (part,) = quant.native_parts([raw], torch.float32, report, int8_x=True)
    assert part.int8_x
    assert isinstance(part, BlocksPart) and part.qtype == "Q6_K" and part.rows == 96
    assert part.blocks.numpy().tobytes() == raw.data.tobytes()
    assert report["Q6_K"].error == 0.0 and report["Q6_K"].tensors == 1 and "own blocks" in report["Q6_K"].form
    held = sum(t.numel() * t.element_size() for t in part.tensors())
    int8 = sum(t.numel() * t.element_size() for t in Int8Part.of_raw(raw).tensors())
    assert held == 96 * 1536 * 210 // 256 and held < 0.83 * int8


@pytest.mark.parametrize("case", ["float32 x", "no qkernel"])
def test_float_x_or_no_kernel_keeps_q6k_int8(monkeypatch, case) -> None:
    """Float32 activations (the default): int8 per channel, whose float x kernel measured faster
    (`quant_blocks.own_blocks`); without `qkernel`, int8 whatever the activations."""
    if case == "no qkernel":
        monkeypatch.setattr(qkernel, "blocks_available", lambda: False)
    report: dict[str, quant.Conversion] = {}
    (part,) = quant.native_parts([_raw(Q.Q6_K, seed=31)], torch.float32, report, int8_x=case == "no qkernel")
    assert isinstance(part, Int8Part) and report["Q6_K"].error > 0


@pytest.mark.parametrize("int8_x", [True, False], ids=["int8-x", "float-x"])
def test_a_merged_projection_of_q4k_and_q6k(int8_x) -> None:
    """The 1.5B's q/k/v: Q4_K q and k, a Q6_K v: with int8 activations each type's blocks (one part
    a type), else q and k one int4 part and v int8 per channel; outputs concatenated; within float32
    summation of the file's weights at 40 rows (prefill's dequantized blocks, float32 x); with int8
    x, at 1 row and a decode step's 3 (the kernels) every row is the product over x rounded."""
    raws = [_raw(Q.Q4_K, 32, (64, 512)), _raw(Q.Q4_K, 33, (32, 512)), _raw(Q.Q6_K, 34, (32, 512))]
    parts = quant.native_parts(raws, torch.float32, {}, int8_x=int8_x)
    kinds = [BlocksPart, BlocksPart] if int8_x else [Int4Part, Int8Part]
    assert [type(p) for p in parts] == kinds and [p.rows for p in parts] == [96, 32]
    bias = torch.randn(128)
    product = QuantProduct(parts, bias, torch.float32)
    assert product.describe() == ("q4_k+q6_k" if int8_x else "int4+int8")
    w = torch.cat([_reference(r) for r in raws]).double()
    if not int8_x:
        return
    x = torch.randn(40, 512)
    assert _close(product(x), x.double() @ w.t() + bias.double()) < TOL
    for rows in (1, 3):  # 3: a decode step's rows
        x = torch.randn(rows, 512)
        with qkernel.decode_step():
            assert _close(product(x), _int8_x(x) @ w.t() + bias.double()) < TOL


@pytest.mark.parametrize("qtype", TYPES)
def test_threads_split_output_rows_and_give_the_same_numbers(qtype) -> None:
    blocks, _ = _blocks((304, 512), seed=35, qtype=qtype)
    x = torch.randn(3, 512)
    float_x, int8_x = BlocksPart(blocks, qtype), BlocksPart(blocks, qtype, int8_x=True)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append([float_x.kernel(x[:1]), float_x.kernel(x), int8_x.kernel(x[:1])])
            results[-1].append(qkernel.blocks_dequantize(qtype, blocks))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() == "AVX512",
    reason="known bug: with torch's AVX512 kernels (the AMX Xeon) a graph compiled around the op "
    "aborts in glibc's heap checks, ~1 run in 2, in any block type (docs/operations.md)",
)
@pytest.mark.parametrize("qtype", TYPES)
def test_the_custom_op_runs_inside_a_compiled_graph(qtype) -> None:
    """In the forms served (Q6_K and Q4_K: with int8 x)."""
    blocks, _ = _blocks((64, 256), seed=36, qtype=qtype)
    product = QuantProduct(
        [BlocksPart(blocks, qtype, int8_x=qtype != "Q8_0")], torch.randn(64), torch.float32
    )
    x = torch.randn(1, 256)
    compiled = torch.compile(lambda v: torch.nn.functional.silu(product(v)), fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.nn.functional.silu(product(x)))


# qwen2: tied, one copy of the blocks for both; Q4_1: in tiles (SmolLM2's file's type)
E2E_CASES = [("Q6_K", "llama"), ("Q8_0", "qwen2"), ("Q4_1", "llama")]


@pytest.mark.slow
@pytest.mark.parametrize("int8_x", [False, True], ids=["float-x", "int8-x"])
@pytest.mark.parametrize("prefill", ["kernel", "blocks"])
@pytest.mark.parametrize(("qtype", "arch"), E2E_CASES, ids=[q for q, _ in E2E_CASES])
def test_native_blocks_decode_gives_transformers_greedy_tokens(
    checkpoint, tmp_path, monkeypatch, qtype, arch, prefill, int8_x
):
    """End to end on a tiny GGUF whose projections and embedding are all Q6_K (or Q8_0, with a
    tied lm_head), served `native` in float32 as its own blocks (with float32 x too, `own_blocks`
    forced for Q6_K: the kernel's float path end to end): every decode product through
    `qkernel.blocks_rows` / `blocks_product`, the prompt's too (`kernel`) or
    through the dequantized blocks (`blocks`). With float32 x the greedy tokens are those of the
    same file loaded dense in float32 (transformers' own GGUF dequantization, tests/test_gguf.py)
    and every step's top-5 log-probs within float32 summation of it: measured 5.6e-5 (`kernel`)
    and 2.8e-5 (`blocks`), where int8 per channel (today's float x form) moves them by 0.57 on the
    same random file. With int8 x the decode's rounded x moves them: measured 0.62 (both), int8
    per channel with int8 x 1.07; the first token (the prompt's float32 products) unchanged.
    Q8_0: 2.0e-5 / 2.3e-5 with float32 x, 0.23 with int8 x."""
    from tests import test_gguf
    from tests.test_quant import _deviation, _generate_in_forms
    from tests.test_quant import _random_k_quant as small_k_quant

    form = quant_blocks.BLOCK_FORMATS[qtype]
    threshold = 2 if prefill == "blocks" else 10**9
    monkeypatch.setitem(quant_blocks.BLOCK_FORMATS, qtype, dataclasses.replace(form, min_rows=threshold))
    monkeypatch.setattr(quant_blocks, "own_blocks", lambda qtype, int8_x: qtype in TYPES)
    served, blocks = [], []
    for name, f in (("blocks_product", qkernel.blocks_product), ("blocks_rows", qkernel.blocks_rows)):
        monkeypatch.setattr(qkernel, name, lambda *a, f=f: served.append(1) or f(*a))  # any rows; decode's
    monkeypatch.setattr(quant_blocks, "product", lambda *a, f=quant_blocks.product: blocks.append(1) or f(*a))
    src = checkpoint(arch=arch, hidden_size=256, intermediate_size=256, tie_word_embeddings=arch == "qwen2")
    monkeypatch.setattr(test_gguf, "_random_k_quant", lambda *a, **k: small_k_quant(*a, **{**k, "d": 1e-4}))
    test_gguf.write_gguf(src, tmp_path / "model.gguf", Q[qtype])
    outs, model = _generate_in_forms(tmp_path, src, [(w, "float32", int8_x) for w in ("dense", "native")])
    dense, native = outs["dense", "float32", int8_x], outs["native", "float32", int8_x]
    assert all(
        type(p) is BlocksPart and p.qtype == qtype
        for m in model.modules()
        if hasattr(m, "quant") and m.quant
        for p in m.quant.parts
    )
    assert served and bool(blocks) == (prefill == "blocks")
    deviation = _deviation(native, dense)
    if not int8_x:
        assert native.token_ids == dense.token_ids
        assert deviation < 2e-4
    else:  # the prompt's float32 products give the first token
        assert native.token_ids[0] == dense.token_ids[0]
        assert deviation < 0.8


def test_the_model_identity_binds_the_native_forms(monkeypatch) -> None:
    """Q6_K's form changed its numbers (int8 per channel -> the file's blocks), so the KV of a
    native model changed: the identity the KV tiers key entries by names the forms' version, and
    a dense model's identity ignores it."""
    from chunkcache.chunk.tiers.identity import model_identity

    model = torch.nn.Linear(4, 4)
    ids = {}
    for form in ("native", "dense"):
        model.weights_form = form
        ids[form] = model_identity(model, None, "m")
        monkeypatch.setattr(qkernel, "FORMS_VERSION", qkernel.FORMS_VERSION + "-next")
        assert (model_identity(model, None, "m") != ids[form]) == (form == "native")
        monkeypatch.undo()


@pytest.mark.skipif(" avx_vnni" not in Path("/proc/cpuinfo").read_text(), reason="the CPU has no AVX-VNNI")
def test_q4k_vnni_build_gives_the_avx2_builds_bits() -> None:
    """Q4_K's int8-x product by AVX-VNNI's `dpbusd` (served where the CPU has it) and by AVX2's
    `maddubs` + `madd`: the same int32 lanes, so the same bits, for 1-4 rows and 2 threads."""
    import ctypes

    lib = build.loaded()[0]
    blocks, _ = _blocks((96, 1536), seed=38, specials=True, qtype="Q4_K")
    p, i = ctypes.c_void_p, ctypes.c_int
    for rows in (1, 3, 4):
        x = torch.randn(rows, 1536) * 3
        ys = [torch.empty(rows, 96) for _ in range(2)]
        for name, y in zip(("q4k_rows_q8", "q4k_vnni_rows_q8"), ys, strict=True):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [p, i, i, i, p, p, i], None
            fn(x.data_ptr(), rows, 1536, 96, blocks.data_ptr(), y.data_ptr(), 2)
        assert torch.equal(ys[0], ys[1])
        with qkernel.decode_step():  # what serves: the VNNI build, every row rounded
            assert torch.equal(BlocksPart(blocks, "Q4_K", int8_x=True).kernel(x), ys[1])


@pytest.mark.skipif(
    " avx512f" not in Path("/proc/cpuinfo").read_text()
    or " avx512bw" not in Path("/proc/cpuinfo").read_text(),
    reason="the CPU has no AVX512",
)
def test_q4_1_avx512_build_gives_the_avx2_builds_bits() -> None:
    """Q4_1's tiles by AVX512 (a tile a vector: what serves where the CPU has it) and by AVX2 (half a
    tile a vector): each lane's operations in the same order, so the same bits, for 1 row (the
    factored form) and 3-8 rows (runs of 4 and of 2 rows)."""
    import ctypes

    lib = build.loaded()[0]
    blocks, _ = _blocks((96, 1536), seed=46, specials=True, qtype="Q4_1")
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.q4_1_product_isa.argtypes, lib.q4_1_product_isa.restype = [p, i, i, i, p, p, i], None
    for rows in (1, 3, 5, 8):
        x = torch.randn(rows, 1536) * 3
        ys = [torch.empty(rows, 96) for _ in range(2)]
        for avx512, y in enumerate(ys):
            lib.q4_1_product_isa(x.data_ptr(), rows, 1536, 96, blocks.data_ptr(), y.data_ptr(), avx512)
        assert torch.equal(ys[0], ys[1])
        assert torch.equal(BlocksPart(blocks, "Q4_1").kernel(x), ys[1])


@pytest.mark.parametrize("qtype", TYPES)
def test_a_bfloat16_decode_row_is_the_float32_products_rounding(qtype) -> None:
    """A bfloat16 x of 1-5 rows (a bfloat16 model's decode step) goes to C as it is and comes back
    bfloat16 (`blocks_rows`, `blocks_product_bf16`): bit for bit the float32 product of x widened,
    rounded by torch's `.to(torch.bfloat16)`; in `BlocksPart`'s call, with int8 x too."""
    blocks, _ = _blocks((96, 512), seed=47, qtype=qtype)
    g = torch.Generator().manual_seed(47)
    for rows in (1, 3, 5):  # below every type's `bf16_min_rows` (from there: the GEMM)
        x = (torch.randn(rows, 512, generator=g) * 2).bfloat16()
        for int8_x in (False, True):
            part = BlocksPart(blocks, qtype, int8_x=int8_x)
            y = part(x)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
            expected = qkernel.blocks_product(x.float(), qtype, blocks, int8_x).bfloat16()
            assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_a_bfloat16_rows_epilogue_is_torchs(qtype) -> None:
    """A `Linear`'s residual add and SwiGLU done in the product's call (`blocks_rows(residual=,
    gated=)`, `QuantProduct.with_epilogue`) against torch's operators on the call's plain output:
    the residual bit for bit (one bfloat16 sum), SwiGLU within one bfloat16 unit and rarely (its
    exponential is not torch's: measured 0 of these 528 outputs, both types); and a `Linear` takes them."""
    blocks, _ = _blocks((96, 512), seed=53, qtype=qtype)
    g = torch.Generator().manual_seed(53)
    differing = 0
    for rows in (1, 3, 5):  # below `bf16_min_rows`: the rows' path
        x = (torch.randn(rows, 512, generator=g) * 2).bfloat16()
        plain = qkernel.blocks_rows(x, qtype, blocks)
        residual = (torch.randn(rows, 96, generator=g) * 3).bfloat16()
        summed = qkernel.blocks_rows(x, qtype, blocks, residual=residual)
        assert torch.equal(summed.view(torch.int16), (plain + residual).view(torch.int16))
        gate, up = plain.split(48, dim=-1)
        gated = qkernel.blocks_rows(x, qtype, blocks, gated=True)
        expected = torch.nn.functional.silu(gate) * up
        ulps = (gated.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
        bad = ulps > 1
        assert ulps.max() <= 1, (gated[bad], expected[bad], gate[bad], up[bad])
        differing += int((ulps > 0).sum())
    assert differing <= 0.01 * 9 * 48

    from chunkcache.model.linear import Linear
    from chunkcache.model.quant import QuantProduct

    for gated_linear, res in ((True, None), (False, residual)):
        linear = Linear(512, 96, bias=False, gated=gated_linear)
        linear.quant = QuantProduct([BlocksPart(blocks, qtype)], None, torch.bfloat16)
        want = gated if gated_linear else summed
        assert torch.equal(linear(x, res).view(torch.int16), want.view(torch.int16))


def test_native_parts_hold_q4_1_in_tiles_where_they_serve(monkeypatch) -> None:
    """Where `own_blocks` takes Q4_1 (torch's int4 kernel would serve it, the tiles' AVX512 build
    runs) a tensor of whole tiles is held as the file's bytes regrouped, with no conversion error
    (gguf's weights bit for bit); elsewhere int4 in torch's packing."""
    monkeypatch.setattr(quant_blocks, "own_blocks", lambda qtype, int8_x: qtype == "Q4_1")
    report: dict[str, quant.Conversion] = {}
    raw = _raw(Q.Q4_1, seed=48, shape=(48, 576))
    (part,) = quant.native_parts([raw], torch.bfloat16, report)
    assert isinstance(part, BlocksPart) and part.qtype == "Q4_1" and report["Q4_1"].error == 0.0
    assert part.blocks.numel() == raw.data.size and not torch.equal(
        part.blocks.flatten(), torch.from_numpy(raw.data).flatten()
    )
    assert torch.equal(part.dequantize(), _reference(raw))
    monkeypatch.setattr(quant_blocks, "own_blocks", lambda qtype, int8_x: False)
    (part,) = quant.native_parts([raw], torch.bfloat16, {})
    assert isinstance(part, Int4Part)
