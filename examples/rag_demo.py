"""A RAG request against a running `chunkcache serve`, cold then warm, with its TTFT.

    python examples/rag_demo.py --base-url http://127.0.0.1:8000/v1

The documents and questions come from the demo model's task (`chunkcache.demo.corpus`, or a fixed
set in the same style where that package is absent): the second request sends the same documents
in another order with another question, so its documents come from the chunk cache instead of
being prefilled again. The chat is the demo model's format: the system prompt, then a user turn
` # # doc # # doc ... # # question`.
"""

from __future__ import annotations

import argparse
import random
import time

import openai

SEPARATOR = " # # "
SYSTEM = "You are a helpful assistant. Answer the question with a short phrase from the documents."
# What `workload(7)` draws from chunkcache.demo.corpus, for when that package is absent.
DOCS = [
    "About Zaszon Furhaik. Zaszon Furhaik works as a roofer. Zaszon Furhaik lives in Draiston. "
    "Zaszon Furhaik was born in the year 1912.",
    "About Halkame. Halkame runs for 79 kilometres. Halkame was named after Zaszon Furhaik. "
    "Halkame flows through Draiston.",
    "About Draiston. Draiston has 1614 people. The mayor of Draiston is Dafin Foskan. "
    "Draiston lies within Lamkarland.",
    "About Labrum. Labrum was written by Riszai Quemlem. Labrum appeared during 1907. Labrum sold 8104 copies.",
]
QUESTIONS = [
    ("Who was Halkame named after?", "Halkame was named after Zaszon Furhaik."),
    ("What is the job of Zaszon Furhaik?", "Zaszon Furhaik works as a roofer."),
]


def chat_messages(system: str, docs: list[str], question: str) -> list[dict[str, str]]:
    user = "".join(SEPARATOR + d for d in docs) + SEPARATOR + question
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def workload(seed: int) -> tuple[str, list[str], list[tuple[str, str]]]:
    """(system prompt, documents, two (question, expected answer) pairs)."""
    try:
        from chunkcache.demo.corpus import make_example
    except ImportError:
        return SYSTEM, DOCS, QUESTIONS
    example = make_example(random.Random(seed), min_docs=4, max_docs=4, hops=1)
    others = [qa for qa in example.all_qa if qa.question != example.question and qa.hops == 1]
    second = others[0] if others else example.all_qa[0]
    return (
        example.system,
        example.docs,
        [(example.question, example.answer), (second.question, second.answer)],
    )


def ask(
    client: openai.OpenAI, model: str, system: str, docs: list[str], question: str
) -> tuple[str, float, int, int]:
    """(answer, TTFT seconds, prompt tokens, cached prompt tokens) of one streamed chat request."""
    start = time.perf_counter()
    ttft = 0.0
    text = ""
    usage = None
    stream = client.chat.completions.create(
        model=model,
        messages=chat_messages(system, docs, question),
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = client.models.list().data[0].id
    system, docs, questions = workload(args.seed)
    # A fresh server's first request also pays one-time costs (allocations, lazy setup): a
    # throwaway request first, sharing no prefix with the real ones, makes "cold" a cold prefill.
    ask(client, model, "Warm-up.", [], "Hello")
    print(f"model: {model}\ndocuments:")
    for doc in docs:
        print("  -", doc)
    for label, order, (question, expected) in (
        ("cold", docs, questions[0]),
        ("warm", list(reversed(docs)), questions[1]),
    ):
        answer, ttft, prompt_tokens, cached = ask(client, model, system, order, question)
        print(f"\n[{label}] Q: {question}")
        print(f"[{label}] A: {answer!r} (expected {expected!r})")
        print(f"[{label}] TTFT {ttft * 1000:.1f} ms, {cached} of {prompt_tokens} prompt tokens cached")


if __name__ == "__main__":
    main()
