"""bf16 matrix products on CPUs where torch has no fast bf16 GEMM: in float32, a block of weight
rows at a time (the "upcast" layout of `linear.Linear`; docs in `model/linear.py`'s docstring).

Apart from linear.py so that blend's dense K rows (`dense_product`) and the Linear layouts share
one rule, and tests can patch it in one place.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F


def native_bf16_matmul() -> str | None:
    """The CPU's native bfloat16 matrix instructions, as torch (its cpuinfo / oneDNN) reports them,
    or None. Without them bf16 products run through float32 (oneDNN's emulation on AVX512 CPUs,
    `upcast.upcast_product` on others) and bf16 only saves memory."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        # On ARM oneDNN's bf16 check is the CPU's BF16 extension (BFMMLA).
        return "ARM BF16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else None
    found = [
        name
        for name, check in (
            ("AMX", torch.cpu._is_amx_tile_supported),
            ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported),
        )
        if check()
    ]
    return " and ".join(found) or None


# From this many rows a product takes the float32 blocks (`linear._MIN_ROWS`, the narrow band's
# end): 1-3 rows keep bf16 GEMV, which streams the weight faster than the blocks.
MIN_ROWS = 4


def bf16_gemm_emulated(weight: torch.Tensor) -> bool:
    """Whether torch multiplies this weight with its slow reference GEMM: a CPU bf16 tensor where
    oneDNN has no bf16 kernel for the CPU (torch's own test for routing bf16 products to oneDNN)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


# Weight rows per block of `upcast_product`: [256, in] in float32 is 1.5 MB at in=1536 and 9 MB at
# 8960 (in L2 / L3 while the GEMM reads it); 128-512 measured alike, 1,024 up to 2.8x slower
# at 16 rows, and blocks sized by bytes (64 KB-1 MB) slower for the 8960-wide input.
_UPCAST_ROWS = 256


def upcast_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x W^T + b` of bf16 tensors computed in float32 and rounded once, as F.linear on the
    float32 copies would give (the same numbers): the weight converted `_UPCAST_ROWS` rows at a
    time into one reused buffer, so no float32 copy of it is ever whole (converting the whole
    weight per call measured 10-25% slower at 512 rows and up to 4x at 16)."""
    xf = x.float()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    buffer = torch.empty(min(_UPCAST_ROWS, weight.shape[0]), weight.shape[1], device=x.device)
    for start in range(0, weight.shape[0], _UPCAST_ROWS):
        rows = weight[start : start + _UPCAST_ROWS]
        block = buffer[: rows.shape[0]]
        block.copy_(rows)
        torch.mm(xf, block.t(), out=out[:, start : start + rows.shape[0]])
    if bias is not None:
        out += bias
    return out.to(x.dtype)


def dense_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear on a dense weight outside a `Linear` (blend's K rows), in the form a `Linear`'s
    dense layouts would take: `upcast_product` where 4 rows and more of a bf16 weight would fall
    to torch's reference GEMM."""
    if x.shape[0] >= MIN_ROWS and bf16_gemm_emulated(weight):
        return upcast_product(x, weight, bias)
    return F.linear(x, weight, bias)
