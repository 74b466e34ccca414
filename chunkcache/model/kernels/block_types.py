"""The GGUF block types the C kernels read as the file stores them (Q6_K, Q4_K, Q8_0, Q4_1, Q4_0):
each one's size, its code and functions in the library (`qkernel_q6k.c`, `qkernel_q4k.c`,
`qkernel_q8_0.c`, `qkernel_q4_1.c`), and the types held regrouped in tiles. The Python side of a
type is these tables alone (every call goes through them, `qkernel`); how a weight of each type is
served is `quant_blocks.BLOCK_FORMATS`."""

from __future__ import annotations

# The block types' codes in the library's tables (qkernel.c's `BLOCKS_PRODUCT`, qkernel_amx.c's
# `DEQUANTIZE`).
BLOCK_CODES = {"Q4_K": 0, "Q6_K": 1, "Q8_0": 2, "Q4_1": 3, "Q4_0": 4}
# The types qkernel_amx.c dequantizes a row at a time (`ROW_BF16`): within a pass of any product
# (Q4_1's and Q4_0's rows lie in 16-row tiles, dequantized a whole pass at once).
ROW_BLOCKS = ("Q4_K", "Q6_K", "Q8_0")

# The types held as the file's blocks: (bytes per block, weights per block). Q6_K: ql[128],
# qh[64], scales[16], d; Q4_K: d, dmin, scales[12], qs[128]; Q8_0: d, then 32 int8 codes.
BLOCK_TYPES = {"Q6_K": (210, 256), "Q4_K": (144, 256), "Q8_0": (34, 32), "Q4_1": (20, 32), "Q4_0": (18, 32)}
# Their library functions: (product, dequantize).
BLOCK_FUNCTIONS = {
    "Q6_K": ("q6k_product", "q6k_dequantize"),
    "Q4_K": ("q4k_product", "q4k_dequantize"),
    "Q8_0": ("q8_0_product", "q8_0_dequantize"),
    "Q4_1": ("q4_1_product", "q4_1_dequantize"),
    "Q4_0": ("q4_0_product", "q4_0_dequantize"),
}


# The types held regrouped in tiles of `TILE_ROWS` rows (qkernel_q4_1.c: a vector lane a row), and
# the library function that regroups the file's order.
TILED = {"Q4_1": "q4_1_tile", "Q4_0": "q4_0_tile"}
TILE_ROWS = 16
