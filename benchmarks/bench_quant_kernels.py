"""The weight-only quantized kernels against dense products, per projection kind of a model's
shapes (default: Qwen2.5-Coder-1.5B's), at the row counts of a batch-1 decode, a batched decode
and a prefill piece: what `weights native` / `int8` trade (model/quant.py).

Random weights of each shape, no model loaded (so no 1.5B lock): dense float32 in the faster
plain layout (`x @ W^T` on the transposed weight or `F.linear`, whichever is faster), dense
bfloat16 (`F.linear`), int4 with groups of 32 (`_weight_int4pack_mm_for_cpu`, bfloat16
activations) and int8 per channel (`_weight_int8pack_mm`, bfloat16 activations), and the same int4
and int8 weights multiplied in float32 over dequantized blocks of weight rows (`int4blk`,
`int8blk`: model/dequant.py, what products of `dequant.MIN_ROWS` rows and more run), and on a CPU
with a native bfloat16 GEMM (AMX, AVX512-BF16) the int4 weight multiplied in bfloat16 over blocks
written by `qkernel.int4_dequantize_bf16` (`int4bf16`: what a bfloat16 model's prefill runs there;
skipped elsewhere), and `int8bf16` the int8 codes converted to bfloat16 blocks likewise. Each
time is
the fastest of `--repeats` runs in this thread's CPU time (one thread: a shared machine's queue
for a core does not inflate it; its memory traffic still does).

    OMP_NUM_THREADS=1 python benchmarks/bench_quant_kernels.py [--rows 1 64 256] [--forms fp32 int4 ...]
        [--shapes qkv o ...]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from chunkcache.model import dequant
from chunkcache.model.kernels import qkernel

# Qwen2.5-Coder-1.5B: (name, out, in) of each projection kind, and how many a decode step runs.
SHAPES = {
    "qkv": (2048, 1536, 28),
    "o": (1536, 1536, 28),
    "gate_up": (17920, 1536, 28),
    "down": (1536, 8960, 28),
    "lm_head": (151936, 1536, 1),
}


FORMS = ("fp32", "bf16", "int4", "int8", "int4blk", "int8blk", "int4bf16", "int8bf16")


def best_ms(fn: Callable[..., torch.Tensor], args: tuple, repeats: int) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn(*args)
        best = min(best, time.thread_time() - start)
    return best * 1e3


def bf16_blocks_product(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    """bfloat16 x times the int4 weight over bfloat16 blocks, as `quant.Int4Part` runs a bfloat16
    prefill where `qkernel.bf16_blocks()`."""
    cols = packed.shape[1] * 2
    buffer = torch.empty(
        cols * dequant.block_rows(packed.shape[0], cols, torch.bfloat16), dtype=torch.bfloat16
    )
    return dequant.blockwise_product(
        x,
        packed.shape[0],
        lambda start, rows: qkernel.int4_dequantize_bf16(
            packed, scale_zeros, start, buffer[: cols * rows].view(cols, rows)
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    forms = ["fp32", *(f for f in args.forms if f != "fp32")]  # fp32: every speed's reference
    for form, serves in (("int4bf16", qkernel.bf16_blocks()), ("int8bf16", dequant.bf16_gemm())):
        if form in forms and not serves:
            print(f"{form} skipped: no native bfloat16 GEMM here (int4: or not torch's AVX512 packing)")
            forms.remove(form)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    step: dict[tuple[str, int], float] = {}
    for name in args.shapes:
        out_f, in_f, count = SHAPES[name]
        w = torch.randn(out_f, in_f) * 0.02
        wt, wb = w.t().contiguous(), w.to(torch.bfloat16)
        codes = torch.randint(0, 16, (out_f, in_f), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        scale_zeros = (torch.rand(in_f // 32, out_f, 2) * 0.01).to(torch.bfloat16)
        scale = scale_zeros[..., 0].float()
        minimum = scale_zeros[..., 1].float() - 8 * scale  # `Int4Part.affine`
        w8, s8 = (
            torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8),
            torch.rand(out_f).to(torch.bfloat16),
        )
        for rows in args.rows:
            x = torch.randn(rows, in_f)
            xb = x.to(torch.bfloat16)
            r = args.repeats
            calls = {
                "bf16": (F.linear, (xb, wb)),
                "int4": (torch.ops.aten._weight_int4pack_mm_for_cpu, (xb, packed, 32, scale_zeros)),
                "int8": (torch.ops.aten._weight_int8pack_mm, (xb, w8, s8)),
                "int4blk": (dequant.int4_product, (x, packed, scale, minimum)),
                "int8blk": (dequant.int8_product, (x, w8, s8)),
                "int4bf16": (bf16_blocks_product, (xb, packed, scale_zeros)),
                "int8bf16": (dequant.int8_product, (xb, w8, s8)),
            }
            ms = {"fp32": min(best_ms(torch.mm, (x, wt), r), best_ms(F.linear, (x, w), r))}
            ms.update({form: best_ms(*calls[form], r) for form in forms[1:]})
            for form, t in ms.items():
                step[form, rows] = step.get((form, rows), 0.0) + t * count
            print(
                f"{name} {in_f}x{out_f} rows {rows}: "
                + " ".join(f"{form} {t:.2f} ms" for form, t in ms.items())
                + " ("
                + ", ".join(f"{form} {ms['fp32'] / t:.2f}x" for form, t in ms.items() if form != "fp32")
                + " fp32's speed)",
                flush=True,
            )
    for rows in args.rows:
        print(
            f"projections of one step ({', '.join(args.shapes)}) at {rows} rows: "
            + " ".join(f"{form} {step[form, rows]:.0f} ms" for form in forms)
        )
    print(
        "SUMMARY bench_quant_kernels: "
        + " ".join(
            f"rows{r}_{form}_vs_fp32={step['fp32', r] / step[form, r]:.2f}x"
            for form in forms[1:]
            for r in args.rows
        )
    )


if __name__ == "__main__":
    main()
