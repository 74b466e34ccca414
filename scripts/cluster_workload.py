"""The RAG workload of scripts/cluster_demo.sh, sent to one router; and the demo's summary.

`send`: documents grouped into topics (a retrieval result); each round asks every topic once, in a
shuffled order, its documents in a fresh order with a new question (`SYS # # D.. # # Q`), one
request at a time. Each request is streamed; printed: the replica that served it (the router's
`x-chunkcache-backend` header), the prompt tokens served from cache (usage `cached_tokens`) and the
time to the first token. The last line is `RESULT {json}`.
`summary A.json B.json`: cached tokens and mean TTFT of each policy, and their ratio.

Seeded: every policy gets the same requests in the same order. Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

SYSTEM = "You are a careful assistant. Answer the question from the documents below, citing the one you used."
SEPARATOR = " # # "
WORDS = [
    "river",
    "mountain",
    "harbor",
    "engine",
    "winter",
    "signal",
    "copper",
    "garden",
    "market",
    "bridge",
    "lantern",
    "orbit",
    "forest",
    "archive",
    "needle",
    "thunder",
    "meadow",
    "canyon",
    "ledger",
    "pilot",
    "quarry",
    "ribbon",
    "saddle",
    "timber",
    "valley",
    "whistle",
    "anchor",
    "beacon",
    "cobalt",
    "delta",
    "ember",
    "falcon",
    "glacier",
    "harvest",
    "island",
    "jasper",
    "kernel",
    "lagoon",
    "marble",
    "nectar",
    "oasis",
    "prairie",
    "quartz",
    "summit",
    "tundra",
    "umber",
    "violet",
    "willow",
    "yonder",
    "zephyr",
]


def documents(count: int, words: int, rng: random.Random) -> list[str]:
    return [f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "." for i in range(count)]


def prompts(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    docs = documents(args.topics * args.docs_per_topic, args.doc_words, rng)
    topics = [docs[i : i + args.docs_per_topic] for i in range(0, len(docs), args.docs_per_topic)]
    out = []
    for r in range(args.rounds):
        for t in rng.sample(range(len(topics)), len(topics)):
            chosen = rng.sample(topics[t], len(topics[t]))
            question = f"Question {r}.{t}: which document mentions {rng.choice(WORDS)} first?"
            out.append(SEPARATOR.join([SYSTEM, *chosen, question]))
    return out


def one_request(client: httpx.Client, model: str, prompt: str) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, ttft, usage = time.perf_counter(), 0.0, {}
    with client.stream("POST", "/v1/completions", json=body) as r:
        backend = r.headers.get("x-chunkcache-backend", "")
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and not ttft:
                ttft = time.perf_counter() - start
            usage = event.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "backend": backend,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": cached,
        "ttft": ttft,
    }


def send(args: argparse.Namespace) -> int:
    results = []
    with httpx.Client(base_url=args.router, timeout=args.timeout) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for i, prompt in enumerate(prompts(args)):
            res = one_request(client, model, prompt)
            results.append(res)
            print(
                f"[{args.label}] request {i:2d}: replica {args.names.get(res['backend'], res['backend'])}, "
                f"cached {res['cached_tokens']:4d}/{res['prompt_tokens']:4d} tokens, TTFT {res['ttft'] * 1000:7.1f} ms",
                flush=True,
            )
            time.sleep(args.pause)  # lets the replica's KV events reach the router's index
    summary = {
        "policy": args.label,
        "requests": len(results),
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "cached_tokens": sum(r["cached_tokens"] for r in results),
        "mean_ttft_ms": round(statistics.fmean(r["ttft"] for r in results) * 1000, 1),
        "per_replica": {
            args.names.get(b, b): sum(r["backend"] == b for r in results)
            for b in sorted({r["backend"] for r in results})
        },
    }
    if args.out:
        Path(args.out).write_text(json.dumps(summary))
    print("RESULT " + json.dumps(summary), flush=True)
    return 0


def summary(files: list[str]) -> int:
    runs = {s["policy"]: s for s in (json.loads(Path(f).read_text()) for f in files)}
    for s in runs.values():
        share = s["cached_tokens"] / max(1, s["prompt_tokens"])
        print(
            f"{s['policy']:>12}: {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens from cache "
            f"({share:.0%}), mean TTFT {s['mean_ttft_ms']} ms, requests per replica {s['per_replica']}"
        )
    if {"cache_aware", "round_robin"} <= runs.keys():
        ca, rr = runs["cache_aware"], runs["round_robin"]
        ratio = ca["cached_tokens"] / max(1, rr["cached_tokens"])
        print(f"cache_aware served {ratio:.2f}x the cached tokens of round_robin")
    print("SUMMARY " + json.dumps(runs), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("send")
    p.add_argument("--router", required=True)
    p.add_argument("--label", required=True)
    p.add_argument("--names", default="", help="URL=NAME,... to print replicas by name")
    p.add_argument("--out", default=None)
    p.add_argument("--topics", type=int, default=4)
    p.add_argument("--docs-per-topic", type=int, default=3)
    p.add_argument("--doc-words", type=int, default=60)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pause", type=float, default=0.5)
    p.add_argument("--timeout", type=float, default=300.0)
    p = sub.add_parser("summary")
    p.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "summary":
        return summary(args.files)
    args.names = dict(item.split("=", 1) for item in args.names.split(",") if item)
    return send(args)


if __name__ == "__main__":
    sys.exit(main())
