"""A GGUF tensor as its file stores it (`RawTensor`), and the 4-bit types' own codes and
factors read from its blocks: what `weights native` holds (model/quant.py) without dequantizing.
Q4_0 (w = d (q - 8)), Q4_1 (w = d q + m) and Q4_K (w = d sc q - dmin m per sub-block of 32) are all
w = scale * q + minimum per group of 32 with the file's own codes; Q4_K's d, dmin, sc and m are
also read as they are (`q4k_superblocks`), the form the decode kernel holds them in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32  # inputs per int4 scale/zero: every 4-bit GGUF type's block or sub-block
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


@dataclass
class RawTensor:
    """One 2-D GGUF tensor as stored: `data` [rows, bytes per row] of `qtype`'s blocks (rows in
    transformers' order), `shape` (rows, cols) of the weight it encodes."""

    name: str
    qtype: str
    data: np.ndarray
    shape: tuple[int, int]

    def dequantize(self, rows: slice = slice(None)) -> np.ndarray:
        """The float32 weight (of `rows`), as gguf dequantizes it: the reference of every form."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        out = dequantize(self.data[rows], GGMLQuantizationType[self.qtype])
        return np.asarray(out, dtype=np.float32).reshape(-1, self.shape[1])


def affine_int4(raw: RawTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 4-bit tensor's own codes and its affine per group of 32, w = scale * q + minimum:
    (q uint8 [rows, cols], scale and minimum float32 [rows, cols / 32]), computed as gguf's
    dequantization computes them (float32 products of the file's float16 factors)."""
    rows, cols = raw.shape
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    blocks = raw.data.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType[raw.qtype]][1])
    if raw.qtype in ("Q4_0", "Q4_1"):
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
        if raw.qtype == "Q4_0":
            minimum, qs = -8 * d, blocks[:, 2:]
        else:
            minimum, qs = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0], blocks[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # low nibbles are elements 0-15
        scale = d
    elif raw.qtype == "Q4_K":
        d, dmin, sc, m = _q4k_factors(blocks)
        scale = d * sc.astype(np.float32)  # [blocks, 8]
        minimum = -(dmin * m.astype(np.float32))
        # Per 64 elements, 32 bytes: low nibbles are the first sub-block of 32, high the second.
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(-1, 256)
    else:
        raise ValueError(f"{raw.name}: {raw.qtype} is not a 4-bit affine type ({', '.join(INT4_TYPES)})")
    groups = cols // GROUP
    return (
        np.ascontiguousarray(q.reshape(rows, cols), dtype=np.uint8),
        scale.reshape(rows, groups).astype(np.float32),
        minimum.reshape(rows, groups).astype(np.float32),
    )


def _q4k_factors(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K tensor's blocks' d and dmin (float32 [blocks, 1], from float16) and 6-bit sc and m
    (uint8 [blocks, 8], one per sub-block of 32)."""
    from gguf.quants import Q4_K

    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8)


def q4k_superblocks(raw: RawTensor) -> tuple[np.ndarray, ...]:
    """A Q4_K tensor's own factors per output row: d and dmin float32 [rows, cols / 256], sc and
    m uint8 [rows, cols / 32] (scale = d sc, minimum = -dmin m: `affine_int4`'s values)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rows = raw.shape[0]
    blocks = raw.data.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K][1])
    d, dmin, sc, m = _q4k_factors(blocks)
    return d.reshape(rows, -1), dmin.reshape(rows, -1), sc.reshape(rows, -1), m.reshape(rows, -1)
