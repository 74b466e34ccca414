"""bench_fidelity_gate: the fidelity controller over a stream of RAG prompts (issue 34).

A stream of the built-in fidelity questions that calibration did not see (`--split heldout` for a
profile calibrated with `--split tune`; else those after the first `--skip`, the profile's
prompts), shuffled, repeats allowed, goes one request at a time through an
engine with `fidelity_target` and the model's profile, every `--sample-rate` of them shadow
checked; with `--start fastest` the controller starts at the profile's fastest configuration
(the issue's setup) instead of the gate's choice. Each prompt is also run as a plain full prefill
(prefix cache reset first) for reference. Reported: answers kept vs full prefill (where full
prefill answered correctly, the served reply is correct too), greedy replies identical to full
prefill's, mean TTFT speedup (full's TTFT over the served one's, documents warm in the pool),
the configuration over the stream (JSON, PNG with matplotlib), and the CPU seconds of the steps
that ran only shadow checks (the prefix cache reset first: the reference run's blocks would make
them nearly free) against the CPU seconds of serving the stream, and that share scaled to the
default sample rate 0.01.

    python benchmarks/bench_fidelity_gate.py --model smollm2 --threads 1 --limit 16 --start fastest
    python benchmarks/bench_fidelity_gate.py --model qwen2.5-coder-1.5b --profile P --split heldout --skip 0
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from chunkcache import LLM, SamplingParams
from chunkcache.fidelity import measure
from chunkcache.fidelity.prompts import SPLITS, builtin

HERE = Path(__file__).parent


def _step_until(llm: LLM, done: Any) -> None:
    while not done():
        llm.engine.step()


def _serve(
    llm: LLM, request_id: str, prompt: str | list[int], params: SamplingParams
) -> tuple[Any, float, float]:
    """One request through the engine's steps: (its final output, CPU seconds until its first
    token, CPU seconds until it finished)."""
    engine = llm.engine
    engine.add_request(request_id, prompt, params, add_special_tokens=False)
    final: list[Any] = []
    first: list[float] = []
    cpu = time.process_time()

    def finished() -> bool:
        for o in engine.step():
            if o.request_id == request_id and o.outputs[0].token_ids and not first:
                first.append(time.process_time() - cpu)
            if o.request_id == request_id and o.finished:
                final.append(o)
        return bool(final)

    while not finished():
        pass
    return final[0], first[0] if first else 0.0, time.process_time() - cpu


def _ttft(out: Any) -> float:
    m = out.metrics
    return (m.first_token_time or 0.0) - m.arrival_time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weights", default=None, help="the engine's weights option (default: the model's)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", default=str(HERE / "results" / "calibrate_smollm2_profile.json"))
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--sample-rate", type=float, default=1.0)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--split", choices=SPLITS, default="all", help="built-in questions: which half")
    p.add_argument("--skip", type=int, default=80, help="built-in prompts the profile was calibrated on")
    p.add_argument("--limit", type=int, default=16, help="held-out prompts in the stream")
    p.add_argument("--repeats", type=int, default=1, help="each prompt appears this many times")
    p.add_argument("--max-tokens", type=int, default=0, help="0 = the profile's")
    p.add_argument("--start", choices=("gate", "fastest"), default="fastest")
    p.add_argument(
        "--max-share", type=float, default=1.0, help="fidelity_max_share (1.0: every drawn request checked)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results" / "fidelity_gate_smollm2.json"))
    p.add_argument("--minutes", type=float, default=0, help="stop the stream after this long (0 = never)")
    args = p.parse_args(argv)
    profile = json.loads(Path(args.profile).read_text())
    max_tokens = args.max_tokens or profile["max_tokens"]
    llm = LLM(
        args.model, dtype=args.dtype, weights=args.weights, device="cpu", threads=args.threads, fidelity_target=args.target,
        fidelity_profile=args.profile, fidelity_sample_rate=args.sample_rate, fidelity_window=args.window,
        fidelity_max_share=args.max_share, **measure.ENGINE_OPTIONS,
    )  # fmt: skip
    engine = llm.engine
    ctl = engine.shadows.controller
    assert ctl is not None, "the profile did not load"
    if args.start == "fastest":
        ctl.index = 0  # the setup: start fast, let live agreement move it
    prompts = builtin(args.skip + args.limit, "both", args.split)[args.skip :] * args.repeats
    random.Random(args.seed).shuffle(prompts)
    sep = engine.config.chunk.separator
    answer = SamplingParams(temperature=0, max_tokens=max_tokens)
    rows: list[dict[str, Any]] = []
    serve_cpu = shadow_cpu = 0.0
    started = time.perf_counter()
    for i, q in enumerate(prompts):
        if args.minutes and time.perf_counter() - started > 60 * args.minutes:
            print(f"stopping after {i} prompts: --minutes {args.minutes} passed", flush=True)
            break
        text = measure.render(llm.tokenizer, list(q.documents), q.question, sep)
        full_ids = measure.parse(llm, text).all_token_ids()
        engine.reset_prefix_cache()
        accounted = engine.shadows.step_cpu
        full, full_first_cpu, _ = _serve(llm, f"full-{i}", full_ids, answer)
        _step_until(llm, lambda: not engine.has_background_work())
        # The reference is the benchmark's, not traffic: it must not dilute the shadows' CPU share
        # the engine holds under fidelity_max_share.
        engine.shadows.step_cpu = accounted
        cpu = time.process_time()
        measure.warm(llm, text)  # the documents in the pool: a warm request, as in calibrate
        config = ctl.current.name
        served, first_cpu, request_cpu = _serve(llm, f"served-{i}", text, answer)
        serve_cpu += time.process_time() - cpu
        # The reference run above left this prompt's plain blocks in the prefix cache, where the
        # shadow (a plain prefill of the same tokens) would find them: live traffic would not.
        engine.reset_prefix_cache()
        cpu = time.process_time()
        _step_until(llm, lambda: not engine.has_background_work())  # the shadow check, if sampled
        shadow_cpu += time.process_time() - cpu
        full_ok, served_ok = q.correct(full.outputs[0].text), q.correct(served.outputs[0].text)
        rows.append({
            "config": config, "identical": full.outputs[0].token_ids == served.outputs[0].token_ids,
            "full_correct": full_ok, "served_correct": served_ok,
            "ttft_full_s": _ttft(full), "ttft_served_s": _ttft(served), "request_cpu_s": request_cpu,
            "first_token_cpu_full_s": full_first_cpu, "first_token_cpu_served_s": first_cpu,
        })  # fmt: skip
        print(f"{i:3d} {config:20s} same={rows[-1]['identical']!s:5s} full_ok={full_ok} served_ok={served_ok} "
              f"ttft {rows[-1]['ttft_full_s'] * 1e3:.0f} -> {rows[-1]['ttft_served_s'] * 1e3:.0f} ms", flush=True)  # fmt: skip
    counted = [r for r in rows if r["full_correct"]]
    kept = sum(bool(r["served_correct"]) for r in counted)
    speedups = [r["ttft_full_s"] / r["ttft_served_s"] for r in rows if r["ttft_served_s"] > 0]
    cpu_speedups = [
        r["first_token_cpu_full_s"] / r["first_token_cpu_served_s"]
        for r in rows
        if r["first_token_cpu_served_s"] > 0
    ]
    checks = sum(sum(v for k, v in c.items() if k in ("agree", "disagree", "distribution"))
                 for c in (engine.chunk_cache_stats() or {}).get("fidelity", {}).get("configs", {}).values())  # fmt: skip
    # What a check costs against serving one request, scaled to the default rate 0.01 (an estimate).
    per_check = shadow_cpu / checks if checks else 0.0
    at_default = 0.01 * per_check / (serve_cpu / len(rows) + 0.01 * per_check)
    # The same against the served request alone: documents already in the pool (warm traffic).
    served_cpu = sum(r["request_cpu_s"] for r in rows) / len(rows)
    at_default_warm = 0.01 * per_check / (served_cpu + 0.01 * per_check)
    stats = engine.chunk_cache_stats()
    summary = {
        "model": args.model, "dtype": args.dtype, "weights": llm.engine.config.weights, "target": args.target, "sample_rate": args.sample_rate,
        "window": args.window, "start": args.start, "split": args.split, "skip": args.skip, "prompts": len(rows),
        "kept": kept, "counted": len(counted),
        "identical": sum(r["identical"] for r in rows),
        "mean_ttft_speedup": sum(speedups) / len(speedups),
        "mean_first_token_cpu_speedup": sum(cpu_speedups) / len(cpu_speedups) if cpu_speedups else None,
        "serve_cpu_s": serve_cpu, "shadow_cpu_s": shadow_cpu, "checks": checks,
        "shadow_cpu_share": shadow_cpu / (serve_cpu + shadow_cpu), "shadow_cpu_share_at_0.01": at_default,
        "served_request_cpu_s": served_cpu, "shadow_cpu_share_at_0.01_warm": at_default_warm,
        "max_share": args.max_share, "engine_shadow_cpu_share": engine.shadows.cpu_share,
        "fidelity": stats["fidelity"] if stats else None,
        "configs_over_time": [r["config"] for r in rows],
    }  # fmt: skip
    Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    _plot(rows, [r.name for r in ctl.rungs], Path(args.out).with_suffix(".png"))
    print(
        f"SUMMARY kept {kept}/{len(counted)} of full prefill's correct answers; identical replies "
        f"{summary['identical']}/{len(rows)}; mean TTFT speedup {summary['mean_ttft_speedup']:.2f}x "
        f"(first-token CPU {summary['mean_first_token_cpu_speedup'] or 0:.2f}x); shadow CPU {shadow_cpu:.1f} s "
        f"for {checks} checks = {100 * summary['shadow_cpu_share']:.1f}% at sample rate {args.sample_rate}, "
        f"{100 * at_default:.2f}% scaled to 0.01 ({100 * at_default_warm:.2f}% of the served requests alone: "
        f"{per_check:.1f} s per check, {served_cpu:.1f} s per request); engine's shadow CPU share "
        f"{100 * engine.shadows.cpu_share:.1f}% (max {100 * args.max_share:.0f}%); configurations {' '.join(summary['configs_over_time'])}"
    )
    llm.close()


def _plot(rows: list[dict[str, Any]], ladder: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.step(range(len(rows)), [ladder.index(r["config"]) for r in rows], where="post")
    ax.set_yticks(range(len(ladder)), ladder)
    ax.set_xlabel("request in the stream")
    ax.set_title("fidelity controller: configuration per request")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
