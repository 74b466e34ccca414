"""The 1-row products of a decode step, per projection kind: compile_decode's fused multiply-sum
against BLAS, timed by the function compile_decode itself uses (`linear.time_one_row_products`),
beside the rate one core streams memory at (`torch.sum` over a tensor of the same bytes).

The projections are `--layers` decoder layers of the model's shapes (spec from the GGUF's
metadata, no model file read) and its lm_head, random weights in `--dtype`, read in model order
as a decode step reads them (hundreds of MB: from memory, not from cache). Run it from two trees
(PYTHONPATH) to compare two versions of the fused form.

    OMP_NUM_THREADS=1 python benchmarks/bench_one_row_products.py [--model qwen2.5-coder-1.5b]
        [--layers 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from chunkcache.model.gguf_file import GGUFCheckpoint
from chunkcache.model.linear import Linear, time_one_row_products
from chunkcache.model.loader import model_path
from chunkcache.model.spec import ModelSpec


def projections(spec: ModelSpec, layers: int, dtype: torch.dtype) -> list[Linear]:
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes = [(h, q + 2 * kv, spec.qkv_bias, False), (q, h, False, False)]
    shapes += [(h, 2 * spec.intermediate_size, False, True), (spec.intermediate_size, h, False, False)]
    linears = []
    for in_features, out_features, bias, gated in shapes * layers + [(h, spec.vocab_size, False, False)]:
        m = Linear(in_features, out_features, bias, gated).to(dtype)
        torch.nn.init.normal_(m.weight, std=0.02)
        m.prepare(pack=False, narrow_copy=True)
        assert m.hold_fused_weight(), "the fused form needs a plain CPU layout"
        linears.append(m)
    return linears


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = ModelSpec.from_hf(GGUFCheckpoint.open(Path(model_path(args.model))).config)
    dtype = getattr(torch, args.dtype)
    linears = projections(spec, args.layers, dtype)
    timings = time_one_row_products(linears)
    fused_total = blas_total = best_total = 0.0
    total_bytes = 0
    for kind, (fused, blas) in timings.items():
        out_features, in_features = kind[0], kind[1]
        count = sum(m.kind == kind for m in linears)
        nbytes = count * out_features * in_features * torch.tensor([], dtype=dtype).element_size()
        total_bytes += nbytes
        fused_total, blas_total, best_total = (
            fused_total + fused,
            blas_total + blas,
            best_total + min(fused, blas),
        )
        print(
            f"{in_features}x{out_features} (x{count}): fused {fused * 1e3:.2f} ms = {nbytes / fused / 1e9:.1f} GB/s, "
            f"BLAS {blas * 1e3:.2f} ms = {nbytes / blas / 1e9:.1f} GB/s"
        )
    stream = torch.ones(total_bytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype)
    torch.sum(stream)
    sum_s = float("inf")
    for _ in range(5):
        start = time.thread_time()
        torch.sum(stream)
        sum_s = min(sum_s, time.thread_time() - start)
    print(
        f"a pass over {total_bytes / 1e9:.2f} GB: fused {fused_total * 1e3:.1f} ms, BLAS {blas_total * 1e3:.1f} ms, "
        f"the faster per kind {best_total * 1e3:.1f} ms; torch.sum over as many bytes {sum_s * 1e3:.1f} ms "
        f"({total_bytes / sum_s / 1e9:.1f} GB/s): the faster forms stream at {sum_s / best_total:.0%} of it"
    )
    print(
        f"SUMMARY bench_one_row_products: model={args.model} dtype={args.dtype} layers={args.layers} "
        f"fused_ms={fused_total * 1e3:.1f} blas_ms={blas_total * 1e3:.1f} best_ms={best_total * 1e3:.1f} "
        f"sum_ms={sum_s * 1e3:.1f} of_stream={sum_s / best_total:.2f}"
    )


if __name__ == "__main__":
    main()
