"""Serving benchmark in the shape of `vllm bench serve`: RAG requests through HTTP, several sides.

The sides (`--sides`, serve_sides.py) serve the same model on the same core budget (`--threads`):
chunkcache with its default reuse (`chunkcache`), chunkcache with the chunk cache off
(`chunkcache-off`, prefix cache on), and llama.cpp's own server on the same GGUF file
(`llama.cpp`: `llama-server`, built once by llama_server.py, its prompt cache on,
`--cache-reuse 256`, slots = the run's concurrency); and, when asked, a cluster per router policy
(`cluster-cache_aware`, `cluster-round_robin`, ...: `--replicas` chunkcache servers sharing
`--threads`, behind `chunkcache route`, issue 57). The workload (serve_workload.py): a corpus of
`--num-chunks` real-text chunks of ~`--chunk-tokens` tokens (elements' documents from the
`mendeleev` package), each request `k` of them (`--k-min`..`--k-max`) drawn by Zipf popularity
(`--zipf`) in random order with a question about one, as `SYSTEM # # doc # # ... # # question`
(the same text to every side), and a fixed output length in `--out-min`..`--out-max` forced with
ignore_eos. The same `--num-requests` requests make every run.

A run is one side at one setting: a fixed concurrency (`--concurrency 1,4,8`: at most that many
requests in flight) or a Poisson arrival rate (`--rates 0.05,0.1,inf`, requests/s; inf = all at
once). Only one side works at a time: the requests are cut into `--rounds` consecutive slices, and
each slice runs on every side in turn, the order alternating per round, so that a drift of the
machine's load hits every side alike. Every setting starts every server afresh, then shows it
every chunk once (warm-up prompts of 4 chunks, not timed; `--cold` skips that): each run starts
from the warm state a serving system lives in, and none reads the KV of the prompts another
setting sent (the same requests make every run).

Reported per run (serve_metrics.py): TTFT p50/p90/p99, TPOT and ITL, output tokens/s, requests/s,
goodput (requests/s that met `--slo-ttft` and `--slo-tpot`; none met is goodput 0, with a note),
the share of prompt tokens each side reports served from its caches (usage cached_tokens), errors
(counted, the first few printed) and each server's resident memory; a PNG of TTFT percentiles
against the setting per side (`--plot`); every request's timings as JSON (`--raw`, rewritten after
each setting; a rerun with the same workload arguments reports the settings it holds, at its own
SLO, without running them again). The last line:

    SUMMARY bench_serve: c8_goodput_cc_over_llamacpp=...x c8_ttft_p50_cc_over_llamacpp=...x ...

(cc = chunkcache, off = chunkcache-off; ratios are chunkcache's figure over the other side's:
goodput > 1 and TTFT < 1 favour chunkcache.)

Usage:
    python benchmarks/bench_serve.py      # a small random checkpoint, chunkcache vs chunkcache-off
    python benchmarks/bench_serve.py --model qwen2.5-coder-1.5b --num-requests 24 --concurrency 1,8
    python benchmarks/bench_serve.py --model qwen2.5-coder-1.5b --rates 0.05,0.1,inf --raw out.json
    python benchmarks/bench_serve.py --model smollm2 -- --max-num-seqs 32   # after --: chunkcache args
    python benchmarks/bench_serve.py --model qwen2.5-coder-1.5b --sides cluster-cache_aware,cluster-round_robin
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import serve_workload as wl
from serve_client import at_concurrency, at_times, client_for
from serve_metrics import RequestResult, percentile, ratio, run_figures, slo_note, table
from serve_sides import CLUSTER_POLICIES, REPO, SHORT, SIDES, ServerProcess, Side, make_sides
from tqdm import tqdm

__all__ = ["ServerProcess", "main", "percentile"]  # bench_llamacpp imports the first and the last

# The default model: the tiny recipe widened and deepened until a prefill costs real compute, so
# the TTFT difference measures attention/MLP work saved, not HTTP overhead. Random weights.
SMALL_OVERRIDES: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 768,
    "max_position_embeddings": 4096,
}
# Workload options whose defaults differ: (help, the real model's, the random checkpoint's: its
# tokenizer spends ~2 tokens per estimated one, its context is 4,096).
PER_MODEL: dict[str, tuple[str, Any, Any]] = {
    "chunk_tokens": ("~tokens per chunk", 500, 100),
    "k_min": ("chunks per request, at least", 4, 2),
    "k_max": ("chunks per request, at most", 8, 4),
    "out_min": ("output tokens, at least", 16, 8),
    "out_max": ("output tokens, at most", 128, 16),
    "concurrency": ("fixed-concurrency runs, a list (none by default with --rates)", "1,4,8,16", "4"),
}
WORKLOAD_ARGS = ("model", "num_chunks", "chunk_tokens", "k_min", "k_max", "zipf", "out_min", "out_max",
                 "num_requests", "seed", "threads", "cold", "rounds", "sides", "ctx",
                 "rate_slots")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # fmt: off
    p.add_argument("--model", help="a known model's name, a .gguf or a checkpoint (default: a small random one)")
    p.add_argument("--sides", help=f"of {','.join(SIDES)} (default: the first three with --model, else two)")
    p.add_argument("--threads", type=int, default=2, help="each side's threads (default: %(default)s)")
    p.add_argument("--replicas", type=int, default=2, help="a cluster side's replicas, sharing --threads (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--num-chunks", type=int, default=64, help="chunks in the corpus, M (default: %(default)s)")
    p.add_argument("--zipf", type=float, default=1.0, help="popularity skew s: rank r weighs 1/r^s (0: uniform)")
    for key, (text, real, small) in PER_MODEL.items():
        p.add_argument("--" + key.replace("_", "-"), type=type(real), help=f"{text} (default {real}; small model {small})")
    p.add_argument("--rates", help="Poisson runs at these requests/s, a list (inf: all at once)")
    p.add_argument("--rate-slots", type=int, default=8, help="llama-server's slots in rate runs (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per setting (default: %(default)s)")
    p.add_argument("--slo-ttft", type=float, default=10.0, help="goodput's TTFT bound, s (default: %(default)s)")
    p.add_argument("--slo-tpot", type=float, default=0.5, help="goodput's TPOT bound, s (default: %(default)s)")
    p.add_argument("--cold", action="store_true", help="no warm-up: every run starts from empty caches")
    p.add_argument("--ctx", type=int, default=8192, help="llama-server's context per slot (default: %(default)s)")
    p.add_argument("--llama-server", type=Path, help="an existing llama-server binary (default: build one)")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", type=Path, help="every request's timings as JSON; a rerun resumes from it")
    p.add_argument("--plot", type=Path, help="TTFT percentiles PNG (default: in the temp work dir)")
    # fmt: on
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options, each workload default the model's, and the chunkcache arguments after `--`."""
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    p = build_parser()
    args = p.parse_args(argv)
    for key, (_, real, small) in PER_MODEL.items():
        if getattr(args, key) is None and not (key == "concurrency" and args.rates):
            setattr(args, key, real if args.model else small)
    args.sides = [s for s in (args.sides or ",".join(SIDES[:3] if args.model else SIDES[:2])).split(",") if s]
    if bad := [s for s in args.sides if s not in SIDES]:
        p.error(f"unknown sides {bad}; of {SIDES}")
    return args, extra


def settings(args: argparse.Namespace) -> list[tuple[str, float]]:
    """("rate", r) and ("concurrency", c) in the order given."""
    return [("rate", r) for r in wl.parse_list(args.rates)] + [
        ("concurrency", c) for c in wl.parse_list(args.concurrency, int)
    ]


def label(kind: str, value: float) -> str:
    """The setting's key: "c8", "r0.1", "rinf"."""
    return f"c{int(value)}" if kind == "concurrency" else f"r{value:g}"


def model_files(model: str | None, work: Path) -> tuple[str, Path | None]:
    """What chunkcache serves, and the GGUF llama.cpp serves (None: no GGUF)."""
    if model is None:
        from tests.support.tiny_checkpoint import build_checkpoint

        # build_checkpoint caches by its arguments: a rerun reuses the directory.
        return str(build_checkpoint(work / "bench-serve-small", arch="llama", **SMALL_OVERRIDES)), None
    if model.endswith(".gguf"):
        return model, Path(model)
    if Path(model).is_dir():
        ggufs = sorted(Path(model).glob("*.gguf"))
        return model, ggufs[0] if ggufs else None
    from chunkcache.model.loader import model_path

    return model, Path(model_path(model))


async def warm_up(side: Side, corpus: list[wl.Chunk], timeout: float) -> float:
    """Every chunk once on the side, one prompt at a time (1 token each)."""
    assert side.server is not None
    prompts = wl.warmup_prompts(corpus)
    bar = tqdm(total=len(prompts), desc=f"warm {side.name}", unit="req")
    async with client_for(side.server.url, timeout) as client:
        results, took = await at_concurrency(client, [(p, 1) for p in prompts], 1, lambda: bar.update(1))
    bar.close()
    # One token each: an empty first token is no error here, the prefill is what warms.
    errors = [r.error for r in results if not r.ok and r.error != "no token received"]
    print(
        f"warm-up {side.name}: {len(prompts)} prompts in {took:.1f}s"
        + (f", errors: {errors[:3]}" if errors else "")
    )
    return took


async def run_setting(
    sides: list[Side], requests: list[wl.Request], kind: str, value: float, args: argparse.Namespace
) -> dict[str, tuple[list[RequestResult], float]]:
    """Every side over the same requests at one setting, in alternating rounds."""
    out: dict[str, tuple[list[RequestResult], float]] = {s.name: ([], 0.0) for s in sides}
    offsets = wl.arrival_offsets(len(requests), value, args.seed) if kind == "rate" else []
    bar = tqdm(total=len(requests) * len(sides), desc=label(kind, value), unit="req")
    for r, part in enumerate(wl.slices(len(requests), args.rounds)):
        work = [(requests[i].prompt, requests[i].max_tokens) for i in part]
        for side in sides if r % 2 == 0 else sides[::-1]:
            assert side.server is not None
            async with client_for(side.server.url, args.request_timeout) as client:
                if kind == "rate":
                    got = await at_times(client, work, [offsets[i] for i in part], lambda: bar.update(1))
                else:
                    got = await at_concurrency(client, work, int(value), lambda: bar.update(1))
            results, duration = out[side.name]
            out[side.name] = (results + got[0], duration + got[1])
    bar.close()
    return out


def run_all(args: argparse.Namespace, sides: list[Side], corpus: list[wl.Chunk], requests: list[wl.Request],
            raw: dict[str, Any]) -> None:  # fmt: skip
    """Every setting not yet in `raw`: servers up and warm, the runs, the table; raw rewritten."""
    for kind, value in settings(args):
        key = label(kind, value)
        if key in raw["runs"]:
            print(f"{key}: in {args.raw}, not run again; its figures at this SLO")
            for run in raw["runs"][key].values():
                results = [RequestResult(**r) for r in run["results"]]
                run["figures"] = run_figures(
                    results, run["figures"]["duration_s"], args.slo_ttft, args.slo_tpot
                )
            report_setting(key, raw["runs"][key], args)
            continue
        slots = int(value) if kind == "concurrency" else args.rate_slots
        warm_s = {}
        for side in sides:
            side.restart(slots)
            if not args.cold:
                warm_s[side.name] = asyncio.run(warm_up(side, corpus, args.request_timeout))
        if kind == "concurrency" and min(map(len, wl.slices(len(requests), args.rounds))) < value:
            print(f"note: a round's slice holds fewer requests than concurrency {int(value)}")
        got = asyncio.run(run_setting(sides, requests, kind, value, args))
        runs = {}
        for side in sides:
            results, duration = got[side.name]
            figures = run_figures(results, duration, args.slo_ttft, args.slo_tpot)
            runs[side.name] = {
                "figures": figures, "memory": side.memory(), "stats": chunk_stats(side),
                "warmup_s": warm_s.get(side.name),
                "results": [vars(r) for r in results],
            }  # fmt: skip
        raw["runs"][key] = runs
        report_setting(key, runs, args)
        if args.raw:
            args.raw.write_text(json.dumps(raw, indent=1))


def chunk_stats(side: Side) -> dict[str, Any]:
    """chunkcache's chunk cache stats (hits, misses, entries); {} for llama-server."""
    if side.is_llama or side.server is None:
        return {}
    import httpx

    try:
        found = [
            httpx.get(f"{url}/v1/chunk_cache/stats", timeout=10).json() for url in side.server.stats_urls()
        ]
    except (httpx.HTTPError, ValueError):
        return {}
    if len(found) == 1:
        return found[0]
    # A cluster: its replicas' counts summed.
    summed = {k: sum(f.get(k) or 0 for f in found) for k in ("hits", "misses", "entries")}
    return {"enabled": any(f.get("enabled") for f in found), **summed}


def report_setting(key: str, runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print("\n" + table(key, {side: run["figures"] for side, run in runs.items()}))
    for side, run in runs.items():
        f, mem, stats = run["figures"], run["memory"], run["stats"]
        notes = [f"RSS {mem['VmRSS'] / 1e9:.2f} GB (peak {mem['VmHWM'] / 1e9:.2f})",
                 f"cached {int(f['cached_tokens'])}/{int(f['prompt_tokens'])} prompt tokens"]  # fmt: skip
        if stats.get("enabled"):
            notes.append(
                f"chunk cache hits {stats.get('hits')} misses {stats.get('misses')} entries {stats.get('entries')}"
            )
        if note := slo_note(f, args.slo_ttft, args.slo_tpot):
            notes.append(note)
        print(f"  {side}: " + "; ".join(notes))
        print(f"  {side} per round: " + per_round(run["results"], args.rounds))
        for error in [r["error"] for r in run["results"] if not r["ok"]][:3]:
            print(f"  {side} error: {error}")


def per_round(results: list[dict[str, Any]], rounds: int) -> str:
    """TTFT and TPOT p50 of each round's slice: how far the machine drifted under a side."""
    out = []
    for part in wl.slices(len(results), rounds):
        ok = [RequestResult(**results[i]) for i in part if results[i]["ok"]]
        tpots = [t for r in ok if (t := r.tpot) is not None]
        out.append(
            f"TTFT {percentile([r.ttft for r in ok], 50):.2f}s TPOT {percentile(tpots, 50) * 1e3:.0f}ms"
        )
    return " | ".join(out)


def summary_line(args: argparse.Namespace, runs: dict[str, dict[str, dict[str, Any]]]) -> str:
    parts: list[str] = []
    for key, by_side in runs.items():
        f = {side: run["figures"] for side, run in by_side.items()}
        for policy in CLUSTER_POLICIES[1:]:  # cache-aware routing against each other policy run
            ca, other = f.get("cluster-cache_aware"), f.get(f"cluster-{policy}")
            if ca is not None and other is not None:
                for m in ("goodput", "ttft_p50", "ttft_p90"):
                    parts.append(
                        f"{key}_{m}_cl_ca_over_{SHORT['cluster-' + policy]}={ratio(ca[m], other[m])}"
                    )
        if "chunkcache" in f:
            for other in ("llama.cpp", "chunkcache-off"):
                if other in f:
                    for m in ("goodput", "ttft_p50", "ttft_p99"):
                        parts.append(
                            f"{key}_{m}_cc_over_{SHORT[other]}={ratio(f['chunkcache'][m], f[other][m])}"
                        )
        for side, g in f.items():
            s = SHORT[side]
            parts += [f"{key}_goodput_{s}={g['goodput']:.3f}", f"{key}_ttft_p50_{s}={g['ttft_p50']:.2f}s",
                      f"{key}_ttft_p99_{s}={g['ttft_p99']:.2f}s", f"{key}_errors_{s}={int(g['errors'])}"]  # fmt: skip
    parts += [f"slo_ttft={args.slo_ttft:g}s", f"slo_tpot={args.slo_tpot:g}s", f"requests={args.num_requests}",
              f"threads={args.threads}", f"model={args.model or 'small-random'}",
              f"loadavg={os.getloadavg()[0]:.2f}"]  # fmt: skip
    return "SUMMARY bench_serve: " + " ".join(parts)


def plot(path: Path, runs: dict[str, dict[str, dict[str, Any]]]) -> None:
    """TTFT p50/p90/p99 per side against the setting, a panel per kind (rate, concurrency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in ("r", "c") if any(key.startswith(k) for key in runs)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        keys = [key for key in runs if key.startswith(kind)]
        sides = list(runs[keys[0]])
        for i, side in enumerate(sides):
            for q, style, marker in ((50, "-", "o"), (90, "--", "s"), (99, ":", "^")):
                ys = [runs[key][side]["figures"][f"ttft_p{q}"] for key in keys]
                ax.plot(range(len(keys)), ys, style, marker=marker, color=f"C{i}", label=f"{side} p{q}")
        ax.set_xticks(range(len(keys)), [key[1:] for key in keys])
        ax.set_xlabel("rate (requests/s)" if kind == "r" else "concurrency")
        ax.set_ylabel("TTFT (s)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("bench_serve: TTFT percentiles")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    sys.path.insert(0, str(REPO))  # chunkcache, and tests.support.tiny_checkpoint (the random checkpoint)
    work = Path(tempfile.gettempdir()) / "chunkcache-bench"
    work.mkdir(parents=True, exist_ok=True)
    model, gguf = model_files(args.model, work)
    corpus = wl.element_corpus(args.num_chunks, args.chunk_tokens, args.seed)
    requests = wl.build_requests(corpus, args.num_requests, (args.k_min, args.k_max),
                                 (args.out_min, args.out_max), args.zipf, args.seed)  # fmt: skip
    signature = {k: getattr(args, k) for k in WORKLOAD_ARGS}
    raw: dict[str, Any] = {"workload": signature, "runs": {}}
    if args.raw and args.raw.exists() and json.loads(args.raw.read_text()).get("workload") == signature:
        raw = json.loads(args.raw.read_text())
    mean_k = sum(len(r.chunks) for r in requests) / len(requests)
    print(
        f"model {model} (llama.cpp: {gguf}); sides {args.sides}; threads {args.threads}; chunkcache args {extra}\n"
        f"workload: {args.num_requests} requests of {args.k_min}-{args.k_max} chunks (mean {mean_k:.1f}) of "
        f"{args.num_chunks} (~{args.chunk_tokens} tokens, zipf {args.zipf}), {args.out_min}-{args.out_max} "
        f"output tokens; {'cold' if args.cold else 'warm'}; SLO TTFT {args.slo_ttft:g}s TPOT {args.slo_tpot:g}s\n"
        f"machine: {os.cpu_count()} cpus, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; logs in {work}"
    )

    def binary() -> Path:
        from llama_server import llama_server_binary

        return args.llama_server or llama_server_binary()

    sides = make_sides(args.sides, model, gguf, binary, args.threads, args.ctx, extra, work, args.replicas)
    try:
        run_all(args, sides, corpus, requests, raw)
    finally:
        for side in sides:
            side.stop()
    plot(args.plot or work / "bench_serve_ttft.png", raw["runs"])
    print(summary_line(args, raw["runs"]))
    return 1 if any(run["figures"]["errors"] for r in raw["runs"].values() for run in r.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
