"""Does a short request wait behind another's prefill? (issue 35, engine/scheduler.py)

Short requests (an 8-token prompt, one token) arrive one at a time while heavy work runs in the
same engine, against the same requests on an idle engine, interleaved repetition by repetition:

  long     a 4,000-token prompt (prefilled in pieces of `long_prefill_token_threshold`)
  prewarm  a prewarm of 60 documents (background work: it runs on what requests leave)
  blend    a first-sight chunked prompt of 4 x 1,000-token documents (fill jobs, then the blend,
           its layers in pieces of the budget; under layout fusion, the 1.5B's default, the
           streams and the pair stream's document instead)
  blend_warm the same prompt with its documents already in the pool (prewarmed before the clock
           starts): the blend alone, no fill jobs (asked for by --scenarios)

Each short request's TTFT counts from the start of the step that was running when it arrived (the
worst case: a server's request waits for that step), in wall and in process CPU time. A stream
started before the heavy work decodes throughout; its decode rate over the heavy work's steps is
compared with its rate while only short requests come. One step at the budget (a fresh prompt of
`max_num_batched_tokens` tokens, alone) is measured too: the target is

  short TTFT under load <= 2 x idle TTFT + one step at the budget; streams keep >= 50% of their rate.

CPU time is the figure to read on a shared machine (one torch thread: it hardly depends on the
machine's load); wall time is printed beside it with the load average. For the slowest short
request of each scenario the steps it waited through are printed with what each ran (decodes, new
tokens by sequence kind, blend layers): which step held it, if one did. Each scenario is reported
as soon as its last repetition ends, so a run stopped early keeps what it measured.

`--thresholds 256,512,...` first scans the threshold on the long scenario (a fresh engine per
value): the short requests' TTFT and the long prompt's own TTFT at each.

    python benchmarks/bench_mixed_load.py --model smollm2 --dtype float32 --threads 1 [--reps 2]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    SEP,
    TextMaker,
    add_common_args,
    bench_model,
    describe_machine,
    median,
    now,
    setup_torch,
    summary,
)

from chunkcache import LLM, SamplingParams
from chunkcache.engine.engine import LLMEngine
from chunkcache.engine.pieces import remaining
from chunkcache.engine.scheduler import ScheduledBatch
from chunkcache.outputs import RequestOutput

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
STREAM = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
SCENARIOS = ("long", "prewarm", "blend")  # and "blend_warm", where --scenarios names it


@dataclass
class Run:
    """One scenario's measurements: each short request's (wall, cpu) TTFT, the stream's decode
    tokens and the (wall, cpu) time they took, and the heavy work's own (wall, cpu) time."""

    ttft: list[tuple[float, float]] = field(default_factory=list)
    waited: list[list[str]] = field(default_factory=list)  # per short request, the steps it waited
    stream_tokens: int = 0
    stream_time: tuple[float, float] = (0.0, 0.0)
    heavy_time: tuple[float, float] = (0.0, 0.0)


def describe(batch: ScheduledBatch) -> str:
    """A step's batch in words: its decodes, and the new tokens (or blend layers) of each kind."""
    parts: dict[str, int] = {}
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        if not seq.kind.is_background and remaining(seq) == 1:
            continue  # a decode (scheduled, not yet run), counted by batch.decodes
        layers = batch.blend_layers.get(id(seq))
        key = seq.kind.value + (f" blend to layer {layers}" if layers is not None else "")
        parts[key] = parts.get(key, 0) + n
    return ", ".join([f"{batch.decodes} decodes", *(f"{k} {n}" for k, n in parts.items())])


class Driver:
    """Steps one engine; sends the short requests and keeps the stream decoding. Texts are made
    before the clocks start (making them tokenizes). Each step's batch is described as it is
    scheduled, so that a slow short request can be traced to the steps it waited through."""

    def __init__(self, engine: LLMEngine, text: TextMaker, shorts: int, gap: int) -> None:
        self.engine, self.text, self.shorts, self.gap = engine, text, shorts, gap
        self.n = 0
        self.batch = ""
        schedule = engine.scheduler.schedule

        def traced() -> ScheduledBatch:
            batch = schedule()
            self.batch = describe(batch)
            return batch

        engine.scheduler.schedule = traced  # type: ignore[method-assign]

    def _id(self, name: str) -> str:
        self.n += 1
        return f"{name}-{self.n}"

    def _start_stream(self) -> str:
        stream = self._id("stream")
        self.engine.add_request(stream, self.text.text(32), STREAM)
        while not any(o.request_id == stream and o.outputs[0].token_ids for o in self.engine.step()):
            pass  # until it decodes
        return stream

    def run(self, start_heavy: Callable[[str], None] | None) -> Run:
        """Short requests while `start_heavy`'s work runs (until it ends; None: idle, until the
        short requests are done)."""
        texts = [self.text.text(8) for _ in range(self.shorts)]
        stream = self._start_stream()
        heavy = self._id("heavy") if start_heavy is not None else None
        window = _Window(stream, heavy, now())
        if start_heavy is not None and heavy is not None:
            start_heavy(heavy)
        wait = 1
        while True:
            t0 = now()
            outs = self.engine.step()
            t1 = now()
            window.steps.append(f"cpu {t1[1] - t0[1]:.3f} s wall {t1[0] - t0[0]:.3f} s: {self.batch}")
            done = window.observe(outs, t1)
            if done or (heavy is None and len(window.run.ttft) >= self.shorts and window.pending is None):
                break
            wait = self.gap if window.answered else wait - 1
            if window.pending is None and wait <= 0 and texts:
                short = self._id("short")
                self.engine.add_request(short, texts.pop(), ONE)
                window.pending = (short, t0)  # it arrived as the step just run began
                window.steps = window.steps[-1:]  # that step is the first it waits through
        self.engine.abort_request(stream)
        while self.engine.has_unfinished_requests() or self.engine.has_background_work():
            self.engine.step()
        return window.run


@dataclass
class _Window:
    """What one scenario run has seen so far."""

    stream: str
    heavy: str | None
    begin: tuple[float, float]
    run: Run = field(default_factory=Run)
    pending: tuple[str, tuple[float, float]] | None = None  # a short request and when it arrived
    answered: bool = False  # a short request got its first token in the last step
    tokens0: int | None = None
    steps: list[str] = field(default_factory=list)  # since the pending short request arrived

    def observe(self, outs: list[RequestOutput], t1: tuple[float, float]) -> bool:
        """Take one step's outputs; True once the heavy work is done."""
        done, self.answered = False, False
        for out in outs:
            tokens = len(out.outputs[0].token_ids)
            if out.request_id == self.stream:
                self.tokens0 = tokens if self.tokens0 is None else self.tokens0
                self.run.stream_tokens = tokens - self.tokens0
            if self.pending is not None and out.request_id == self.pending[0] and tokens:
                arrived = self.pending[1]
                self.run.ttft.append((t1[0] - arrived[0], t1[1] - arrived[1]))
                self.run.waited.append(list(self.steps))
                self.pending, self.answered = None, True
            if out.request_id == self.heavy and out.finished:
                assert out.outputs[0].finish_reason != "error", out.outputs[0]
                done = True
        self.run.stream_time = (t1[0] - self.begin[0], t1[1] - self.begin[1])
        self.run.heavy_time = self.run.stream_time
        return done


def step_at_budget(engine: LLMEngine, text: TextMaker, budget: int) -> tuple[float, float]:
    """(wall, cpu) of one step that prefills a fresh prompt of `budget` tokens alone."""
    engine.add_request("budget-step", text.text(budget - 1), ONE)
    t0 = now()
    while engine.has_unfinished_requests():
        engine.step()
    t1 = now()
    return t1[0] - t0[0], t1[1] - t0[1]


def heavy_work(
    engine: LLMEngine, text: TextMaker, args: argparse.Namespace, name: str
) -> Callable[[str], None]:
    """The heavy work `name`, its text made now; the returned call adds it to the engine."""
    if name == "long":
        prompt = text.text(args.long_tokens)
        return lambda request_id: engine.add_request(request_id, prompt, ONE)
    if name == "prewarm":
        system = text.text(32, special=True)
        docs = [text.text(args.prewarm_doc_tokens) for _ in range(args.prewarm_docs)]
        return lambda request_id: engine.add_prewarm(request_id, system=system, documents=docs)
    parts = [
        text.text(32, special=True),
        *(text.text(args.blend_doc_tokens) for _ in range(4)),
        text.text(16),
    ]
    if name == "blend_warm":
        engine.add_prewarm(f"prewarm-{parts[1][:8]}", system=parts[0], documents=parts[1:-1])
        while engine.has_unfinished_requests() or engine.has_background_work():
            engine.step()
    return lambda request_id: engine.add_request(request_id, SEP.join(parts), ONE)


def make_engine(model: str, args: argparse.Namespace, threshold: int) -> LLMEngine:
    return LLM(
        model,
        device="cpu",
        dtype=args.dtype,
        threads=args.threads,
        kv_cache_memory_gb=1.0,
        max_num_batched_tokens=args.budget,
        long_prefill_token_threshold=threshold,
        min_decode_share=args.min_decode_share,
    ).engine


def fmt(values: list[float]) -> str:
    return f"{median(values):.3f} (max {max(values):.3f})"


def report(
    name: str, runs: list[Run], idle: list[Run], budget_step: list[tuple[float, float]]
) -> dict[str, str]:
    out = {}
    for clock, k in (("cpu", 1), ("wall", 0)):
        load = [t[k] for r in runs for t in r.ttft]
        base = [t[k] for r in idle for t in r.ttft]
        bound = 2 * median(base) + median([b[k] for b in budget_step])
        rate = median([r.stream_tokens / r.stream_time[k] for r in runs if r.stream_time[k] > 0])
        idle_rate = median([r.stream_tokens / r.stream_time[k] for r in idle if r.stream_time[k] > 0])
        print(
            f"  {name:8s} {clock:4s} short TTFT {fmt(load)} s vs idle {fmt(base)} s: "
            f"{median(load) / median(base):.2f}x median; bound 2 x idle + step {bound:.3f} s: "
            f"max {'within' if max(load) <= bound else 'OVER'}; stream {rate:.2f} tok/s vs idle "
            f"{idle_rate:.2f} ({rate / idle_rate:.0%}); heavy work {median([r.heavy_time[k] for r in runs]):.1f} s"
        )
        if clock == "cpu":
            worst = max((t[1], w) for r in runs for t, w in zip(r.ttft, r.waited, strict=True))
            print(f"    the slowest short request ({worst[0]:.3f} s cpu) waited through:")
            for line in worst[1]:
                print(f"      {line}")
            out[f"{name}_ttft_x"] = f"{median(load) / median(base):.2f}"
            out[f"{name}_max_over_bound"] = f"{max(load) / bound:.2f}"
            out[f"{name}_decode_keep"] = f"{rate / idle_rate:.2f}"
    return out


def scan(model: str, args: argparse.Namespace) -> None:
    print("threshold scan, long scenario, cpu s: short TTFT median / max, the long prompt's own TTFT,")
    print("the stream's decode rate against idle")
    for threshold in args.thresholds:
        engine = make_engine(model, args, threshold)
        text = TextMaker(engine.tokenizer, seed=args.seed + threshold)
        driver = Driver(engine, text, args.shorts, args.gap)
        idle, runs = [], []
        for _ in range(args.reps):
            idle.append(driver.run(None))
            runs.append(driver.run(heavy_work(engine, text, args, "long")))
        ttft = [t[1] for r in runs for t in r.ttft]
        rate = median([r.stream_tokens / r.stream_time[1] for r in runs])
        idle_rate = median([r.stream_tokens / r.stream_time[1] for r in idle])
        print(
            f"  threshold {threshold:5d}: short {median(ttft):.3f} / {max(ttft):.3f} "
            f"(idle {median([t[1] for r in idle for t in r.ttft]):.3f}), long {median([r.heavy_time[1] for r in runs]):.2f} "
            f"(wall {median([r.heavy_time[0] for r in runs]):.2f}), stream {rate / idle_rate:.0%} of idle",
            flush=True,
        )
        del engine, driver
        gc.collect()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--shorts", type=int, default=4, help="short requests per scenario run")
    parser.add_argument("--gap", type=int, default=2, help="steps between a short's first token and the next")
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument(
        "--threshold", type=int, default=None, help="long_prefill_token_threshold (default: the engine's)"
    )
    parser.add_argument("--min-decode-share", type=float, default=0.5, help="the engine option (0 = off)")
    parser.add_argument("--thresholds", type=lambda s: [int(x) for x in s.split(",")], default=[])
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--prewarm-docs", type=int, default=60)
    parser.add_argument("--prewarm-doc-tokens", type=int, default=100)
    parser.add_argument("--blend-doc-tokens", type=int, default=1000)
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated, of long, prewarm, blend, blend_warm",
    )
    args = parser.parse_args(argv)
    setup_torch(args.threads)
    model = bench_model(args)
    if args.thresholds:
        scan(model, args)
    from chunkcache.config import SchedulerConfig

    threshold = args.threshold or SchedulerConfig().long_prefill_token_threshold
    engine = make_engine(model, args, threshold)
    print(
        f"model {model} dtype {args.dtype} budget {args.budget} threshold {threshold} "
        f"min_decode_share {args.min_decode_share}; {describe_machine()}"
    )
    text = TextMaker(engine.tokenizer, seed=args.seed)
    driver = Driver(engine, text, args.shorts, args.gap)
    scenarios = args.scenarios.split(",")
    runs: dict[str, list[Run]] = {name: [] for name in ["idle", *scenarios]}
    budget_step = []
    ratios: dict[str, str] = {"threshold": str(threshold), "min_decode_share": str(args.min_decode_share)}
    for rep in range(args.reps):
        budget_step.append(step_at_budget(engine, text, args.budget))
        if rep == args.reps - 1:
            print(
                f"one step at the budget: cpu {median([b[1] for b in budget_step]):.3f} s, "
                f"wall {median([b[0] for b in budget_step]):.3f} s",
                flush=True,
            )
        for name in scenarios:  # idle before each scenario: interleaved
            runs["idle"].append(driver.run(None))
            runs[name].append(driver.run(heavy_work(engine, text, args, name)))
            if rep == args.reps - 1:  # reported as soon as it is done: a long run's partial result
                ratios.update(report(name, runs[name], runs["idle"], budget_step))
                print(f"  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        print(f"  rep {rep + 1}/{args.reps} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(summary("bench_mixed_load", **ratios))


if __name__ == "__main__":
    main()
