"""A RAG request against a running `chunkcache serve`, cold then warm, with its TTFT.

    python examples/rag_demo.py --base-url http://127.0.0.1:8000/v1

The documents are real text: excerpts of the READMEs of four Python packages chunkcache installs
(FastAPI, MessagePack, Uvicorn, tqdm), quoted from their package metadata. The second request sends
the same documents in another order with another question, so its documents come from the chunk
cache instead of being prefilled again. The third is a follow-up: the second's documents in the
same order with the first question, so it reads their KV from the prefix cache and computes only
its question; on a server started with `--exact-follow-ups --exact-follow-ups-sights 1` (a job for
every new order; at the default sights an order must come twice) that KV is a full prefill's (computed while the server idled;
the demo waits up to 30 s for it, as a user reading the last answer would).
The chat puts the documents in the user turn, each after the separator:
`# # doc # # doc ... # # question`. Each answer is checked against the words it must contain, and
`--full-prefill` asks each question once more with the documents recomputed in full (a blend that
recomputes every token at layer 0: exact) under a fresh cache salt (so that no cached KV, not even
an exact prefix, is read), to show what reuse is measured against.

The server's own options (model, dtype, reuse mode) are set in one place, scripts/demo.sh.
"""

from __future__ import annotations

import argparse
import time

import httpx
import openai

SEPARATOR = " # # "
SYSTEM = "You are a helpful assistant. Answer the question in one sentence, using the documents."
DOCS = [
    # fastapi's README (PyPI metadata of fastapi).
    "FastAPI is a modern, fast (high-performance), web framework for building APIs with Python based "
    "on standard Python type hints. The key features are: Fast: Very high performance, on par with "
    "NodeJS and Go (thanks to Starlette and Pydantic). One of the fastest Python frameworks available.",
    # msgpack's README.
    "MessagePack is an efficient binary serialization format. It lets you exchange data among "
    "multiple languages like JSON. But it's faster and smaller. This package provides CPython "
    "bindings for reading and writing MessagePack data.",
    # uvicorn's README.
    "Uvicorn is an ASGI web server implementation for Python. Until recently Python has lacked a "
    "minimal low-level server/application interface for async frameworks. The ASGI specification "
    "fills this gap, and means we're now able to start building a common set of tooling usable "
    "across all async frameworks. Uvicorn currently supports HTTP/1.1, HTTP/2 and WebSockets.",
    # tqdm's README.
    'tqdm derives from the Arabic word taqaddum which can mean "progress," and is an abbreviation '
    'for "I love you so much" in Spanish (te quiero demasiado). Instantly make your loops show a '
    "smart progress meter - just wrap any iterable with tqdm(iterable), and you're done!",
]
# (question, words a right answer contains)
QUESTIONS = [
    ("Which Arabic word does the name tqdm derive from?", ("taqaddum",)),
    ("Which protocols does Uvicorn support?", ("HTTP/1.1", "HTTP/2", "WebSockets")),
]
# Per-request chunk options of the full-prefill check (the server's ChunkConfig fields).
FULL_PREFILL = {"chunk_layout": "offset", "blend_check_layers": [0], "blend_recompute_ratios": [1.0]}


def is_right(answer: str, words: tuple[str, ...]) -> bool:
    return all(w.lower() in answer.lower() for w in words)


def chat_messages(system: str, docs: list[str], question: str) -> list[dict[str, str]]:
    user = "".join(SEPARATOR + d for d in docs) + SEPARATOR + question
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def ask(
    client: openai.OpenAI,
    model: str,
    system: str,
    docs: list[str],
    question: str,
    chunk_options: dict[str, object] | None = None,
) -> tuple[str, float, int, int]:
    """(answer, TTFT seconds, prompt tokens, cached prompt tokens) of one streamed chat request;
    `chunk_options` (chunkcache's request extension) override the server's for this request."""
    start = time.perf_counter()
    ttft = 0.0
    text = ""
    usage = None
    stream = client.chat.completions.create(
        model=model,
        messages=chat_messages(system, docs, question),
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=chunk_options,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if not text:
                ttft = time.perf_counter() - start
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
    return text.strip(), ttft, usage.prompt_tokens if usage else 0, cached or 0


def wait_for_exact_prefixes(
    stats_url: str, headers: dict[str, str], count: int, timeout: float = 30.0
) -> None:
    """The server (`--exact-follow-ups --exact-follow-ups-sights 1`) prefills each request's documents while idle: wait until
    `count` such jobs are done, as long as a user reading the last answer might take."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = httpx.get(stats_url, headers=headers, timeout=10).json()
        if not stats.get("enabled", True) or stats.get("exact_prefix_jobs", 0) >= count:
            return  # no chunk cache (--no-enable-chunk-cache): no job will come
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", default="unused")
    parser.add_argument(
        "--exact-follow-ups",
        action="store_true",
        help="the server runs with --exact-follow-ups --exact-follow-ups-sights 1: wait for its idle work before the follow-up",
    )
    parser.add_argument(
        "--full-prefill", action="store_true", help="also ask each question with a full prefill"
    )
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = client.models.list().data[0].id
    system, docs, questions = SYSTEM, DOCS, QUESTIONS
    # A fresh server's first request also pays one-time costs (allocations, lazy setup): a
    # throwaway request first, sharing no prefix with the real ones, makes "cold" a cold prefill.
    ask(client, model, "Warm-up.", [], "Hello")
    print(f"model: {model}\ndocuments:")
    for doc in docs:
        print("  -", doc)
    stats_url = args.base_url.rstrip("/").removesuffix("/v1") + "/v1/chunk_cache/stats"
    headers = {"Authorization": f"Bearer {args.api_key}"}
    runs = [
        ("cold", docs, questions[0], None),
        ("warm", list(reversed(docs)), questions[1], None),
        ("follow-up", list(reversed(docs)), questions[0], None),
    ]
    if args.full_prefill:
        salted = [{**FULL_PREFILL, "cache_salt": f"full-prefill-{time.time_ns()}-{i}"} for i in range(2)]
        runs += [("full prefill", docs, q, options) for q, options in zip(questions, salted, strict=True)]
    right = 0
    for label, order, (question, words), options in runs:
        if label == "follow-up" and args.exact_follow_ups:
            wait_for_exact_prefixes(stats_url, headers, 2)
        answer, ttft, prompt_tokens, cached = ask(client, model, system, order, question, options)
        verdict = "right" if is_right(answer, words) else f"WRONG (expected {', '.join(words)})"
        right += verdict == "right"
        print(f"\n[{label}] Q: {question}")
        print(f"[{label}] A: {answer!r}: {verdict}")
        print(f"[{label}] TTFT {ttft * 1000:.1f} ms, {cached} of {prompt_tokens} prompt tokens cached")
    print(f"\n{right} of {len(runs)} answers right")


if __name__ == "__main__":
    main()
