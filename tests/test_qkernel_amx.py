"""Prefill's bfloat16 GEMMs on AMX tiles (chunkcache/model/kernels/qkernel_amx.c, `dequant.blockwise_product`).

Oracle: the float64 product of the same bfloat16 x and w, rounded to bfloat16 as torch's GEMM
rounds its float32 sums: the tiles' products of bfloat16 pairs are exact in float32, so only the
float32 summation order and the final rounding differ (measured: within one bfloat16 unit of the
rounded oracle, relative 2^-8, where a misplaced tile row or column is off by whole values).
"""

from __future__ import annotations

import pytest
import torch

from chunkcache.model import dequant
from chunkcache.model.kernels import qkernel
from chunkcache.model.kernels.quant_blocks import BlocksPart

pytestmark = pytest.mark.skipif(not qkernel.amx(), reason="no AMX-BF16 here (or the library does not build)")

gguf = pytest.importorskip("gguf")

from tests.test_qkernel_blocks import _blocks  # noqa: E402


def _oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).bfloat16()


def _within_a_unit(y: torch.Tensor, oracle: torch.Tensor) -> None:
    """Each output within one bfloat16 unit of the rounded oracle (float32 sums in another order
    can round the other way), against the scale of the sums for outputs that cancel."""
    scale = oracle.float().abs().max().item()
    torch.testing.assert_close(y.float(), oracle.float(), rtol=2**-7, atol=scale * 2**-12)


def _same_bits_on_two_threads(product, y: torch.Tensor) -> None:
    """`product()` on 2 threads gives y's bits (each C tile is one thread's sums)."""
    torch.set_num_threads(2)
    try:
        assert torch.equal(product().view(torch.int16), y.view(torch.int16))
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("m", [1, 16, 37])
def test_x_packed_as_the_tiles_b_operand(m: int) -> None:
    """`amx_pack`: per 16 rows (zero past m) and 32 inputs one tile, dword (p, j) = inputs 2p, 2p + 1
    of row j: x's dwords transposed per tile (the kernel transposes in registers)."""
    k = 96
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    tiles = -(-m // 16)
    padded = torch.zeros(16 * tiles, k, dtype=torch.bfloat16)
    padded[:m] = x
    expected = padded.view(torch.int32).reshape(tiles, 16, k // 32, 16).permute(0, 2, 3, 1).reshape(-1)
    assert torch.equal(qkernel.amx_pack(x), expected)


@pytest.mark.parametrize("m", [1, 15, 16, 17, 33, 100])
@pytest.mark.parametrize("k", [32, 1536, 1600, 3200])  # 1600, 3200: passes of 1,536 inputs and a rest
def test_product_is_the_rounded_float64_product(m: int, k: int) -> None:
    """x rows on both sides of a tile's 16 and of a pair's 32, inputs in one pass and in several;
    written into columns [32, 32 + n) of a wider output, the others untouched."""
    g = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(96, k, generator=g).bfloat16()
    out = torch.full((m, 160), 7.0, dtype=torch.bfloat16)
    qkernel.amx_product(qkernel.amx_pack(x), m, w, out, 32)
    _within_a_unit(out[:, 32:128], _oracle(x, w))
    assert (out[:, :32] == 7).all() and (out[:, 128:] == 7).all()


def test_threads_give_the_same_bits() -> None:
    x, w = torch.randn(37, 1600).bfloat16(), torch.randn(128, 1600).bfloat16()
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            out = torch.empty(37, 128, dtype=torch.bfloat16)
            qkernel.amx_product(qkernel.amx_pack(x), 37, w, out, 0)
            outs.append(out)
        finally:
            torch.set_num_threads(1)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q4_0"])
@pytest.mark.parametrize("m", [37, 100])
def test_a_prefill_straight_from_the_blocks_is_the_rounded_product(qtype: str, m: int) -> None:
    """Inputs within one pass (<= `AMX_ONE_PASS`): the blocks dequantized 32 rows at a time inside
    the kernel (`amx_blocks_product`): the rounded float64 product of x and the blocks' bfloat16
    weights, within a unit of torch's GEMM over the same weights, the same bits on 2 threads."""
    blocks, reference = _blocks((1344, 1536), seed=44 + m, qtype=qtype)
    part = BlocksPart(blocks, qtype)
    x = torch.randn(m, 1536, generator=torch.Generator().manual_seed(m)).bfloat16()
    assert qkernel.amx_blocks_take(qtype, blocks, 1536)
    y = part(x)
    _within_a_unit(y, _oracle(x, reference.bfloat16()))
    _within_a_unit(y, torch.nn.functional.linear(x, reference.bfloat16()))
    _same_bits_on_two_threads(lambda: part(x), y)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0"])
def test_a_prefill_over_dequantized_blocks_takes_the_tiles_and_agrees_with_torchs_gemm(
    qtype: str, monkeypatch
) -> None:
    """More inputs than a pass for a type in 16-row tiles (not `ROW_BLOCKS`): blocks dequantized
    whole rows at a time (several blocks and a rest, as `dequant.block_rows` cuts them), each
    multiplied on the tiles (`amx_product`, inputs in passes): the rounded float64 product, within
    a unit of torch's GEMM over the same blocks."""
    k = qkernel.AMX_ONE_PASS + 256
    blocks, reference = _blocks((1344, k), seed=45, qtype=qtype)
    part = BlocksPart(blocks, qtype)
    x = torch.randn(100, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert not qkernel.amx_blocks_take(qtype, blocks, k)
    monkeypatch.setattr(dequant, "BLOCK_BYTES", 512 * k * 2)  # blocks of 512, 512 and 320 rows
    calls = []
    original = qkernel.amx_product
    monkeypatch.setattr(qkernel, "amx_product", lambda *a: calls.append(a[2].shape[0]) or original(*a))
    on_tiles = part(x)
    assert calls == [512, 512, 320]
    _within_a_unit(on_tiles, _oracle(x, reference.bfloat16()))
    monkeypatch.setattr(qkernel, "amx", lambda: False)
    _within_a_unit(on_tiles, part(x).float().bfloat16())


def test_a_dense_bfloat16_part_takes_the_tiles_and_compiled_graphs_know() -> None:
    """A dense bfloat16 part (SmolLM2's tied lm_head under `weights native`) on the tiles: within a
    unit of torch's F.linear, for decode's one row and a prompt's many; `qkernel_ops` reports it, so
    `compile_decode` refuses to compile around the C call where such graphs aborted (a float32
    part and a shape the tiles do not take stay torch's)."""
    from chunkcache.model.quant import DensePart, QuantProduct

    g = torch.Generator().manual_seed(5)
    part = DensePart(torch.randn(320, 576, generator=g).bfloat16())
    assert part.on_tiles() and QuantProduct([part], None, torch.bfloat16).qkernel_ops()
    for rows in (1, 40):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        _within_a_unit(part(x), _oracle(x, part.weight))
        _within_a_unit(part(x), torch.nn.functional.linear(x, part.weight))
    for other in (DensePart(part.weight.float()), DensePart(part.weight[:300])):
        assert not other.on_tiles() and not QuantProduct([other], None, torch.bfloat16).qkernel_ops()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
@pytest.mark.parametrize(("m", "k"), [(5, 256), (33, 512), (100, 1536)])
def test_the_next_groups_rows_dequantized_between_the_tiles_products(qtype: str, m: int, k: int) -> None:
    """`amx_blocks_product` dequantizes the next 32 weight rows a row at a time between a group's
    tile products (`ROW_BLOCKS`: `pipeline`; a group with fewer chunk passes than rows finishes them
    after its products), else at once (Q4_1): every group's rows in place, threads splitting the
    groups (2 threads: 3 groups and 2), within a unit of the rounded float64 product."""
    blocks, reference = _blocks((160, k), seed=k + m, qtype=qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    assert qkernel.amx_blocks_take(qtype, blocks, k)
    y = qkernel.amx_blocks_product(x, qtype, blocks)
    _within_a_unit(y, _oracle(x, reference.bfloat16()))
    _same_bits_on_two_threads(lambda: qkernel.amx_blocks_product(x, qtype, blocks), y)


@pytest.mark.parametrize("qtype", qkernel.ROW_BLOCKS)
@pytest.mark.parametrize("k", [qkernel.AMX_ONE_PASS + 256, 2 * qkernel.AMX_ONE_PASS + 512])
def test_more_inputs_than_a_pass_straight_from_the_blocks(qtype: str, k: int) -> None:
    """The 1.5B's down (8,960 inputs, Q4_K or Q6_K) from its blocks: `amx_blocks_product` in
    passes of `AMX_ONE_PASS` inputs, each pass's rows dequantized a row at a time from within the
    row's blocks, partial sums in float32 between passes: the rounded float64 product, the same
    bits on 2 threads."""
    blocks, reference = _blocks((96, k), seed=k, qtype=qtype)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    assert qkernel.amx_blocks_take(qtype, blocks, k)
    y = BlocksPart(blocks, qtype)(x)
    _within_a_unit(y, _oracle(x, reference.bfloat16()))
    _same_bits_on_two_threads(lambda: qkernel.amx_blocks_product(x, qtype, blocks), y)
