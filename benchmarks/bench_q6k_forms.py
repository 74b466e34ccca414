"""Decode with a GGUF's Q6_K tensors in their own blocks (`quant_blocks.BlocksPart`) against the same
tensors re-quantized to int8 per channel (`quant.Int8Part`, the form without `int8_activations`),
in one process, the forms swapped in place and alternated round by round, so a shared machine's
load drifts over both alike (separate processes measured +-15% apart on the same code).

Per round and form: one 1-token generate (the prompt's prefill), then a 33-token one; the CPU
time (time.process_time) of the difference over 32 tokens is the decode per token. `--x int8`
serves with `int8_activations` (decode's 1-row products on int8 x, where `own_blocks` holds
Q6_K as blocks); `--x float` forces the blocks with float32 x as well.

    OMP_NUM_THREADS=1 python benchmarks/bench_q6k_forms.py [--model qwen2.5-coder-1.5b] [--x int8|float]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from chunkcache import LLM, SamplingParams
from chunkcache.model.gguf_blocks import RawTensor
from chunkcache.model.kernels import qkernel, quant_blocks
from chunkcache.model.linear import Linear
from chunkcache.model.quant import Int8Part


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--x", choices=("int8", "float"), default="int8")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    int8_x = args.x == "int8"
    torch.set_num_threads(1)
    quant_blocks.own_blocks = lambda qtype, int8_x: qkernel.available() and qtype in ("Q6_K", "Q8_0")  # any x
    llm = LLM(
        args.model,
        dtype="float32",
        weights="native",
        int8_activations=int8_x,
        kv_cache_tokens=2048,
        enable_chunk_cache=False,
    )
    forms: dict[str, dict[tuple[str, int], object]] = {"q6k": {}, "int8": {}}
    modules = dict(llm.engine.runner.model.named_modules())
    for name, m in modules.items():
        if isinstance(m, Linear) and m.quant is not None:
            for i, p in enumerate(m.quant.parts):
                if isinstance(p, quant_blocks.BlocksPart) and p.qtype == "Q6_K":
                    shape = (p.rows, p.blocks.shape[1] // p.format.block_bytes * p.format.block_weights)
                    forms["q6k"][name, i] = p
                    forms["int8"][name, i] = Int8Part.of_raw(
                        RawTensor(name, "Q6_K", p.blocks.numpy(), shape), int8_x
                    )
    held = {
        "q6k": sum(p.blocks.numel() for p in forms["q6k"].values()),
        "int8": sum(p.codes.numel() + 2 * p.rows for p in forms["int8"].values()),
    }
    print(
        f"{len(forms['q6k'])} Q6_K parts: {held['q6k'] / 1e9:.3f} GB as blocks, {held['int8'] / 1e9:.3f} GB as int8"
    )
    ids = llm.tokenizer.encode("def quicksort(xs):", add_special_tokens=False)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
    ms: dict[str, list[float]] = {"q6k": [], "int8": []}
    for r in range(args.rounds):
        for form in ("q6k", "int8") if r % 2 == 0 else ("int8", "q6k"):
            for (name, i), part in forms[form].items():
                modules[name].quant.parts[i] = part
            start = time.process_time()
            llm.generate([ids], one)
            first = time.process_time() - start
            start = time.process_time()
            out = llm.generate([ids], many)[0].outputs[0]
            ms[form].append((time.process_time() - start - first) / 32 * 1e3)
            text = llm.tokenizer.decode(out.token_ids[:12])
            print(f"round {r} {form}: {ms[form][-1]:.1f} ms CPU per decoded token; {text!r}", flush=True)
    print(
        f"SUMMARY bench_q6k_forms: x={args.x} "
        + " ".join(f"{f}_median_ms={statistics.median(v):.1f} {f}_min_ms={min(v):.1f}" for f, v in ms.items())
        + f" q6k_gb={held['q6k'] / 1e9:.3f} int8_gb={held['int8'] / 1e9:.3f}"
    )


if __name__ == "__main__":
    main()
