"""GGUF tensors served as the file's own blocks (`weights native`, where `qkernel` serves:
`own_blocks`): Q6_K and Q4_K (with `int8_activations`), Q8_0, and Q4_0 / Q4_1 regrouped in tiles
of 16 rows (where torch's int4 kernel would serve them).

- Q6_K: the 1.5B default's Q4_K_M file holds its lm_head (151936 x 1536), the down projection of
  about half its layers and some attn_v in Q6_K: 6.5625 bits per weight (ql, qh, 16 int8 scales
  and a float16 d per 256 weights). Re-quantized to int8 per output channel (`quant.Int8Part`,
  still the form where `qkernel` does not serve) they held 8 bits and a bfloat16 scale per row,
  and a re-quantization error of ~7e-3 of the weight; a batch-1 decode step reads every weight
  once, so those bytes bound it. Held as the file's blocks they are ~18% fewer bytes and exact.
- Q4_0 / Q4_1: a float16 d (and m) and 32 4-bit codes per block (4.5 / 5 bits per weight).
  SmolLM2's file holds every projection in Q4_1. Held as torch's int4 packing with a bfloat16
  scale and zero per 32 weights (5 bits), its decode products ran torch's kernel (~16 Gw/s in
  cache); regrouped in tiles (`qkernel.blocks_held`, qkernel_q4_1.c: the same bytes) they run
  ~24, exactly the file's weights.
- Q8_0: a float16 d and 32 int8 codes per block (8.5 bits per weight). SmolLM2's Q4_1 file holds
  its tied token embedding so (49152 x 576); a Q8_0 file, every projection. Per channel int8
  cannot hold the per-block scales (~4e-3 of the weight re-quantized); the blocks are exact, and a
  tied embedding's row lookups read the same bytes (`quant_embedding`), where a float32 copy for
  the lm_head held 113 MB on SmolLM2 and its 1-row product took ~14 ms against ~3.5
  (benchmarks/history/RESULTS-narrative.md).

Every product here starts from gguf's own float32 weights bit for bit (qkernel_q6k.c and
qkernel_q8_0.c say why that is exact).

- Few rows (decode): `qkernel.blocks_product`, x rounded to int8 per block of 32 in decode steps
  with `int8_activations` (llama.cpp's Q6_K / Q8_0 x Q8 dot products, integer sums), float32 x
  otherwise.
- Many rows (prefill): GEMMs in x's dtype over blocks of `dequant.block_rows` weight rows
  dequantized by the same C code into one reused buffer, as `dequant.int8_product` does with its
  codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from chunkcache.model import dequant
from chunkcache.model.gguf_blocks import RawTensor
from chunkcache.model.kernels import qkernel


@dataclass(frozen=True)
class BlockFormat:
    """What serving one GGUF type's blocks needs to know of them."""

    qtype: str
    block_bytes: int  # bytes per block (`qkernel.BLOCK_TYPES`)
    block_weights: int  # weights per block
    # From this many rows a product takes the dequantized blocks; fewer keep the kernel.
    min_rows: int
    # The same where the blocks are bfloat16 for a native bfloat16 GEMM (`dequant.bf16_gemm`).
    bf16_min_rows: int


BLOCK_FORMATS = {
    # Measured on the 1.5B's down shape (1536 x 8960; AVX2 EPYC, one thread, shared machine, two
    # runs): kernel against blocks 7.4-9.7 / 7.8-10.7 ms at 12 rows, 9.9-10.0 / 9.1-12.6 at 16,
    # 15-22 / 17-24 at 24, 22-25 / 19 at 32: a crossing at 16-24 rows, as int8's
    # (`dequant.INT8_MIN_ROWS`). Dequantizing costs 0.17 ns per weight (gguf's numpy: 7.9).
    # bfloat16 blocks (on AMX tiles) from 6 rows for Q6_K and Q4_K alike: the 1.5B's whole decode
    # step with every Q4_K and Q6_K product on the kernel (int8 x, a pass per 8 rows) against the
    # blocks, ms wall, 2 threads, the AMX Xeon, alternated in one process (session 49): 122 / 168 at
    # 4 rows, 160 / 167 at 5, 191 / 173 at 6, 211 / 192 at 7, 247 / 190 at 8, 281 / 184 at 10: the
    # kernel's cost grows with the rows, the blocks' hardly (their dequantization is most of it).
    # One product alone (one thread, float x) had put the crossing at 8 (down) and 12 (gate) rows.
    "Q6_K": BlockFormat("Q6_K", *qkernel.BLOCK_TYPES["Q6_K"], min_rows=16, bf16_min_rows=6),
    # Q4_K's float32 blocks as Q6_K's (not measured apart).
    "Q4_K": BlockFormat("Q4_K", *qkernel.BLOCK_TYPES["Q4_K"], min_rows=16, bf16_min_rows=6),
    # int8 codes and one multiply per weight to float32, as int8 per channel's: its threshold.
    "Q8_0": BlockFormat(
        "Q8_0",
        *qkernel.BLOCK_TYPES["Q8_0"],
        min_rows=dequant.INT8_MIN_ROWS,
        bf16_min_rows=dequant.INT8_MIN_ROWS,
    ),
    # Q4_1's tiles on the AMX Xeon (bfloat16 x, SmolLM2's gate/up and down, one thread): kernel
    # against the tiles' blocks 0.34 / 0.61 ms at 4 rows, 0.65 / 0.57 at 8, 1.06 / 0.59 at 12
    # (gate/up; down 0.17 / 0.27, 0.34 / 0.25, 0.53 / 0.26); Q4_0 as Q4_1; float32 blocks as Q4_K's.
    "Q4_1": BlockFormat("Q4_1", *qkernel.BLOCK_TYPES["Q4_1"], min_rows=16, bf16_min_rows=8),
    "Q4_0": BlockFormat("Q4_0", *qkernel.BLOCK_TYPES["Q4_0"], min_rows=16, bf16_min_rows=8),
}


def own_blocks(qtype: str, int8_x: bool) -> bool:
    """Whether `weights native` holds a tensor of `qtype` as its blocks (`BlocksPart`) rather
    than int8 per channel, where `qkernel` serves.

    Q8_0: always (exact, 6% more bytes than per channel int8's codes). Q6_K: where decode's 1-row
    products take int8 x (`int8_activations`). Measured in one process on the 1.5B, the forms
    alternated (benchmarks/bench_q6k_forms.py; benchmarks/RESULTS.md "bench_q6k_forms", the other
    runs in benchmarks/history/RESULTS-narrative.md "Q6_K in its own blocks"): with int8 x
    the blocks decode faster (medians 105.5 against 124.0 and 115.7 against 128.9 ms per token,
    faster in 6 rounds of 6); with float32 x not (148.8 against 149.7 in one run, 163.6 against
    154.1 in another, slower in 4 rounds of 6): unpacking 6-bit codes to float costs more vector
    operations per weight than converting int8 codes, and 18% fewer bytes do not clearly pay for
    it there.

    Q4_K: as Q6_K (session 42: with int8 x, 124 against 142 ms a 1.5B token on the AMX Xeon,
    where torch's int4 kernel served). Q8_0 only where `qkernel`'s int4 kernel serves: on the AMX
    Xeon SmolLM2's tied Q8_0 table as blocks (its lm_head through the float x kernel and blocks
    dequantized per prefill piece, where the dense bfloat16 table multiplies in the CPU's bfloat16
    GEMM) measured RAG random 43x llama.cpp against 61x and prefill 7.4x against 8.6x; with the
    AMX tiles multiplying straight from the blocks (`qkernel.amx_blocks_product`) SmolLM2's tied
    table is held as its blocks there too: its 1-row lm_head reads 30 MB where the dense bfloat16
    table read 56 (in process 26.1 -> 22.9 ms a token, the same tokens: benchmarks/RESULTS.md
    "bench_decode_forms"; the rest: benchmarks/history/RESULTS-narrative.md, sessions 42-44).

    Q4_0 / Q4_1: in tiles where torch's int4 kernel would serve them (`qkernel.available()` False:
    torch packs int4 for AVX512): their products 5.5-6.2 (AVX512 build) and 6.8-7.2 ms (AVX2)
    against torch's 7.4-8.8 a SmolLM2 token (30 layers' weights streamed, one thread, the AMX
    Xeon); in the engine 7.5-7.7 against 9.1-9.5, but each call's Python ~12 us more, so a decode
    step measured equal (25.05 against 25.14 ms): kept for the file's exact weights (torch's
    kernel rounds the scales and zeros to bfloat16). Where `qkernel`'s own int4 kernel serves
    (AVX2 CPUs) not measured against it: it keeps them."""
    if qtype not in BLOCK_FORMATS or not qkernel.blocks_available():
        return False
    if qtype == "Q8_0":  # where the int4 kernel or the tiles serve: see above
        return qkernel.available() or qkernel.amx()
    if qtype in ("Q4_0", "Q4_1"):  # where torch's int4 kernel would serve them: see above
        return not qkernel.available()
    return int8_x


class BlocksPart:
    """Output rows whose weight is a GGUF type's blocks as the file stores them (uint8 [rows,
    in / block_weights * block_bytes], the one copy held): `quant.Int8Part`'s interface."""

    native = True  # built only where `qkernel` serves (`own_blocks`)

    def __init__(self, blocks: torch.Tensor, qtype: str, int8_x: bool = False) -> None:
        """`int8_x`: the kernel's 1-row products and a decode step's round x to int8 per block of
        32 (engine option `int8_activations`, `qkernel.decode_step`); the default keeps float32 x."""
        self.format = BLOCK_FORMATS[qtype]
        assert blocks.dtype == torch.uint8 and blocks.shape[1] % self.format.block_bytes == 0
        self.rows, self.blocks, self.int8_x = blocks.shape[0], blocks.contiguous(), int8_x
        # Below both thresholds every product runs the kernel (`__call__`'s short path).
        self.few_rows = min(self.format.min_rows, self.format.bf16_min_rows)

    @classmethod
    def of_raw(cls, raw: RawTensor, int8_x: bool = False) -> BlocksPart:
        """The GGUF tensor's blocks, copied out of the file's mapping (the weight is held in memory
        as every other form is; `quant.native_parts` moves a part's blocks into huge pages)."""
        data = np.array(raw.data, dtype=np.uint8, copy=True).reshape(raw.shape[0], -1)
        return cls(qkernel.blocks_held(raw.qtype, torch.from_numpy(data)), raw.qtype, int8_x)

    @property
    def qtype(self) -> str:
        return self.format.qtype

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """The float32 weight (of `rows`): gguf's values bit for bit."""
        return qkernel.blocks_dequantize(self.qtype, self.blocks[rows])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] times the weight, in x's dtype: the kernel below the format's `min_rows`
        rows, GEMMs over dequantized blocks from it: bfloat16 ones for a bfloat16 x where the CPU
        multiplies bfloat16 natively (`dequant.bf16_gemm`; from `bf16_min_rows`), else float32."""
        if self.short(x):
            return qkernel.blocks_rows(x, self.qtype, self.blocks, self.int8_x)
        bf16 = x.dtype == torch.bfloat16 and dequant.bf16_gemm()
        if x.shape[0] >= (self.format.bf16_min_rows if bf16 else self.format.min_rows):
            if bf16:
                return product(x, self.qtype, self.blocks)
            return product(x.float(), self.qtype, self.blocks).to(x.dtype)
        return self.kernel(x).to(x.dtype)

    def short(self, x: torch.Tensor) -> bool:
        """Whether x's rows take `__call__`'s short path (`qkernel.blocks_rows`)."""
        rows = x.shape[0]
        return rows <= qkernel.MAX_ROWS and rows < self.few_rows and not torch.compiler.is_compiling()

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel alone: float32 x and y, `qkernel.MAX_ROWS` rows a call."""
        return qkernel.blocks_product(x, self.qtype, self.blocks, self.int8_x)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.blocks,)


def product(x: torch.Tensor, qtype: str, blocks: torch.Tensor) -> torch.Tensor:
    """x [T, in] (float32 or bfloat16) times a weight held as `qtype`'s blocks, `dequant.block_rows`
    weight rows at a time dequantized into one reused buffer of x's dtype: [T, out] in it; a
    bfloat16 x on AMX tiles straight from the blocks, 32 rows at a time, where they serve
    (`qkernel.amx_blocks_take`: any inputs for `qkernel.ROW_BLOCKS`, else at most
    `qkernel.AMX_ONE_PASS`; `qkernel.amx_blocks_product`)."""
    if x.dtype == torch.bfloat16 and qkernel.amx_blocks_take(qtype, blocks, x.shape[1]):
        return qkernel.amx_blocks_product(x, qtype, blocks)
    n = blocks.shape[0]
    buffer = torch.empty(dequant.block_rows(n, x.shape[1], x.dtype), x.shape[1], dtype=x.dtype)
    return dequant.blockwise_product(
        x,
        n,
        lambda start, rows: qkernel.blocks_dequantize(qtype, blocks[start : start + rows], buffer[:rows]).t(),
    )
