"""Q6_K weights served as the GGUF file's own blocks (`weights native` with `int8_activations`,
where `qkernel` serves: `own_blocks`).

The 1.5B default's Q4_K_M file holds its lm_head (151936 x 1536), the down projection of about
half its layers and some attn_v in Q6_K: 6.5625 bits per weight (ql, qh, 16 int8 scales and a
float16 d per 256 weights). Re-quantized to int8 per output channel (`quant.Int8Part.of_raw`,
still the form where `qkernel` does not serve) they held 8 bits and a bfloat16 scale per row, and
a re-quantization error of ~7e-3 of the weight; a batch-1 decode step reads every weight once, so
those bytes bound it. Held as the file's blocks they are ~18% fewer bytes and exact: every product
here starts from gguf's own float32 weights bit for bit (qkernel_q6k.c says why that is exact).

- Few rows (decode): `qkernel.q6k`, x rounded to int8 per block of 32 for 1-row products with
  `int8_activations` (llama.cpp's Q6_K x Q8 dot product, integer sums), float32 x for 2-8 rows.
  Without `int8_activations` Q6_K stays int8 per channel: this form's float32 1-row product
  measured slower than the int8 one (`own_blocks`).
- Many rows (prefill): float32 GEMMs over blocks of `dequant.BLOCK_ROWS` weight rows dequantized
  by the same C code into one reused buffer, as `dequant.int8_product` does with its codes.
"""

from __future__ import annotations

import numpy as np
import torch

from chunkcache.model import dequant, qkernel
from chunkcache.model.gguf_blocks import RawTensor

# From this many rows a product takes the dequantized blocks; fewer keep the kernel. Measured on
# the 1.5B's down shape (1536 x 8960; AVX2 EPYC, one thread, shared machine, two runs): kernel
# against blocks 7.4-9.7 / 7.8-10.7 ms at 12 rows, 9.9-10.0 / 9.1-12.6 at 16, 15-22 / 17-24 at 24,
# 22-25 / 19 at 32: a crossing at 16-24 rows, as int8's (`dequant.INT8_MIN_ROWS`). Dequantizing
# costs 0.17 ns per weight (int8 codes to float32: 0.15; gguf's numpy: 7.9).
Q6K_MIN_ROWS = 16


def own_blocks(int8_x: bool) -> bool:
    """Whether `weights native` holds a Q6_K tensor as its blocks (`Q6KPart`) rather than int8 per
    channel: where `qkernel` serves and decode's 1-row products take int8 x (`int8_activations`).
    Measured in one process on the 1.5B, the forms alternated (benchmarks/bench_q6k_forms.py,
    RESULTS.md "Q6_K in its own blocks"): with int8 x the blocks decode faster (medians 105.5
    against 124.0 and 115.7 against 128.9 ms per token, faster in 6 rounds of 6); with float32 x
    not (148.8 against 149.7 in one run, 163.6 against 154.1 in another, slower in 4 rounds of
    6): unpacking 6-bit codes to float costs more vector operations per weight than converting
    int8 codes, and 18% fewer bytes do not clearly pay for it there."""
    return int8_x and qkernel.available()


class Q6KPart:
    """Output rows whose weight is Q6_K blocks as the file stores them (uint8 [rows, in / 256 *
    210], the one copy held): `quant.Int8Part`'s interface."""

    native = True  # built only where `qkernel` serves (`own_blocks`)

    def __init__(self, blocks: torch.Tensor, int8_x: bool = False) -> None:
        """`int8_x`: 1-row products round x to int8 per block of 32 (engine option
        `int8_activations`); the default keeps float32 x."""
        assert blocks.dtype == torch.uint8 and blocks.shape[1] % qkernel.Q6K_BLOCK_BYTES == 0
        self.rows, self.blocks, self.int8_x = blocks.shape[0], blocks.contiguous(), int8_x

    @classmethod
    def of_raw(cls, raw: RawTensor, int8_x: bool = False) -> Q6KPart:
        """The GGUF tensor's blocks, copied out of the file's mapping (the weight is held in memory
        as every other form is)."""
        assert raw.qtype == "Q6_K", raw.qtype
        data = np.array(raw.data, dtype=np.uint8, copy=True).reshape(raw.shape[0], -1)
        return cls(torch.from_numpy(data), int8_x)

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """The float32 weight (of `rows`): gguf's values bit for bit."""
        return qkernel.q6k_dequantize(self.blocks[rows])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] times the weight, in x's dtype: the kernel below `Q6K_MIN_ROWS` rows, float32
        GEMMs over dequantized blocks from it."""
        if x.shape[0] >= Q6K_MIN_ROWS:
            return product(x.float(), self.blocks).to(x.dtype)
        return self.kernel(x).to(x.dtype)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel alone: float32 x and y, `qkernel.MAX_ROWS` rows a call."""
        return qkernel.q6k(x, self.blocks, self.int8_x)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.blocks,)


def product(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """float32 x [T, in] times a Q6_K weight, `dequant.BLOCK_ROWS` weight rows at a time
    dequantized into one reused float32 buffer: float32 [T, out]."""
    n = blocks.shape[0]
    buffer = torch.empty(min(dequant.BLOCK_ROWS, n), x.shape[1])
    return dequant.blockwise_product(
        x, n, lambda start, rows: qkernel.q6k_dequantize(blocks[start : start + rows], buffer[:rows]).t()
    )
