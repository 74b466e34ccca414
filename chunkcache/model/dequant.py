"""Products of many rows over quantized weights (`--weights native` / `int8`): dense float32 GEMMs
over blocks of weight rows dequantized one at a time (a block's float32 buffer at most, 1.5-9 MB),
so no dense copy is ever whole.

torch's weight-only kernels (`model/quant.py`) are GEMV-shaped: at one row they beat a dense float32
product (fewer bytes streamed), but from ~64 rows on they run at 0.43-0.77x its speed
(benchmarks/history/RESULTS-narrative.md), which made native weights' prefill ~2x slower than dense.
Dequantizing a block of weight rows costs a few elementwise operations per weight, once per product,
whatever the number of rows it multiplies; the GEMM's cost grows with the rows. So from
`INT4_MIN_ROWS` / `INT8_MIN_ROWS` rows a product dequantizes `BLOCK_ROWS` weight rows at a time and
runs MKL's GEMM on them, as `model/upcast.py` does for bfloat16 weights on CPUs without a bfloat16
GEMM.

The int4 kernel's packed tensor is the only copy of the 4-bit codes held, so the blocks unpack it
directly: `int4_block` here in torch operations (~1 ns a weight, parts torch's kernel serves),
`qkernel.int4_dequantize` in C for the parts `qkernel` serves (the same floats, 0.2-0.8 ns a weight:
a prefill in pieces of 256 tokens dequantizes every weight once per piece, and the 1.5B's prefill
ran 20.6 -> 24.0 tokens/s of CPU with it, benchmarks/history/RESULTS-narrative.md);
`blockwise_product` multiplies either. Its nibble order is private to torch and differs per CPU
capability (in torch 2.13's `int4mm_kernel.cpp`: tiles of 32 output rows on AVX2, 64 on AVX512,
where a byte holds row `b` of the tile in its low nibble and row `b + tile / 2` in its high one, per
input column; tiles of 2 rows elsewhere), so it is not assumed: `int4_layout` packs probe codes once
and reads back which (row, column) each nibble holds, and a layout it does not recognise leaves
every product to the kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chunkcache.model.upcast import native_bf16_matmul

GROUP = 32  # inputs per int4 scale and zero (quant.GROUP; here to keep the import one way)

# From this many rows a quantized product takes the dequantized blocks; fewer keep the kernels.
# Measured on the 1.5B's shapes (benchmarks/bench_quant_kernels.py, AVX2 EPYC, one thread;
# benchmarks/history/RESULTS-narrative.md, "Native weights without the prefill penalty"): converting
# int8 codes is one cheap pass, and the int8 blocks beat the int8 kernel from 16 rows; unpacking
# int4 nibbles costs ~1-1.5 ns per weight, and the int4 blocks beat the int4 kernel from 64 rows (at
# 64 ahead in one run, 14% behind in another) and in every run from 80.
INT4_MIN_ROWS = 64
INT8_MIN_ROWS = 16
# The int4 parts `qkernel` serves dequantize in C (`qkernel.int4_dequantize`, 0.2-0.8 ns a weight),
# so their blocks win from fewer rows: a 1.5B prefill of 32 / 40 / 48 / 56 tokens ran 1.18x / 1.11x
# / 1.22x / 1.31x faster through them than through the kernel's calls of 8 rows (one process,
# alternated; benchmarks/history/RESULTS-narrative.md "Prefill's int4 blocks in C"); 24 rows
# measured a tie on gate/up and the kernel ahead on down. The bfloat16 blocks
# (`qkernel.int4_dequantize_bf16`, AMX / AVX512-BF16 CPUs, ~0.25 ns a weight) take the same
# threshold: at 64 rows of the 1.5B's gate/up they ran 15.6 ms against torch's int4 kernel's 39.8
# (benchmarks/history/RESULTS-narrative.md, "Native weights on a CPU with AMX").
NATIVE_INT4_MIN_ROWS = 32

# Weight rows per dequantized block at least (a multiple of every tile below): the float32 block
# is 1.5 MB at 1,536 inputs and 9 MB at 8,960, as in `upcast._UPCAST_ROWS`.
BLOCK_ROWS = 256
# ... and more rows up to this many bytes a block: the GEMM over a wider block runs faster on AMX
# (a 1.5B gate product of 268 bfloat16 rows, dequantization included: 13.9 ms in blocks of 256
# rows, 10.0 in 2,048, 11.4 in 1,024; q 2.5 -> 1.8 ms; of 100 rows 9.2 -> 6.5 ms), while float32
# GEMMs gained nothing and blocks of 1,024+ rows of down (8,960 inputs, 37+ MB) lost 30%.
BLOCK_BYTES = 6 << 20


def block_rows(n: int, cols: int, dtype: torch.dtype) -> int:
    """Rows of one dequantized block of a weight of `n` rows of `cols` inputs in `dtype`:
    `BLOCK_BYTES` worth in whole tiles of 64 rows, at least `BLOCK_ROWS`, at most `n`."""
    wide = BLOCK_BYTES // (cols * dtype.itemsize) // 64 * 64
    return min(n, max(BLOCK_ROWS, wide))


@dataclass(frozen=True)
class Int4Layout:
    """How `_convert_weight_to_int4pack_for_cpu` orders codes: the packed [N, K / 2] bytes hold
    tiles of `tile` output rows one after another; within a tile, byte `k * tile / 2 + b` holds
    input column k of two rows of the tile: `b` (low nibble) and `b + tile / 2` (high) when
    `halves`, else `2b` and `2b + 1`."""

    tile: int
    halves: bool

    def rows_of(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows within the tile of the low and high nibble of byte `b` of a column."""
        half = self.tile // 2
        return (b, b + half) if self.halves else (2 * b, 2 * b + 1)


_PROBE_ROWS, _PROBE_COLS = 256, 64


def _probe_map() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of the code each nibble of a packed probe holds, low then high nibbles, in
    the packed bytes' order: each code's index row * cols + col, sent 4 bits per packing."""
    index = torch.arange(_PROBE_ROWS * _PROBE_COLS).reshape(_PROBE_ROWS, _PROBE_COLS)
    low = torch.zeros(_PROBE_ROWS * _PROBE_COLS // 2, dtype=torch.long)
    high = torch.zeros_like(low)
    for digit in range(4):  # 256 * 64 = 2^14 codes: four 4-bit digits
        codes = ((index >> (4 * digit)) & 15).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2).reshape(-1).long()
        low |= (packed & 15) << (4 * digit)
        high |= (packed >> 4) << (4 * digit)
    return torch.stack([low // _PROBE_COLS, low % _PROBE_COLS]), torch.stack(
        [high // _PROBE_COLS, high % _PROBE_COLS]
    )


def _expected_map(layout: Int4Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """What `_probe_map` would read if the kernel packed codes as `layout` says."""
    half = layout.tile // 2
    byte = torch.arange(_PROBE_ROWS * _PROBE_COLS // 2)
    tile, within = byte // (_PROBE_COLS * half), byte % (_PROBE_COLS * half)
    col, b = within // half, within % half
    low, high = layout.rows_of(b)
    base = tile * layout.tile
    return torch.stack([base + low, col]), torch.stack([base + high, col])


@functools.cache
def int4_layout() -> Int4Layout | None:
    """The int4 kernel's packing on this CPU, read from a probe; None when it is none of the
    known ones (then the blocks are not used and every product runs the kernel)."""
    found = _probe_map()
    for tile in (64, 32, 16, 128, 2):
        for halves in (True, False):
            layout = Int4Layout(tile, halves)
            if all(torch.equal(f, e) for f, e in zip(found, _expected_map(layout), strict=True)):
                return layout
    return None


def int4_block(
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    start: int,
    rows: int,
    layout: Int4Layout,
) -> torch.Tensor:
    """Weight rows [start, start + rows) of an int4 part as float32 [in, rows] (the GEMM's B):
    w = s q + m with the part's float32 scale s and minimum m [groups, out] per group of 32
    inputs (`Int4Part.affine`: the weight its kernel multiplies by). The nibbles are put in row order as bytes first (a tile's row order
    is then a concatenation, or an interleave, of low and high nibbles), so the float32 passes
    run over rows of `rows` contiguous values: 1.0-1.1 ns per weight on the 1.5B's shapes,
    against 1.8-2.3 ns writing each nibble's floats to its row directly (16-value runs), and
    3.9 ns through torch.compile of the same steps (AVX2 EPYC, one thread)."""
    tile, half = layout.tile, layout.tile // 2
    cols, tiles = packed.shape[1] * 2, rows // tile
    nibbles = packed[start : start + rows].view(tiles, cols, half)
    low, high = nibbles & 15, nibbles >> 4
    codes = torch.cat([low, high], -1) if layout.halves else torch.stack([low, high], -1)
    out = torch.empty(cols, rows)
    out.view(cols, tiles, tile).copy_(codes.view(tiles, cols, tile).permute(1, 0, 2))
    s = scale[:, start : start + rows].unsqueeze(1)  # [groups, 1, rows]
    m = minimum[:, start : start + rows].unsqueeze(1)
    weight = out.view(cols // GROUP, GROUP, rows)
    torch.addcmul(m, weight, s, out=weight)
    return out


def int4_product(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> torch.Tensor:
    """float32 x [T, in] times an int4 part's weight (float32 `scale` and `minimum` [groups, out]),
    in dequantized blocks: float32 [T, out]. The part's rows must be whole tiles of
    `int4_layout()` (`int4_blocks_apply`)."""
    layout = int4_layout()
    assert layout is not None
    return blockwise_product(
        x, packed.shape[0], lambda start, rows: int4_block(packed, scale, minimum, start, rows, layout)
    )


def blockwise_product(x: torch.Tensor, n: int, block: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x [T, in] times a weight of `n` output rows that `block(start, rows)` gives `block_rows`
    rows at a time as the GEMM's B [in, rows] in x's dtype (a transposed [rows, in] view serves
    as well): [T, n] in x's dtype. A bfloat16 block that is such a view, of whole tiles of 32
    rows, is multiplied on AMX tiles where `qkernel.amx_takes` it (qkernel_amx.c says why), x packed for
    them once per product."""
    from chunkcache.model.kernels import qkernel  # qkernel imports this module

    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    step = block_rows(n, x.shape[1], x.dtype)
    amx = x.dtype == torch.bfloat16 and x.shape[1] % 32 == 0 and qkernel.amx()
    packed = qkernel.amx_pack(x.contiguous()) if amx else None
    for start in range(0, n, step):
        rows = min(step, n - start)
        b = block(start, rows)
        if packed is not None and qkernel.amx_takes(b.t()):
            qkernel.amx_product(packed, x.shape[0], b.t(), out, start)
        else:
            torch.mm(x, b, out=out[:, start : start + rows])
    return out


def int4_blocks_apply(rows: int) -> bool:
    """Whether an int4 part of `rows` output rows can take the blocks: a known packing of whole
    tiles (a partial last tile is packed another way, which the probe does not read)."""
    layout = int4_layout()
    return layout is not None and rows % layout.tile == 0


def int8_product(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [T, in] (float32, or bfloat16 where `bf16_gemm()`) times an int8 part's weight (codes
    [out, in] int8, one bfloat16 scale per row): the codes converted to x's dtype a block at a
    time (exactly: |code| <= 127 fits bfloat16), the scales applied to the output (one pass over
    [T, out] instead of one over the weight)."""
    n = codes.shape[0]
    buffer = torch.empty(block_rows(n, codes.shape[1], x.dtype), codes.shape[1], dtype=x.dtype)
    out = blockwise_product(x, n, lambda start, rows: buffer[:rows].copy_(codes[start : start + rows]).t())
    return out.mul_(scales.to(x.dtype))


@functools.cache
def bf16_gemm() -> bool:
    """Whether the CPU multiplies bfloat16 matrices natively (AMX, AVX512-BF16): then a prefill's
    products of a bfloat16 model run as bfloat16 GEMMs over bfloat16 blocks of the quantized
    weights, 4-7x the float32 GEMMs over float32 blocks there (benchmarks/history/
    RESULTS-narrative.md, "Native weights on a CPU with AMX")."""
    return native_bf16_matmul() is not None
