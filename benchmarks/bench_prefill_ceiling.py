"""What bounds a bf16 prefill on this CPU: the GEMM-only ceiling, and where a real prefill's time goes.

1. The ceiling: each projection of the model's layers (qkv, o, gate/up, down) timed alone at
   `--rows` rows on random tensors of its exact shape, in three forms: torch's bf16 GEMM (oneDNN's
   kernel where torch has one for the CPU, its reference GEMM elsewhere), the "upcast" layout
   (`upcast.upcast_product`: float32 products over 256-row blocks of the bf16 weight) and float32
   F.linear; per form, the layer's sum x the model's layers plus the lm_head's one row is the
   time of a prefill that did nothing but its GEMMs, and `--rows` / that time its tokens/s.
2. A real prefill of `--rows` tokens through `--layers` decoder layers of the model's shapes with
   random bf16 weights (no model file read: the spec comes from the GGUF's metadata), laid out
   as the engine lays them out (`LlamaForCausalLM.prepare`), timed and profiled by operator, so
   each cost beside the GEMMs is a share of the same layers; projected to the model's depth.

Every time is this thread's CPU time (`time.thread_time`, fastest of `--repeats`), so that the
wait for a core on a shared machine does not count; memory bandwidth shared with other
processes still does.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefill_ceiling.py [--model qwen2.5-coder-1.5b]
        [--rows 512] [--layers 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from chunkcache.model.attention import AttentionMetadata, PrefillSegment
from chunkcache.model.gguf_file import GGUFCheckpoint
from chunkcache.model.llama import LlamaForCausalLM
from chunkcache.model.loader import model_path
from chunkcache.model.spec import ModelSpec
from chunkcache.model.upcast import bf16_gemm_emulated, upcast_product

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul")


def fastest(run: Callable[[], object], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        run()
        best = min(best, time.thread_time() - start)
    return best


def ceilings(spec: ModelSpec, rows: int, repeats: int) -> tuple[dict[str, float], float]:
    """Seconds of one prefill's GEMMs, per form; and of the lm_head's one row in bf16 (what the
    real prefill below runs it in: a 1-row product keeps bf16 GEMV)."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * spec.intermediate_size, h)}
    shapes["down"] = (h, spec.intermediate_size)
    forms: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "bf16": lambda x, w: F.linear(x, w),
        "upcast": lambda x, w: upcast_product(x, w, None),
        "float32": lambda x, w: F.linear(x.float(), w),
    }
    total = dict.fromkeys(forms, 0.0)
    head = 0.0
    for name, (out_features, in_features) in [*shapes.items(), ("lm_head", (spec.vocab_size, h))]:
        n = 1 if name == "lm_head" else rows
        x = torch.randn(n, in_features, dtype=torch.bfloat16)
        w = torch.randn(out_features, in_features, dtype=torch.bfloat16)
        line = []
        for form, product in forms.items():
            weight = w.float() if form == "float32" else w
            seconds = fastest(lambda product=product, x=x, weight=weight: product(x, weight), repeats)
            total[form] += seconds * (1 if name == "lm_head" else spec.num_layers)
            head = seconds if name == "lm_head" and form == "bf16" else head
            line.append(
                f"{form} {seconds * 1e3:.1f} ms ({2 * n * out_features * in_features / seconds / 1e9:.0f} GFLOP/s)"
            )
        print(f"  {name} {out_features}x{in_features} at {n} rows: " + ", ".join(line))
    return total, head


@torch.inference_mode()
def real_prefill(spec: ModelSpec, rows: int, repeats: int) -> tuple[float, dict[str, float]]:
    """CPU seconds of a prefill through `spec`'s layers (random bf16 weights), and its profile:
    self CPU seconds per operator."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        net = LlamaForCausalLM(spec)
    finally:
        torch.set_default_dtype(torch.float32)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.02)
    net.prepare()
    ids = torch.randint(0, spec.vocab_size, (rows,))
    shape = (rows, spec.num_kv_heads, spec.head_dim)
    kv = [
        (torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
        for _ in net.layers
    ]
    meta = AttentionMetadata(torch.arange(rows), [PrefillSegment.make(0, rows, None)], None)

    def step() -> torch.Tensor:  # as the runner does: logits of the last token only
        return net.compute_logits(net(ids, torch.arange(rows), kv, meta)[-1:])

    seconds = fastest(step, repeats)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    return seconds, ops


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = ModelSpec.from_hf(GGUFCheckpoint.open(Path(model_path(args.model))).config)
    emulated = bf16_gemm_emulated(torch.empty(0, dtype=torch.bfloat16))
    print(
        f"{args.model}: {spec.num_layers} layers, hidden {spec.hidden_size}, intermediate "
        f"{spec.intermediate_size}; torch's bf16 GEMM on this CPU: "
        f"{'its reference kernel (no oneDNN bf16)' if emulated else 'oneDNN'}"
    )
    total, head = ceilings(spec, args.rows, args.repeats)
    for form, seconds in total.items():
        print(
            f"GEMM-only prefill of {args.rows} tokens, {form}: {seconds:.2f} s = {args.rows / seconds:.1f} tok/s"
        )
    seconds, ops = real_prefill(replace(spec, num_layers=args.layers), args.rows, args.repeats)
    profiled = sum(ops.values())
    print(
        f"real prefill through {args.layers} layers: {seconds:.3f} s; by operator (self CPU, profiled run):"
    )
    for op, spent in sorted(ops.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {op:50s} {spent * 1e3:8.1f} ms {spent / profiled:6.1%}")
    gemm = sum(ops.get(op, 0.0) for op in GEMM_OPS) / profiled
    # The lm_head's row once, the layers (with the embedding lookup and final norm) per layer.
    projected = head + (seconds - head) / args.layers * spec.num_layers
    layout = "upcast" if emulated else "bf16"
    print(
        f"projected to {spec.num_layers} layers: {projected:.2f} s = {args.rows / projected:.1f} tok/s, "
        f"{total[layout] / projected:.0%} of the {layout} GEMM ceiling; GEMMs {gemm:.0%} of the profiled time"
    )
    print(
        f"SUMMARY bench_prefill_ceiling: model={args.model} rows={args.rows} "
        + " ".join(f"ceiling_{form}_tok_s={args.rows / s:.1f}" for form, s in total.items())
        + f" prefill_tok_s={args.rows / projected:.1f} of_ceiling={total[layout] / projected:.2f} gemm_share={gemm:.2f}"
    )


if __name__ == "__main__":
    main()
