"""What glibc's malloc defaults and KV pages mapped on first write cost a CPU prefill, side by side.

Two engine processes on SmolLM2-135M-Instruct (float32), up at once, one torch thread
each:
- `kept`: the engine as it ships: `keep_freed_memory()` (chunkcache/malloc.py: freed activations
  stay mapped, one arena) and its paged KV blocks committed at start;
- `defaults`: the same engine with glibc's malloc defaults and its KV blocks left unwritten until
  a request writes them (the engine before those two settings).
Each runs its requests on one long-lived thread of its own, as the server steps its engine (a
thread's own malloc arena is what glibc unmaps most eagerly). Every prompt, a fresh ~2,000-token
text of CPython's reference documentation (`pydoc_data.topics`, five topics) with 1 token
generated, goes to both, the side that goes first alternating; the first prompt of each side is a
warm-up, reported apart (the heap grows to a prefill's peak there). Per prefill, from getrusage
of the child process: wall, user and system CPU seconds, minor page faults.

The ratios are `defaults` over `kept` (> 1 = the settings pay). The last line:

    SUMMARY bench_host_memory: wall=X.XXx cpu=X.XXx sys_defaults=Xs sys_kept=Xs faults_defaults=N ...

    python benchmarks/bench_host_memory.py [--threads 1] [--repeats 6] [--prompt-tokens 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from common import passages, summary
from tqdm import tqdm

SIDES = ("kept", "defaults")


def child(side: str, threads: int) -> None:
    """An engine that answers one JSON line per prompt read from stdin (a JSON line too)."""
    import chunkcache.engine.engine as engine_module

    if side == "defaults":
        # The engine without its host-memory settings: glibc's defaults stay, and no KV slot is
        # written before a request writes it.
        engine_module.keep_freed_memory = lambda: False
        shipped_runner = engine_module.ModelRunner

        class LazyRunner(shipped_runner):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **{**kwargs, "committed_slots": 0})

        engine_module.ModelRunner = LazyRunner  # type: ignore[misc]

    from chunkcache import LLM, SamplingParams
    from chunkcache.model.loader import model_path

    # SmolLM2 in float32: what this benchmark measured when it was the default model (auto).
    llm = LLM(model_path("smollm2"), dtype="float32", threads=threads)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    jobs: queue.Queue[str | None] = queue.Queue()
    results: queue.Queue[dict[str, float]] = queue.Queue()

    def serve() -> None:
        while (prompt := jobs.get()) is not None:
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            out = llm.generate(prompt, params)[0]
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_SELF)
            results.put(
                {
                    "wall": wall,
                    "user": after.ru_utime - before.ru_utime,
                    "sys": after.ru_stime - before.ru_stime,
                    "faults": after.ru_minflt - before.ru_minflt,
                    "tokens": len(out.prompt_token_ids),
                    "cached": out.num_cached_tokens,
                }
            )

    worker = threading.Thread(target=serve, name="engine", daemon=True)
    worker.start()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        jobs.put(json.loads(line)["prompt"])
        print(json.dumps(results.get()), flush=True)
    jobs.put(None)
    worker.join()
    llm.close()


class Engine:
    """One side's child process."""

    def __init__(self, side: str, threads: int) -> None:
        self.side = side
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", side, "--threads", str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.side} engine exited (code {self.proc.wait()})")
        return json.loads(line)

    def wait_ready(self) -> None:
        self._read()

    def prefill(self, prompt: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt}) + "\n")
        self.proc.stdin.flush()
        result = self._read()
        if result["cached"]:
            raise RuntimeError(
                f"{self.side}: {result['cached']} prompt tokens were cached; prompts must be fresh"
            )
        return result

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@dataclass
class Runs:
    warmup: dict[str, Any]
    timed: list[dict[str, Any]]

    def mean(self, key: str) -> float:
        return fmean(r[key] for r in self.timed)

    def cpu(self) -> float:
        return fmean(r["user"] + r["sys"] for r in self.timed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    parser.add_argument("--repeats", type=int, default=6, help="timed prompts per side, after one warm-up")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.threads)
        return 0

    from pathlib import Path

    from transformers import AutoTokenizer

    from chunkcache.model.loader import model_path

    gguf = Path(model_path("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Fresh text per prompt: five ~420-token topics, cut to the prompt length.
    pool = [text for _, text in passages(tokenizer, 420)]
    if len(pool) < 5 * (args.repeats + 1):
        raise SystemExit(f"only {len(pool)} passages of 420 tokens; ask for fewer repeats")
    texts = [
        tokenizer.decode(tokenizer.encode(" ".join(pool[i * 5 : i * 5 + 5]))[: args.prompt_tokens])
        for i in range(args.repeats + 1)
    ]
    engines = {side: Engine(side, args.threads) for side in SIDES}
    for engine in engines.values():
        engine.wait_ready()
    runs: dict[str, Runs] = {}
    try:
        for side in SIDES:
            runs[side] = Runs(engines[side].prefill(texts[0]), [])
        for i in tqdm(range(args.repeats), desc="prefills (both sides)"):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            for side in order:
                runs[side].timed.append(engines[side].prefill(texts[i + 1]))
    finally:
        for engine in engines.values():
            engine.close()

    print(f"{'side':9} {'prompt':>7} {'wall s':>8} {'user s':>8} {'sys s':>7} {'faults':>8}")
    for side, r in runs.items():
        w = r.warmup
        print(f"{side:9} {'warm-up':>7} {w['wall']:8.3f} {w['user']:8.3f} {w['sys']:7.3f} {w['faults']:8d}")
        for t in r.timed:
            print(
                f"{side:9} {t['tokens']:7d} {t['wall']:8.3f} {t['user']:8.3f} {t['sys']:7.3f} {t['faults']:8d}"
            )
    d, k = runs["defaults"], runs["kept"]
    print(
        summary(
            "bench_host_memory",
            wall=f"{d.mean('wall') / k.mean('wall'):.2f}x",
            cpu=f"{d.cpu() / k.cpu():.2f}x",
            sys_defaults=f"{d.mean('sys'):.3f}s",
            sys_kept=f"{k.mean('sys'):.3f}s",
            faults_defaults=f"{d.mean('faults'):.0f}",
            faults_kept=f"{k.mean('faults'):.0f}",
            warmup_faults_defaults=str(d.warmup["faults"]),
            warmup_faults_kept=str(k.warmup["faults"]),
            threads=str(args.threads),
            loadavg=f"{os.getloadavg()[0]:.2f}",
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
