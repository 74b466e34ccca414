"""Decode's few-row products over quantized weights: `qkernel`'s AVX2 float32 kernel (model/kernels/qkernel.py)
against torch's bfloat16 weight-only kernels and dense matvecs, per projection kind of the 1.5B's
shapes, in ms and in GB/s of the bytes each form reads (codes + scales, or the dense weight),
beside the rate one core streams memory at (`torch.sum` over 256 MB).

Forms: `int4` torch's `_weight_int4pack_mm_for_cpu` (bfloat16 x, scale and zero per group of 32:
0.625 B/weight), `q4` qkernel's int4 (float32 x, the same packed codes, float32 scale and minimum:
0.75 B/weight), `int8` torch's `_weight_int8pack_mm` (bfloat16 x), `q8` qkernel's int8 (same codes
and bfloat16 per-row scales: ~1 B/weight), `q6k` qkernel's Q6_K product over the file's own
blocks (random bytes; 0.82 B/weight), `q80` its Q8_0 product over the file's blocks (1.06 B/weight);
`q4x`, `q8x`, `q6kx`, `q80x` the same with x rounded to int8 per
block of 32 (`int8_activations`, 1-row products), `q4k` `q4x` over Q4_K's own factors (d, dmin
per 256 inputs, 6-bit sc and m per 32: 0.59 B/weight); `bf16` and `fp32` dense (`F.linear`; fp32 also
`x @ W^T` on the transposed weight, the faster kept). Each form's weights are copied until the
copies exceed `--cold-mb` and the copies are multiplied in turn, so each product reads its weight
from memory as a decode step does (a single 1.5 MB q/k/v weight would otherwise sit in cache).
Times: this thread's CPU time, the fastest of `--repeats` passes.

    OMP_NUM_THREADS=1 python benchmarks/bench_qkernel.py [--rows 1 4 8] [--forms int4 q4 ...]
        [--shapes qkv o ...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_quant_kernels import SHAPES  # the 1.5B's (out, in, products per step) per kind

from chunkcache.model.kernels import qkernel

FORMS = ("fp32", "bf16", "int4", "q4", "q4x", "q4k", "int8", "q8", "q8x", "q6k", "q6kx", "q80", "q80x")
# The forms `qkernel` serves (an `x` suffix: 1-row products on int8 x, `int8_activations`).
QKERNEL_FORMS = {"q4", "q4x", "q4k", "q8", "q8x", "q6k", "q6kx", "q80", "q80x"}
# The forms of the file's own blocks: their GGUF type and where d (float16) sits in a block.
BLOCK_FORMS = {"q6k": ("Q6_K", 208), "q80": ("Q8_0", 0)}


def weights(form: str, out_f: int, in_f: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """A product of x by a random weight of the form, and the bytes it reads."""
    if form in ("int4", "q4", "q4x", "q4k"):
        codes = torch.randint(0, 16, (out_f, in_f), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        groups = in_f // 32
        if form == "int4":
            sz = (torch.rand(groups, out_f, 2) * 0.01).to(torch.bfloat16)
            run = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, 32, sz)  # noqa: E731
            return run, packed.numel() + sz.numel() * 2
        if form == "q4k":  # Q4_K's own factors: d, dmin per 256 inputs, 6-bit sc, m per 32
            supers = in_f // 256
            f, mult = qkernel.pack_superblocks(
                torch.rand(supers, out_f) * 1e-3,
                torch.rand(supers, out_f) * 1e-3,
                torch.randint(0, 64, (groups, out_f)),
                torch.randint(0, 64, (groups, out_f)),
            )
            return lambda x: qkernel.int4(
                x, packed, f, mult, True
            ), packed.numel() + 4 * f.numel() + mult.numel()
        factors = qkernel.pack_factors(torch.rand(groups, out_f) * 0.01, -torch.rand(groups, out_f) * 0.1)
        return lambda x: qkernel.int4(
            x, packed, factors, None, form == "q4x"
        ), packed.numel() + 4 * factors.numel()
    if form.removesuffix("x") in BLOCK_FORMS:
        qtype, at = BLOCK_FORMS[form.removesuffix("x")]
        block_bytes, block_weights = qkernel.BLOCK_TYPES[qtype]
        blocks = torch.randint(0, 256, (out_f, in_f // block_weights * block_bytes), dtype=torch.uint8)
        blocks.view(out_f, -1, block_bytes)[..., at : at + 2] = torch.full(
            (1,), 1e-4, dtype=torch.float16
        ).view(torch.uint8)  # finite d
        return lambda x: qkernel.blocks_product(x, qtype, blocks, form.endswith("x")), blocks.numel()
    if form in ("int8", "q8", "q8x"):
        codes = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8)
        scales = torch.rand(out_f).to(torch.bfloat16)
        if form == "int8":
            return lambda x: torch.ops.aten._weight_int8pack_mm(
                x.to(torch.bfloat16), codes, scales
            ), codes.numel() + 2 * out_f
        return lambda x: qkernel.int8(x, codes, scales, form == "q8x"), codes.numel() + 2 * out_f
    w = torch.randn(out_f, in_f) * 0.02
    if form == "bf16":
        wb = w.to(torch.bfloat16)
        return lambda x: F.linear(x.to(torch.bfloat16), wb), wb.numel() * 2
    wt = w.t().contiguous()
    best = min((F.linear, lambda x, w: x @ w.t()), key=lambda f: _once(lambda x: f(x, w), in_f))
    if best is F.linear:
        return lambda x: F.linear(x, w), w.numel() * 4
    return lambda x: x @ wt, w.numel() * 4


def _once(run: Callable[[torch.Tensor], torch.Tensor], in_f: int) -> float:
    x = torch.randn(1, in_f)
    run(x)
    start = time.thread_time()
    for _ in range(3):
        run(x)
    return time.thread_time() - start


def best_ms(runs: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, repeats: int) -> float:
    """ms per product: the copies in turn, the fastest of `repeats` passes."""
    for run in runs:
        run(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for run in runs:
            run(x)
        best = min(best, (time.thread_time() - start) / len(runs))
    return best * 1e3


def stream_gbs() -> float:
    t = torch.ones(64 * 2**20)  # 256 MB
    t.sum()
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        t.sum()
        best = min(best, time.thread_time() - start)
    return t.numel() * 4 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--cold-mb", type=float, default=96.0)
    args = parser.parse_args()
    if QKERNEL_FORMS & set(args.forms) and not qkernel.available():
        raise SystemExit("qkernel is unavailable here (see the log line): drop q4*/q8* from --forms")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stream = stream_gbs()
    print(f"one core streams {stream:.1f} GB/s (torch.sum over 256 MB)", flush=True)
    step: dict[tuple[str, int], float] = {}
    gbs: dict[tuple[str, int], list[float]] = {}
    for name in args.shapes:
        out_f, in_f, count = SHAPES[name]
        for form in args.forms:
            run, nbytes = weights(form, out_f, in_f)
            runs = [run]
            while len(runs) * nbytes < args.cold_mb * 1e6:
                runs.append(weights(form, out_f, in_f)[0])
            for rows in args.rows:
                with qkernel.decode_step():  # the `x` forms round every row, as a decode step's
                    ms = best_ms(runs, torch.randn(rows, in_f), args.repeats)
                step[form, rows] = step.get((form, rows), 0.0) + ms * count
                gbs.setdefault((form, rows), []).append(nbytes / ms / 1e6)
                print(
                    f"{name} {in_f}x{out_f} {form} rows {rows}: {ms:.3f} ms, {nbytes / ms / 1e6:.1f} GB/s",
                    flush=True,
                )
            del runs, run
    for rows in args.rows:
        print(
            f"projections of one 1.5B step at {rows} rows, every weight in the form: "
            + " ".join(f"{form} {step[form, rows]:.0f} ms" for form in args.forms)
        )
    pairs = [
        (a, b)
        for a, b in (
            ("q4", "int4"),
            ("q8", "int8"),
            ("q4x", "q4"),
            ("q4k", "q4x"),
            ("q8x", "q8"),
            ("q6k", "q8"),
            ("q6kx", "q8x"),
            ("q80", "q8"),
            ("q80x", "q8x"),
            ("q80", "fp32"),
        )
        if a in args.forms and b in args.forms
    ]
    print(
        f"SUMMARY bench_qkernel: stream={stream:.1f}GB/s "
        + " ".join(f"rows{r}_{a}_vs_{b}={step[b, r] / step[a, r]:.2f}x" for a, b in pairs for r in args.rows)
        + " "
        + " ".join(f"rows1_{f}_step={step[f, 1]:.0f}ms" for f in args.forms if (f, 1) in step)
    )


if __name__ == "__main__":
    main()
