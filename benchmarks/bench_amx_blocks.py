"""Prefill's products over a GGUF's blocks on AMX tiles (`quant_blocks.product`, as the engine calls
it: straight from the blocks, `qkernel.amx_blocks_product`, where `amx_blocks_take`, else over
dequantized blocks of rows): each weight of the model's first layer and its lm_head, the file's
own blocks, at `--rows` rows of bfloat16 x, in ms and TFLOP/s; the layer's sum beside the tiles'
bound (`--peak`: the TFLOP/s one core's tile unit reaches with its operands in L1, measured 3.67
on the AMX Xeon by a loop of `tdpbf16ps` alone).

For comparing two commits, run it from each one's tree, alternated (the VM drifts between runs).
Times: the fastest of `--repeats` calls, one thread.

    OMP_NUM_THREADS=1 python benchmarks/bench_amx_blocks.py [--model qwen2.5-coder-1.5b] [--rows 95 267]
"""

from __future__ import annotations

import argparse
import time

import torch

from chunkcache.model.kernels import qkernel
from chunkcache.model.kernels.quant_blocks import product
from chunkcache.model.loader import model_path


def blocks_of(tensor) -> tuple[str, torch.Tensor]:
    qtype = tensor.tensor_type.name
    raw = torch.from_numpy(tensor.data.copy()).view(torch.uint8).reshape(tensor.data.shape[0], -1)
    return qtype, qkernel.blocks_held(qtype, raw)


def fastest(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--rows", type=int, nargs="+", default=[95, 267])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak", type=float, default=3.67, help="the tile unit's TFLOP/s on one core")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not qkernel.amx():
        raise SystemExit("no AMX-BF16 here (or the kernel library does not build)")
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(model_path(args.model)).tensors}
    names = [
        n for n in tensors if n.startswith("blk.0.") and n.endswith(".weight") and len(tensors[n].shape) == 2
    ]
    weights = {n: blocks_of(tensors[n]) for n in [*names, "output.weight"] if n in tensors}
    summary = []
    for rows in args.rows:
        layer_ms = layer_flop = 0.0
        print(f"rows {rows}: {'weight':<24} {'type':<5} {'out x in':>13} {'ms':>8} {'TFLOP/s':>8}  from")
        for name, (qtype, blocks) in weights.items():
            k = qkernel._columns(qtype, blocks)
            path = "blocks" if qkernel.amx_blocks_take(qtype, blocks, k) else "dequantized"
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
            seconds = fastest(lambda: product(x, qtype, blocks), args.repeats)  # noqa: B023
            flop = 2.0 * rows * k * blocks.shape[0]
            if name != "output.weight":
                layer_ms, layer_flop = layer_ms + seconds * 1e3, layer_flop + flop
            shape = f"{blocks.shape[0]} x {k}"
            rate = flop / seconds / 1e12
            print(f"         {name:<24} {qtype:<5} {shape:>13} {seconds * 1e3:8.2f} {rate:8.2f}  {path}")
        bound = layer_flop / (args.peak * 1e12) * 1e3
        print(
            f"         layer 0: {layer_ms:.2f} ms ({layer_flop / layer_ms / 1e9:.2f} TFLOP/s; the tiles' bound {bound:.2f} ms)"
        )
        summary.append(f"layer_ms_{rows}={layer_ms:.2f} tflops_{rows}={layer_flop / layer_ms / 1e9:.2f}")
    print(f"SUMMARY bench_amx_blocks: model={args.model} {' '.join(summary)}")


if __name__ == "__main__":
    main()
