"""bench_mixed_load through the server: does a short request wait behind another's prefill when
everything comes over HTTP? (issue 35)

The engine-level benchmark (bench_mixed_load.py) steps the engine itself and counts a short
request's TTFT from the step it arrived in. Here the same engine serves the OpenAI routes in this
process (uvicorn in a thread, the engine on its own thread, as `chunkcache serve` runs it) and
clients send requests as a user would: a stream (a streamed completion of up to 4,000 tokens)
decodes throughout; the heavy work comes as a request of its own (`long`: a 4,000-token
completions prompt; `prewarm`: POST /v1/chunk_cache/prewarm of 60 documents, waiting for it;
`blend`: a chunked prompt of 4 x 1,000-token documents, first sight); short requests (an 8-token
prompt, one streamed token) are sent one after another while it runs, and on an idle server before
each scenario. A short request's TTFT is from sending it to its first streamed token; the stream's
rate is its tokens over the heavy work's time. The target is the issue's:

  short TTFT under load <= 2 x idle TTFT + one step at the budget (a 2,047-token prompt's TTFT,
  alone); the stream keeps >= 50% of its idle rate.

Times are (wall, process CPU). The clients, the server and the engine share this process and the
engine runs one torch thread, so the process CPU time over an interval is the work done in it
(the clients' share included): on a shared machine it is the figure to read, as in
bench_mixed_load; wall time is printed beside it with the load average.

    python benchmarks/bench_mixed_load_http.py --model smollm2 --dtype float32 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mixed_load import SCENARIOS, make_engine
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

from chunkcache.config import SchedulerConfig
from chunkcache.server.app import build_app
from tests.support.server_util import ServerThread

MODEL = "bench"


Clock = tuple[float, float]  # (wall, process CPU) seconds


def first_token(client: httpx.Client, body: dict[str, Any]) -> Clock:
    """(wall, cpu) seconds from sending a streamed completion to its first token's event."""
    start = now()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True, "model": MODEL}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                end = now()
                return end[0] - start[0], end[1] - start[1]
    raise RuntimeError("no token came")


class Stream(threading.Thread):
    """A streamed completion decoding until told to stop; the time of each token it received."""

    def __init__(self, url: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.times: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=self.url, timeout=None) as client,
            client.stream("POST", "/v1/completions", json=body) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    self.times.append(time.perf_counter())
                if self.stop.is_set():
                    return  # closing the response disconnects: the server aborts the request

    def rate(self, begin: Clock, end: Clock) -> Clock:
        """Tokens per (wall, cpu) second between `begin` and `end`."""
        tokens = sum(begin[0] <= t <= end[0] for t in self.times)
        return tokens / (end[0] - begin[0]), tokens / (end[1] - begin[1])


def heavy_request(args: argparse.Namespace, text: TextMaker, name: str) -> tuple[str, dict[str, Any]]:
    """The heavy work `name` as (route, body), its text made now."""
    if name == "long":
        return "/v1/completions", {"model": MODEL, "prompt": text.text(args.long_tokens), "max_tokens": 1}
    if name == "prewarm":
        docs = [text.text(args.prewarm_doc_tokens) for _ in range(args.prewarm_docs)]
        return "/v1/chunk_cache/prewarm", {"system": text.text(32, special=True), "documents": docs}
    docs = [text.text(args.blend_doc_tokens) for _ in range(4)]
    prompt = SEP.join([text.text(32, special=True), *docs, text.text(16)])
    return "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}


def scenario(url: str, text: TextMaker, args: argparse.Namespace, name: str | None) -> dict[str, Any]:
    """Short requests' TTFTs and the stream's rate, beside heavy work `name` (None: idle)."""
    stream = Stream(url, text.text(32))
    stream.start()
    while not stream.times:
        time.sleep(0.01)
    shorts = [text.text(8) for _ in range(args.shorts)]
    heavy: threading.Thread | None = None
    if name is not None:
        route, body = heavy_request(args, text, name)

        def send() -> None:
            with httpx.Client(base_url=url, timeout=None) as client:
                client.post(route, json=body).raise_for_status()

        heavy = threading.Thread(target=send, daemon=True)
    begin = now()
    if heavy is not None:
        heavy.start()
    ttft = []
    with httpx.Client(base_url=url, timeout=None) as client:
        for prompt in shorts:
            if heavy is not None and not heavy.is_alive():
                break
            ttft.append(first_token(client, {"prompt": prompt, "max_tokens": 1}))
            time.sleep(args.gap)
    if heavy is not None:
        heavy.join()
    end = now()
    stream.stop.set()
    stream.join()
    return {"ttft": ttft, "rate": stream.rate(begin, end), "heavy": (end[0] - begin[0], end[1] - begin[1])}


def report(name: str, run: dict[str, Any], idle: dict[str, Any], step: Clock) -> dict[str, str]:
    out = {}
    for clock, k in (("cpu", 1), ("wall", 0)):
        load, base = [t[k] for t in run["ttft"]], [t[k] for t in idle["ttft"]]
        bound = 2 * median(base) + step[k]
        keep = run["rate"][k] / idle["rate"][k]
        print(
            f"  {name:8s} {clock:4s} short TTFT {median(load):.3f} (max {max(load):.3f}) s vs idle {median(base):.3f} s: "
            f"{median(load) / median(base):.2f}x; bound {bound:.3f} s: max {'within' if max(load) <= bound else 'OVER'}; "
            f"stream {run['rate'][k]:.2f} tok/s vs idle {idle['rate'][k]:.2f} ({keep:.0%}); heavy work "
            f"{run['heavy'][k]:.1f} s; load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        if clock == "cpu":
            out[f"{name}_ttft_x"] = f"{median(load) / median(base):.2f}"
            out[f"{name}_max_over_bound"] = f"{max(load) / bound:.2f}"
            out[f"{name}_decode_keep"] = f"{keep:.2f}"
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shorts", type=int, default=4, help="short requests per scenario run")
    parser.add_argument(
        "--gap", type=float, default=0.2, help="seconds between one short's token and the next"
    )
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--min-decode-share", type=float, default=0.5, help="the engine option (0 = off)")
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--prewarm-docs", type=int, default=60)
    parser.add_argument("--prewarm-doc-tokens", type=int, default=100)
    parser.add_argument("--blend-doc-tokens", type=int, default=1000)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args(argv)
    setup_torch(args.threads)
    threshold = SchedulerConfig().long_prefill_token_threshold
    engine = make_engine(bench_model(args), args, threshold)
    print(
        f"budget {args.budget} threshold {threshold} min_decode_share {args.min_decode_share}; {describe_machine()}"
    )
    text = TextMaker(engine.tokenizer, seed=args.seed)
    server = ServerThread(build_app(engine, api_key=None, max_queue=64, served_model_name=MODEL)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=None) as client:
            step = first_token(client, {"prompt": text.text(args.budget - 1), "max_tokens": 1})
        print(
            f"one step at the budget (a {args.budget - 1}-token prompt's TTFT, alone): cpu {step[1]:.3f} s, wall {step[0]:.3f} s"
        )
        ratios: dict[str, str] = {"min_decode_share": str(args.min_decode_share)}
        for name in args.scenarios.split(","):
            idle = scenario(server.url, text, args, None)
            run = scenario(server.url, text, args, name)
            ratios.update(report(name, run, idle, step))
        server.wait_idle(timeout=120)
        server.on_engine(engine.check_integrity)
    finally:
        server.stop()
    print(summary("bench_mixed_load_http", **ratios))


if __name__ == "__main__":
    main()
