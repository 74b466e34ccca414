"""The default model as served: load time, resident memory against the weights' bytes, prefill and
batch-1 decode speed, and the machine's weight-streaming ceiling for that decode.

One process, one thing at a time: the engine is loaded (time, then VmRSS once loaded, against the
bytes of its parameters, and the process's peak VmHWM, which the load sets); a ~500-token prompt is prefilled `--repeats` times with no cache to hit
(TTFT); `--decode-tokens` tokens are decoded at batch 1 (eager, or compiled with
`--compile-decode`). Each is also timed in process CPU time (one thread: the time it ran, not
the time it waited for a core on a shared machine). The ceiling: `torch.sum` over a tensor of the weights' dtype and size, whose
bytes / time is the rate one core streams memory at; a decode step reads every weight but the
embedding table once, so that rate over those bytes is the fastest decode this machine allows.

With `--weights native` (or int8) the projections are weight-only quantized products
(`model/quant.py`); "weights" is then the bytes the model holds (`loader._held_bytes`), and the
1-row product time of each projection kind, summed over the layers, is printed for every mode.

    OMP_NUM_THREADS=1 python benchmarks/bench_default_model.py [--model qwen2.5-coder-1.5b]
        [--dtype bfloat16] [--compile-decode] [--weights native] [--[no-]int8-activations]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from chunkcache import LLM, SamplingParams
from chunkcache.model.linear import Linear
from chunkcache.model.loader import _held_bytes


def rss_bytes(field: str = "VmRSS") -> int:
    """The process's resident memory now (VmRSS), or its peak so far (VmHWM)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def prompt_of(llm: LLM, tokens: int, salt: int) -> list[int]:
    """A prompt of exactly `tokens` ordinary tokens, different per `salt` (no prefix to share)."""
    text = " ".join(f"item {salt}-{i} costs {i * 7 % 97} coins;" for i in range(tokens))
    return llm.tokenizer.encode(text, add_special_tokens=False)[:tokens]


def ceiling_seconds(num_bytes: int, dtype: torch.dtype, repeats: int = 5) -> tuple[float, float]:
    """Median (wall, CPU) seconds of one `torch.sum` over `num_bytes` of `dtype`."""
    t = torch.ones(num_bytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype)
    walls, cpus = [], []
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        torch.sum(t)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


@torch.inference_mode()
def kind_seconds(net: torch.nn.Module, repeats: int = 3) -> dict[tuple, float]:
    """Per projection kind (`Linear.kind`), the CPU seconds of one 1-row forward of every
    projection of that kind in model order (fastest of `repeats` passes): a decode step's share."""
    linears = [m for m in net.modules() if isinstance(m, Linear)]
    best: dict[tuple, float] = {}
    for _ in range(repeats):
        spent: dict[tuple, float] = {}
        for m in linears:
            x = torch.randn(1, m.in_features, dtype=net.norm.weight.dtype)
            start = time.thread_time()
            m(x)
            spent[m.kind] = spent.get(m.kind, 0.0) + time.thread_time() - start
        best = {k: min(v, best.get(k, v)) for k, v in spent.items()}
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile-decode", action="store_true")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", default="dense", choices=("dense", "native", "int8", "auto"))
    parser.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = rss_bytes()
    start = time.perf_counter()
    llm = LLM(
        args.model,
        device="cpu",
        dtype=args.dtype,
        threads=1,
        kv_cache_tokens=4096,
        enable_chunk_cache=False,
        enable_prefix_caching=False,
        compile_decode=args.compile_decode,
        weights=args.weights,
        **({} if args.int8_activations is None else {"int8_activations": args.int8_activations}),
    )
    load_s = time.perf_counter() - start
    rss, peak = rss_bytes() - before, rss_bytes("VmHWM")
    net = llm.engine.runner.model
    weights = _held_bytes(net)
    # A dense table, or (native weights) the file's blocks rows are looked up from.
    table = getattr(net.embed_tokens, "weight", None)
    table = table if table is not None else net.embed_tokens.blocks
    embedding = table.numel() * table.element_size()
    tied = isinstance(net.embed_tokens, torch.nn.Embedding) and net.lm_head.weight is table
    streamed = weights if tied else weights - embedding  # the lm_head reads the table when tied
    kv = sum(
        k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in llm.engine.runner.kv_caches
    )
    print(
        f"model {llm.engine.model_name} {args.dtype}, weights {args.weights} ({net.weights_form}): load {load_s:.1f} s; RSS after load {rss / 1e9:.2f} GB, "
        f"weights {weights / 1e9:.2f} GB, KV cache {kv / 1e9:.2f} GB: RSS / (weights + KV) "
        f"{rss / (weights + kv):.2f}x; peak RSS of the process so far (VmHWM) {peak / 1e9:.2f} GB; "
        f"embedding {embedding / 1e9:.2f} GB"
    )
    for (out_f, in_f, gated, _), seconds in kind_seconds(net).items():
        print(
            f"1-row products {in_f}x{out_f}{' gated' if gated else ''}: {seconds * 1e3:.1f} ms CPU per step"
        )
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttfts, ttft_cpus = [], []
    for r in range(args.repeats + 1):  # the first is a warm-up
        cpu = time.process_time()
        out = llm.generate([prompt_of(llm, args.prompt_tokens, r)], one)[0]
        ttfts.append(out.metrics.ttft)
        ttft_cpus.append(time.process_time() - cpu)
    ttft, ttft_cpu = statistics.median(ttfts[1:]), statistics.median(ttft_cpus[1:])
    prefill_cpu = args.prompt_tokens / ttft_cpu
    print(
        f"prefill {args.prompt_tokens} tokens: TTFT {ttft:.3f} s = {args.prompt_tokens / ttft:.0f} tok/s "
        f"(CPU time {ttft_cpu:.3f} s = {prefill_cpu:.0f} tok/s)"
    )
    decode = SamplingParams(temperature=0, max_tokens=args.decode_tokens + 1, ignore_eos=True)
    rates, cpu_rates = [], []
    for r in range(2):
        start, cpu = time.perf_counter(), time.process_time()
        out = llm.generate([prompt_of(llm, 32, 100 + r)], decode)[0]
        total, total_cpu = time.perf_counter() - start, time.process_time() - cpu
        decoding = total - out.metrics.ttft  # after the 32-token prefill (~1% of the request)
        rates.append(args.decode_tokens / decoding)
        # CPU time of the decode: the request's, in the decode's share of its wall time.
        cpu_rates.append(args.decode_tokens / (total_cpu * decoding / total))
    rate, cpu_rate = max(rates), max(cpu_rates)
    llm.close()
    del llm, net
    sum_s, sum_cpu = ceiling_seconds(weights, getattr(torch, args.dtype))
    gbps = weights / sum_s / 1e9
    ceiling = gbps * 1e9 / streamed
    mode = "compiled" if args.compile_decode else "eager"
    print(
        f"decode batch 1 ({mode}): {rate:.2f} tok/s = {rate * streamed / 1e9:.1f} GB/s of weights; "
        f"streaming ceiling: torch.sum over {weights / 1e9:.2f} GB in {sum_s:.3f} s = {gbps:.1f} GB/s "
        f"-> {ceiling:.2f} tok/s over the {streamed / 1e9:.2f} GB a step reads ({1 / sum_s:.2f} tok/s "
        f"over all the weights); decode = {rate / ceiling:.0%} of the ceiling"
    )
    cpu_ceiling = weights / sum_cpu / streamed
    print(
        f"in CPU time: decode {cpu_rate:.2f} tok/s, ceiling {cpu_ceiling:.2f} tok/s "
        f"({weights / sum_cpu / 1e9:.1f} GB/s): {cpu_rate / cpu_ceiling:.0%}"
    )
    print(
        f"SUMMARY bench_default_model: weights={args.weights} rss_gb={rss / 1e9:.2f} peak_rss_gb={peak / 1e9:.2f} "
        f"prefill_cpu_tok_s={prefill_cpu:.0f} decode_cpu_tok_s={cpu_rate:.2f} load_s={load_s:.1f} rss_over_weights={rss / weights:.2f} "
        f"prefill_tok_s={args.prompt_tokens / ttft:.0f} decode_tok_s={rate:.2f} ({mode}) "
        f"ceiling_tok_s={ceiling:.2f} decode_of_ceiling={rate / ceiling:.2f}"
    )


if __name__ == "__main__":
    main()
