"""A RAG request against a running `chunkcache serve`, cold then warm, with its TTFT.

    python examples/rag_demo.py --base-url http://127.0.0.1:8000/v1

The documents and questions come from the demo model's task (`chunkcache.demo.corpus`): the
second request sends the same documents in another order with another question, so its
documents come from the chunk cache instead of being prefilled again.
"""

from __future__ import annotations

import argparse
import random
import time

import openai

from chunkcache.demo import DEFAULT_SYSTEM_PROMPT, chat_messages, make_example


def ask(client: openai.OpenAI, model: str, docs: list[str], question: str) -> tuple[str, float, int, int]:
    """(answer, TTFT seconds, prompt tokens, cached prompt tokens) of one streamed chat request."""
    start = time.perf_counter()
    ttft = 0.0
    text = ""
    usage = None
    stream = client.chat.completions.create(
        model=model,
        messages=chat_messages(DEFAULT_SYSTEM_PROMPT, docs, question),
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
    example = make_example(random.Random(args.seed), min_docs=4, max_docs=4, hops=1)
    others = [qa for qa in example.all_qa if qa.question != example.question and qa.hops == 1]
    second = others[0] if others else example.all_qa[0]
    reordered = list(reversed(example.docs))
    print("documents:")
    for doc in example.docs:
        print("  -", doc)
    for label, docs, question, expected in (
        ("cold", example.docs, example.question, example.answer),
        ("warm", reordered, second.question, second.answer),
    ):
        answer, ttft, prompt_tokens, cached = ask(client, model, docs, question)
        print(f"\n[{label}] Q: {question}")
        print(f"[{label}] A: {answer!r} (expected {expected!r})")
        print(f"[{label}] TTFT {ttft * 1000:.1f} ms, {cached} of {prompt_tokens} prompt tokens cached")


if __name__ == "__main__":
    main()
