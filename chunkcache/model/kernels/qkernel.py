"""Decode's few-row products over quantized weights in float32, by a small AVX2 + FMA kernel
(`qkernel.c`) compiled on first use: what `weights native` / `int8` serve at 1-8 rows.

torch's weight-only CPU kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) take bfloat16
activations, bfloat16 scales and zeros, and on one AVX2 EPYC core read the 1.5B's codes at ~4.8
GB/s, where one core streams 13-16 GB/s: they are bound by their arithmetic, not by the bytes
(benchmarks/history/RESULTS-narrative.md, "A float32 AVX2 kernel for decode"). This one reads the
same codes (torch's own int4 packing, so prefill's dequantized blocks and the held bytes are
unchanged; the int8 codes and bfloat16 scales as they are), with float32 activations and float32
int4 scales and minimums (the file's values exactly, no bfloat16 rounding), and factors a group's
minimum out of a 1-row product: sum(x (s q + m)) = s sum(x q) + m sum(x), one conversion and one FMA
per code.

The library is built and loaded by `build` (the C sources beside this module, cached by their
hash); calls go to it directly with ctypes where eager, and as torch custom ops
(`torch.ops.chunkcache.int4_product` / `int8_product`) where a decode graph is compiled. ctypes over
`cpp_extension.load_inline`: a plain C file with no torch headers builds in seconds (load_inline's
build was not measured). It serves only where the CPU has AVX2, FMA and F16C, the library is built
(or the compiler works) and torch packs int4 as the kernel reads it (`dequant.int4_layout()`: tiles
of 32 rows, halves); elsewhere `available()` is False, one log line says why, and torch's kernels
serve as before. The GGUF block types' tables are `block_types`; a weight held as its blocks,
`quant_blocks.BlocksPart`.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import logging
from collections.abc import Callable, Iterator

import torch

from chunkcache.model import dequant
from chunkcache.model.kernels import build
from chunkcache.model.kernels.block_types import (
    BLOCK_CODES,
    BLOCK_FUNCTIONS,
    BLOCK_TYPES,
    ROW_BLOCKS,
    TILE_ROWS,
    TILED,
)
from chunkcache.model.upcast import native_bf16_matmul

logger = logging.getLogger(__name__)

MAX_ROWS = 8  # qkernel.c's MAX_ROWS: the most rows of x one call takes
TILE = 32  # output rows per int4 tile (torch's AVX2 packing)
TILE_BF16 = 64  # the same in torch's AVX512 packing, which `int4_dequantize_bf16` reads
# What the native forms `qkernel` serves are, bound into the model identity (chunk/tiers/identity.py):
# a change of a native weight's numbers changes the KV (Q6_K: int8 re-quantized per channel, then
# the file's own blocks, exactly; int8 x for every row of a decode step, where 2+ rows had float32
# x), so KV stored under the old forms is never loaded.
FORMS_VERSION = (
    "int4-q4k-factors;int8;q6k-blocks-with-int8-x;q8_0-blocks;int8-x-decode-rows;q4k-blocks-with-int8-x;"
    "blocks-bf16-prefill;q4_0-q4_1-tiles"
)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel where it serves decode's products (torch packs int4 in the tiles of 32
    rows it reads), or None (logged once with the reason)."""
    lib, reason = build.loaded()
    layout = dequant.int4_layout()
    if reason is None and layout != dequant.Int4Layout(TILE, True):
        reason = f"torch packs int4 as {layout}, not the tiles of {TILE} rows the kernel reads"
    if reason is None:
        return lib
    logger.info("quantized products: torch's bfloat16 kernels serve decode (%s)", reason)
    return None


@functools.cache
def bf16_blocks() -> bool:
    """Whether prefill's int4 blocks are written in bfloat16 for the CPU's native bfloat16 GEMM
    (`qkernel_bf16.c`): the library builds, torch packs int4 in its AVX512 tiles of 64 rows (where
    its own kernel serves decode) and the CPU multiplies bfloat16 matrices natively. Logged once."""
    lib = build.loaded()[0]
    native = native_bf16_matmul()
    serves = (
        lib is not None
        and dequant.int4_layout() == dequant.Int4Layout(TILE_BF16, True)
        and native is not None
    )
    if serves:
        logger.info("quantized products: prefill's int4 blocks in bfloat16 for the CPU's %s GEMM", native)
    return serves


@functools.cache
def blocks_available() -> bool:
    """Whether the file's own blocks (`BLOCK_TYPES`: qkernel_q6k.c, qkernel_q4k.c, qkernel_q8_0.c)
    can be served: wherever the library builds, whatever torch's int4 packing (they read none of
    it). Logged once where not."""
    lib, reason = build.loaded()
    if lib is None:
        logger.info("quantized products: no GGUF blocks served as they are (%s)", reason)
    return lib is not None


@functools.cache
def amx() -> bool:
    """Whether prefill's bfloat16 GEMMs over dequantized blocks run on AMX tiles (`qkernel_amx.c`):
    the library builds with them (a compiler with AMX's intrinsics), the CPU has AMX-BF16 and the
    OS lets this process use the tiles. Logged once where they serve."""
    lib = build.loaded()[0]
    serves = lib is not None and hasattr(lib, "amx_ready") and lib.amx_ready() == 1
    if serves:
        logger.info("quantized products: prefill's bfloat16 blocks multiplied on AMX tiles")
    return serves


def amx_pack(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 x [m, k] (k a multiple of 32) as the tiles' B operand (`amx_pack_x`), for every
    block of one product."""
    lib = build.loaded()[0]
    assert lib is not None and x.dtype == torch.bfloat16 and x.is_contiguous() and x.shape[1] % 32 == 0
    m, k = x.shape
    packed = torch.empty((m + 15) // 16 * 16 * k // 2, dtype=torch.int32)
    lib.amx_pack_x(x.data_ptr(), m, k, packed.data_ptr())
    return packed


def amx_product(packed: torch.Tensor, m: int, w: torch.Tensor, out: torch.Tensor, start: int) -> None:
    """out[:, start : start + rows] = x w^T for the x `packed` holds (`amx_pack`, m rows) and a
    bfloat16 block of weight rows w [rows, k] (rows a multiple of 32), out bfloat16 [m, n]."""
    lib = build.loaded()[0]
    assert lib is not None and w.dtype == out.dtype == torch.bfloat16
    assert w.is_contiguous() and out.is_contiguous() and w.shape[0] % 32 == 0 and out.shape[0] == m
    assert start + w.shape[0] <= out.shape[1] and packed.numel() == (m + 15) // 16 * 16 * w.shape[1] // 2
    lib.amx_product(
        packed.data_ptr(), m, w.shape[1], w.data_ptr(), w.shape[0], out.data_ptr() + 2 * start, out.shape[1],
        torch.get_num_threads(),
    )  # fmt: skip


AMX_ONE_PASS = 1536  # qkernel_amx.c's KSEG: inputs in one pass of `amx_blocks_product`


def amx_blocks_take(qtype: str, blocks: torch.Tensor, k: int) -> bool:
    """Whether `amx_blocks_product` takes a weight of `qtype`'s blocks with k inputs: where the tiles
    serve, rows a multiple of 32 and k of 32; more than `AMX_ONE_PASS` inputs for `ROW_BLOCKS` only."""
    fits = k <= AMX_ONE_PASS or qtype in ROW_BLOCKS
    return qtype in BLOCK_CODES and blocks.shape[0] % 32 == 0 and k % 32 == 0 and fits and amx()


def amx_blocks_product(x: torch.Tensor, qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    """bfloat16 x [m, k] times a weight held as `qtype`'s blocks [n, bytes a row] on the tiles, each
    32 weight rows dequantized into an L2-sized scratch (the next ones between their products)
    and multiplied at once, in passes of `AMX_ONE_PASS` inputs (`amx_blocks_take`):
    [m, n] bfloat16."""
    lib = build.loaded()[0]
    m, k = x.shape
    assert (
        lib is not None
        and x.dtype == torch.bfloat16
        and blocks.is_contiguous()
        and amx_blocks_take(qtype, blocks, k)
    )
    assert k == _columns(qtype, blocks)
    packed = amx_pack(x.contiguous())
    out = torch.empty(m, blocks.shape[0], dtype=torch.bfloat16)
    lib.amx_blocks_product(
        BLOCK_CODES[qtype], packed.data_ptr(), m, k, blocks.data_ptr(), blocks.shape[1], blocks.shape[0],
        out.data_ptr(), out.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return out


def amx_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bfloat16 x [m, k] times a dense bfloat16 weight w [n, k] on the tiles: x w^T [m, n]."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    amx_product(amx_pack(x.contiguous()), x.shape[0], w, out, 0)
    return out


def amx_takes(w: torch.Tensor) -> bool:
    """Whether `amx_matmul` takes the weight w (with a bfloat16 x): bfloat16, contiguous [n, k]
    with n and k multiples of 32, where the tiles serve."""
    return (
        w.dtype == torch.bfloat16
        and w.dim() == 2
        and w.is_contiguous()
        and w.shape[0] % 32 == 0
        and w.shape[1] % 32 == 0
        and amx()
    )


def cache_clear() -> None:
    """Forget the loaded library and what it serves (tests: another compiler or directory)."""
    for cached in (build.loaded, library, bf16_blocks, blocks_available, amx):
        cached.cache_clear()


def available() -> bool:
    return library() is not None


# Whether the products being computed are a decode step's (each row one sequence's new token):
# `int8_x` then rounds every row, each to the bits of its 1-row product (a sequence's decode does
# not depend on its batch: fusion's 4-5 streams, a busy server's batch), where float32 x for 2-8
# rows cost ~5x a 1-row step. Elsewhere (a prompt's rows) only a 1-row product takes int8 x: on
# prompts of 30-40 tokens it moved SmolLM2's greedy tokens (tests/test_quant.py).
_DECODE_STEP = contextvars.ContextVar("qkernel_decode_step", default=False)


@contextlib.contextmanager
def decode_step(active: bool = True) -> Iterator[None]:
    """Products inside are a decode step's, where `active` (`engine/runner.py`)."""
    token = _DECODE_STEP.set(active)
    try:
        yield
    finally:
        _DECODE_STEP.reset(token)


def _int8_rows(x: torch.Tensor, int8_x: bool) -> bool:
    """Whether this product rounds x to int8: one row, or a decode step's rows. A compiled decode
    graph serves one sequence (one row) and passes the option on as it is."""
    return int8_x and (torch.compiler.is_compiling() or x.shape[0] == 1 or _DECODE_STEP.get())


def int4(
    x: torch.Tensor,
    packed: torch.Tensor,
    factors: torch.Tensor,
    multipliers: torch.Tensor | None = None,
    int8_x: bool = False,
) -> torch.Tensor:
    """x [T, in] (cast to float32) times the int4 weight (`packed` in torch's AVX2 packing, the
    factors as `pack_factors` or `pack_superblocks` lays them out): float32 [T, out]. `int8_x`:
    x is rounded to int8 per block of 32 and the products summed as integers (`quantize_x` in
    qkernel.c), for one row or every row of a decode step (`decode_step`), each exactly as it
    would be alone. Eager, a direct ctypes call: the `torch.library.custom_op` we had first cost
    ~40 us a call (~5 ms of a 1.5B decode step's ~150 products); in a graph being compiled, the op."""
    op = torch.ops.chunkcache.int4_product if torch.compiler.is_compiling() else _int4
    int8_x = _int8_rows(x, int8_x)
    return _in_row_chunks(x.float(), lambda c: op(c, packed, factors, multipliers, int8_x))


def int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, int8_x: bool = False) -> torch.Tensor:
    """x [T, in] (cast to float32) times the int8 weight (`codes` [out, in], bfloat16 `scales`
    [out]): float32 [T, out]; dispatched as `int4` is, `int8_x` as there where `in` is a multiple
    of 32 (float32 x otherwise)."""
    op = torch.ops.chunkcache.int8_product if torch.compiler.is_compiling() else _int8
    int8_x = _int8_rows(x, int8_x)
    return _in_row_chunks(x.float(), lambda c: op(c, codes, scales, int8_x))


def blocks_product(x: torch.Tensor, qtype: str, blocks: torch.Tensor, int8_x: bool = False) -> torch.Tensor:
    """x [T, in] (cast to float32) times a weight held as the file's blocks of `qtype` (one of
    `BLOCK_TYPES`; `blocks` uint8 [out, in / weights per block * bytes per block],
    qkernel_q6k.c, qkernel_q8_0.c): float32 [T, out]; dispatched as `int4` is, `int8_x` as there."""
    op = torch.ops.chunkcache.blocks_product if torch.compiler.is_compiling() else _blocks_product
    int8_x = _int8_rows(x, int8_x)
    return _in_row_chunks(x.float(), lambda c: op(c, blocks, qtype, int8_x))


# What the row functions (`blocks_rows`, `rms_norm_rows`, `attend_row`) take: C's `bf16` flag.
ROW_TYPES = (torch.bfloat16, torch.float32)


def blocks_rows(
    x: torch.Tensor,
    qtype: str,
    blocks: torch.Tensor,
    int8_x: bool = False,
    residual: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """`blocks_product` of at most `MAX_ROWS` rows, eager only, in x's dtype (bfloat16 or float32):
    a decode step's path with the fewest Python operations (a SmolLM2 token makes 121 of these
    calls; through `blocks_product`'s dispatch and dtype conversions they took ~30 us of Python
    each in the engine, against ~8 for torch's int4 kernel's, the Q4_1 products themselves ~63).
    The call also does a `Linear`'s epilogue where asked: plus `residual`, or (`gated`)
    silu(gate) * up of the output's halves, as torch rounds them (`qkernel_row.c`)."""
    block_bytes, weights = BLOCK_TYPES[qtype]
    rows, k = x.shape
    assert rows <= MAX_ROWS and k * block_bytes == blocks.shape[1] * weights and blocks.dtype == torch.uint8
    if x.dtype not in ROW_TYPES:
        assert residual is None and not gated
        return _blocks_product(x.float(), blocks, qtype, _int8_rows(x, int8_x)).to(x.dtype)
    lib = build.loaded()[0]
    assert lib is not None
    n = blocks.shape[0]
    y = torch.empty(rows, n // 2 if gated else n, dtype=x.dtype)
    if residual is not None:
        assert residual.shape == y.shape and residual.dtype == x.dtype
        residual = residual.contiguous()
    x = x.contiguous()
    lib.blocks_product_rows(
        BLOCK_CODES[qtype], x.data_ptr(), rows, k, n, blocks.data_ptr(), y.data_ptr(), torch.get_num_threads(),
        _int8_rows(x, int8_x), None if residual is None else residual.data_ptr(), gated, x.dtype == torch.bfloat16,
    )  # fmt: skip
    return y


# `attend_row` serves KV lists up to this many multiply-adds a product (query heads x list x head
# dim), per dtype. One thread of the AMX Xeon, against `project` + `attend` over the list as one
# span (torch's SDPA, the faster of its two forms), per layer: in bfloat16 14 against 50 us at 9
# heads of 64 x 100 entries, 102 against 105 at x 1,000; 28 against 49 at 12 heads of 128 x 100,
# 228 against 106 at x 1,000 (C's time grows 1.6-3.5x faster with the list: every key and value
# converted to float32 per query head, where torch's GEMMs take bfloat16); in float32 16 against
# 55, 122 against 175, 873 against 557 at x 3,000; 33 against 81, 390 against 281 at x 1,000.
ROW_ATTENTION_MACS = {torch.bfloat16: 360_000, torch.float32: 900_000}


def rows_served() -> bool:
    """Whether a decode row's norm and one sequence's attention run in C (`qkernel_row.c`:
    `rms_norm_rows`, `attend_row`): wherever the library is built, eager only."""
    return build.loaded()[0] is not None and not torch.compiler.is_compiling()


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`llama.RMSNorm` of rows x [T, k] with its weight (both bfloat16 or both float32), one C call."""
    lib = build.loaded()[0]
    assert lib is not None and x.dtype == weight.dtype and x.dtype in ROW_TYPES and weight.is_contiguous()
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.row_rms_norm(
        x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, y.data_ptr(), x.dtype == torch.bfloat16
    )
    return y


def attend_row(
    qkv: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    heads: tuple[int, int],
    scale: float,
) -> torch.Tensor:
    """One sequence's decode token: its merged projection qkv [1, (Hq + 2 Hk) D], RoPE's cos and sin
    [1, 1, D] of its position (all in the caches' dtype, bfloat16 or float32): K (rotated) and V
    written to the caches [slots, Hk, D] at the last of its KV list `slots` (int64 [L]), its
    attention over the list [1, Hq D]."""
    lib = build.loaded()[0]
    (hq, hk), (k_cache, v_cache) = heads, kv_cache
    d = k_cache.shape[2]
    assert lib is not None and qkv.shape == (1, (hq + 2 * hk) * d) and qkv.dtype == k_cache.dtype
    assert k_cache.dtype in ROW_TYPES and rope[0].dtype == rope[1].dtype == k_cache.dtype
    assert d % 8 == 0 and hq % hk == 0 and slots.dtype == torch.int64
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1] == hk
    qkv, slots = qkv.contiguous(), slots.contiguous()
    cos, sin = (t.contiguous() for t in rope)
    o = qkv.new_empty(1, hq * d)
    lib.row_attend(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), hq, hk, d, k_cache.data_ptr(), v_cache.data_ptr(),
        slots.data_ptr(), slots.numel(), scale, o.data_ptr(), k_cache.dtype == torch.bfloat16,
    )  # fmt: skip
    return o


def blocks_dequantize(
    qtype: str, blocks: torch.Tensor, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rows of a weight held as `qtype`'s blocks as [rows, in] in `dtype` (float32: gguf's values
    bit for bit; bfloat16: those rounded to nearest even, for a native bfloat16 GEMM), into `out`
    where given (prefill's reused buffer, its dtype then)."""
    lib = build.loaded()[0]
    assert lib is not None and blocks.dtype == torch.uint8 and blocks.is_contiguous()
    rows, cols = blocks.shape[0], _columns(qtype, blocks)
    out = torch.empty(rows, cols, dtype=dtype) if out is None else out
    assert out.shape == (rows, cols) and out.dtype in (torch.float32, torch.bfloat16) and out.is_contiguous()
    getattr(lib, BLOCK_FUNCTIONS[qtype][1])(
        blocks.data_ptr(),
        cols,
        rows,
        out.data_ptr(),
        torch.get_num_threads(),
        int(out.dtype == torch.bfloat16),
    )
    return out


def int4_dequantize(
    packed: torch.Tensor,
    factors: torch.Tensor,
    multipliers: torch.Tensor | None,
    start: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Weight rows [start, start + rows) of an int4 part (the kernel's tile-major factors, as
    `int4` takes them) as float32 [in, rows] into `out` (prefill's reused buffer, `rows` whole
    tiles): `dequant.int4_block`'s values over the same factors, bit for bit, ~5x faster."""
    lib = library()
    assert lib is not None and packed.is_contiguous() and factors.is_contiguous()
    cols, rows = packed.shape[1] * 2, out.shape[1]
    assert out.shape[0] == cols and out.dtype == torch.float32 and out.is_contiguous()
    assert start % TILE == 0 and rows % TILE == 0 and start + rows <= packed.shape[0]
    lib.int4_dequantize(
        packed.data_ptr(), factors.data_ptr(), None if multipliers is None else multipliers.data_ptr(),
        cols, start, rows, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def int4_dequantize_bf16(
    packed: torch.Tensor, scale_zeros: torch.Tensor, start: int, out: torch.Tensor
) -> torch.Tensor:
    """Weight rows [start, start + rows) of an int4 part in torch's AVX512 packing, with torch's
    bfloat16 scale and zero per group (`scale_zeros` [groups, out, 2]), as bfloat16 [in, rows]
    into `out` (`rows` whole tiles of 64): `dequant.int4_block(...).bfloat16()` bit for bit, for
    prefill's bfloat16 GEMM where `bf16_blocks()`."""
    lib = build.loaded()[0]
    assert lib is not None and packed.is_contiguous() and scale_zeros.is_contiguous()
    assert scale_zeros.dtype == torch.bfloat16 and scale_zeros.shape[1:] == (packed.shape[0], 2)
    cols, rows = packed.shape[1] * 2, out.shape[1]
    assert out.shape[0] == cols and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert start % TILE_BF16 == 0 and rows % TILE_BF16 == 0 and start + rows <= packed.shape[0]
    lib.int4_dequantize_bf16(
        packed.data_ptr(), scale_zeros.data_ptr(), cols, packed.shape[0], start, rows, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def blocks_held(qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    """A weight's blocks in the file's order (uint8 [rows, bytes a row]) as the kernels read them:
    as they are, or (`TILED`) the same bytes regrouped in tiles of 16 rows (rows a multiple of
    16, `holds`); row r of the result is then no longer the file's row r, but a slice of whole
    tiles is those rows' tiles."""
    if qtype not in TILED:
        return blocks
    lib = build.loaded()[0]
    assert lib is not None and holds(qtype, blocks.shape[0]) and blocks.dtype == torch.uint8
    blocks = blocks.contiguous()
    out = torch.empty_like(blocks)
    getattr(lib, TILED[qtype])(blocks.data_ptr(), _columns(qtype, blocks), blocks.shape[0], out.data_ptr())
    return out


def holds(qtype: str, rows: int) -> bool:
    """Whether a weight of `rows` rows can be held as `qtype`'s blocks: any rows, or whole tiles."""
    return qtype not in TILED or rows % TILE_ROWS == 0


def _columns(qtype: str, blocks: torch.Tensor) -> int:
    block_bytes, weights = BLOCK_TYPES[qtype]
    return blocks.shape[1] // block_bytes * weights


def _tiles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two [G, out] tables as [out / TILE, G, 2, TILE]: a tile's values for every G in one run."""
    groups, n = a.shape
    return torch.stack([a, b]).view(2, groups, n // TILE, TILE).permute(2, 1, 0, 3).contiguous()


def _untile(tiled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tiles, groups = tiled.shape[:2]
    both = tiled.permute(2, 1, 0, 3).reshape(2, groups, tiles * TILE)
    return both[0], both[1]


def pack_factors(scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """An int4 weight's scale and minimum [groups, out] as the kernel reads them: float32
    [out / TILE, groups, 2, TILE]."""
    return _tiles(scale.float(), minimum.float())


def pack_superblocks(
    d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K weight's own factors as the kernel reads them (scale = d sc, minimum = -dmin m):
    d and dmin float32 [in / 256, out] as float32 [out / TILE, in / 256, 2, TILE] (d, -dmin), and
    the 6-bit sc and m [in / 32, out] as uint8 [out / TILE, in / 32, 2, TILE]."""
    return _tiles(d.float(), -dmin.float()), _tiles(sc.to(torch.uint8), m.to(torch.uint8))


def unpack_factors(
    factors: torch.Tensor, multipliers: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_factors` or `pack_superblocks` undone: (scale, minimum) float32 [groups, out], copies
    (the kernel's products: d sc and -dmin m in float32)."""
    a, b = _untile(factors)
    if multipliers is None:
        return a, b
    sc, m = (t.float() for t in _untile(multipliers))
    per = sc.shape[0] // a.shape[0]
    return a.repeat_interleave(per, 0) * sc, b.repeat_interleave(per, 0) * m


def _in_row_chunks(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`product` of x [T, in] in calls of at most `MAX_ROWS` rows, each rereading the weight (at
    8 rows one call measured 1.3-1.8x torch's kernels; 9-63 rows were not measured against them)."""
    if x.shape[0] <= MAX_ROWS:
        return product(x)
    return torch.cat([product(c) for c in x.split(MAX_ROWS)])


def _int4(
    x: torch.Tensor,
    packed: torch.Tensor,
    factors: torch.Tensor,
    multipliers: torch.Tensor | None,
    int8_x: bool,
) -> torch.Tensor:
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and x.shape[0] <= MAX_ROWS
    x = x.contiguous()
    n = packed.shape[0]
    y = torch.empty(x.shape[0], n)
    lib.int4_product(
        x.data_ptr(), x.shape[0], x.shape[1], n, packed.data_ptr(), factors.data_ptr(),
        None if multipliers is None else multipliers.data_ptr(),
        y.data_ptr(), torch.get_num_threads(), int(int8_x),
    )  # fmt: skip
    return y


def _int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, int8_x: bool) -> torch.Tensor:
    lib = library()
    assert lib is not None and x.dtype == torch.float32 and x.shape[0] <= MAX_ROWS
    assert scales.dtype == torch.bfloat16 and scales.is_contiguous() and codes.is_contiguous()
    x = x.contiguous()
    n = codes.shape[0]
    y = torch.empty(x.shape[0], n)
    lib.int8_product(
        x.data_ptr(), x.shape[0], x.shape[1], n, codes.data_ptr(), scales.data_ptr(), y.data_ptr(),
        torch.get_num_threads(), int(int8_x and x.shape[1] % 32 == 0),
    )  # fmt: skip
    return y


def _blocks_product(x: torch.Tensor, blocks: torch.Tensor, qtype: str, int8_x: bool) -> torch.Tensor:
    lib = build.loaded()[0]
    assert lib is not None and x.dtype == torch.float32 and x.shape[0] <= MAX_ROWS
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
    x = x.contiguous()
    n = blocks.shape[0]
    assert x.shape[1] == _columns(qtype, blocks)
    y = torch.empty(x.shape[0], n)
    getattr(lib, BLOCK_FUNCTIONS[qtype][0])(
        x.data_ptr(), x.shape[0], x.shape[1], n, blocks.data_ptr(), y.data_ptr(),
        torch.get_num_threads(), int(int8_x),
    )  # fmt: skip
    return y


# The ops compiled graphs call. Defined with `torch.library.Library` and a CPU kernel rather than
# `torch.library.custom_op`, whose Python wrapper cost ~35 us more per call (47 against 82 us on a
# SmolLM2 576x960 int4 part, 40 us direct): a compiled SmolLM2 step calls ~120 of them.
_LIBRARY = torch.library.Library("chunkcache", "DEF")
_LIBRARY.define(
    "int4_product(Tensor x, Tensor packed, Tensor factors, Tensor? multipliers, bool int8_x) -> Tensor"
)
_LIBRARY.define("int8_product(Tensor x, Tensor codes, Tensor scales, bool int8_x) -> Tensor")
_LIBRARY.define("blocks_product(Tensor x, Tensor blocks, str qtype, bool int8_x) -> Tensor")

_LIBRARY.impl("int4_product", _int4, "CPU")
_LIBRARY.impl("blocks_product", _blocks_product, "CPU")
_LIBRARY.impl("int8_product", _int8, "CPU")


@torch.library.register_fake("chunkcache::int4_product")
def _(
    x: torch.Tensor,
    packed: torch.Tensor,
    factors: torch.Tensor,
    multipliers: torch.Tensor | None,
    int8_x: bool,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


@torch.library.register_fake("chunkcache::int8_product")
def _(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, int8_x: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0])


@torch.library.register_fake("chunkcache::blocks_product")
def _(x: torch.Tensor, blocks: torch.Tensor, qtype: str, int8_x: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0])
