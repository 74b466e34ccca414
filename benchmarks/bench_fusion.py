"""Warm TTFT and decode speed of every reuse layout against a full prefill, 4 documents of ~1,000 tokens.

The workload of issue 32's speed targets: a RAG chat prompt (the model's chat template, a system
turn, then `SEP doc1 SEP ... SEP doc4 SEP question`), each document ~1,000 tokens of real text
(the Python reference documentation's topics, `pydoc_data`, cut at a word boundary), the documents
already in the chunk pool (one untimed request per document set first), each repetition a new
document order and a new question, so that nothing but the system turn is in the prefix cache.

Modes, one engine (prefix caching on, the baseline at its best: its system turn is served from the
prefix cache), interleaved in a rotating order within each repetition:
- full: the same text as token ids, a plain prompt, computed in full (but for the cached prefix);
- isolated, blend@0.15 (offset, k_deviation at layer 1), fusion (contrastive, with the no-document
  stream: the default rule), fusion+pair (the same with the pair stream S + Ci + Cj + Q, which
  computes one document more): the chunked prompt with those per-request chunk options.

TTFT: wall and process CPU time from just before `add_request` to the first token (max_tokens 1),
median of `--repeats`. Decode: tokens/s of a 32-token greedy reply (EOS ignored) after its first
token, full against fusion (a fusion step decodes all 5 streams in one batch; 6 with the pair). With `--threads 1`
the CPU-time ratios hardly depend on other load on the machine; the wall ones do.

`--pair-margin M` adds the mode `fusion+pair@M`: the pair stream only where the two most relevant
documents' relevances differ by at most M (`fusion_pair_margin`). Its TTFT is fusion's where the
pair does not join and fusion+pair's where it does, so the script says in how many of its timed
requests it joined, and `--join-share P` prints the mean TTFT of a mix in which the pair joins on a
share P of the questions (e.g. the share bench_fidelity's held-out questions measured), from the
fusion and fusion+pair medians.

    python benchmarks/bench_fusion.py --model qwen2.5-coder-1.5b --threads 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from common import SEP, describe_machine, first_token_time, passages, setup_torch, summary

from chunkcache import LLM, SamplingParams
from chunkcache.engine import fusion
from chunkcache.fidelity import measure

SYSTEM = "Answer the question from the documents. Answer briefly."
QUESTIONS = [
    "Which of these documents describes how names are bound?",
    "What does the documentation say about the order of evaluation?",
    "Which statement is described in the third document?",
    "Summarise the first document in one sentence.",
    "What is the main topic of the last document?",
    "Which keywords are mentioned in these documents?",
]
MODES: dict[str, dict[str, Any] | None] = {
    "full": None,
    "isolated": {"chunk_layout": "isolated"},
    "blend@0.15": {"chunk_layout": "offset", "blend_check_layers": [1], "blend_recompute_ratios": [0.15]},
    # Spelt out whole: a model's own default (catalog.py) must not slip in, e.g. the 1.5B's pair.
    "fusion": {
        "chunk_layout": "fusion",
        "fusion_rule": "contrastive",
        "fusion_amateur": True,
        "fusion_pair": "none",
    },
    # With the pair stream (S + Ci + Cj + Q, Cj and Q computed): one document's prefill more.
    "fusion+pair": {
        "chunk_layout": "fusion",
        "fusion_rule": "contrastive",
        "fusion_amateur": True,
        "fusion_pair": "lead",
    },
}


def render(tokenizer: Any, docs: list[str], question: str) -> str:
    user = "".join(SEP + d for d in docs) + SEP + question
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _prompt(llm: LLM, mode: str, text: str) -> str | list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False) if MODES[mode] is None else text


def measure_ttft(
    llm: LLM, docs: list[str], repeats: int, modes: list[str]
) -> dict[str, list[tuple[float, float]]]:
    engine, rng = llm.engine, random.Random(0)
    one = SamplingParams(temperature=0, max_tokens=1)
    for mode in modes:  # every mode's untimed first request: the pool holds the documents
        first_token_time(
            engine, f"warm-{mode}", _prompt(llm, mode, render(llm.tokenizer, docs, "Hi?")), one, MODES[mode]
        )
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    names = list(modes)
    for rep in range(repeats):
        order = rng.sample(docs, len(docs))
        text = render(llm.tokenizer, order, QUESTIONS[rep % len(QUESTIONS)] + f" ({rep})")
        for mode in names[rep % len(names) :] + names[: rep % len(names)]:
            wall, cpu, _ = first_token_time(
                engine, f"{mode}-{rep}", _prompt(llm, mode, text), one, MODES[mode]
            )
            times[mode].append((wall, cpu))
    return times


def decode_rate(llm: LLM, docs: list[str], mode: str, tokens: int = 32) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    text = render(llm.tokenizer, docs[::-1], "Describe these documents in detail.")
    start = time.perf_counter()
    wall, _, out = first_token_time(
        llm.engine, f"decode-{mode}", _prompt(llm, mode, text), params, MODES[mode]
    )
    rest = time.perf_counter() - start - wall
    return (len(out.outputs[0].token_ids) - 1) / rest


def _count_joins() -> dict[str, bool]:
    """Request id -> whether its pair stream joined (decided once, after the first step)."""
    joined: dict[str, bool] = {}
    decide = fusion.FusionGroup.pair_wanted

    def counted(group: fusion.FusionGroup) -> bool:
        joined[group.request.request_id] = wanted = decide(group)
        return wanted

    fusion.FusionGroup.pair_wanted = counted  # type: ignore[method-assign]
    return joined


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES), help="full always runs"
    )
    parser.add_argument("--pair-margin", type=float, default=None, help="add mode fusion+pair@M")
    parser.add_argument(
        "--join-share", type=float, default=None, help="mean TTFT of a mix: the pair joins on this share"
    )
    args = parser.parse_args(argv)
    if args.pair_margin is not None:
        MODES[f"fusion+pair@{args.pair_margin}"] = {
            **MODES["fusion+pair"],
            "fusion_pair_margin": args.pair_margin,
        }
        args.modes.append(f"fusion+pair@{args.pair_margin}")
    joined = _count_joins()
    setup_torch(args.threads)
    # exact_follow_ups off (fidelity.measure.ENGINE_OPTIONS): a mode after "full" on the same order
    # would run as a plain prompt over its exact prefix and time the prefix cache, not the layout.
    llm = LLM(
        args.model, dtype=args.dtype, threads=args.threads, kv_cache_tokens=32768, **measure.ENGINE_OPTIONS
    )
    docs = [text for _, text in passages(llm.tokenizer, args.doc_tokens)[:4]]
    print(describe_machine(), f"model {args.model}, dtype {llm.engine.config.dtype}, threads {args.threads}")
    modes = list(dict.fromkeys(["full", *args.modes]))
    times = measure_ttft(llm, docs, args.repeats, modes)
    full_wall = statistics.median(w for w, _ in times["full"])
    full_cpu = statistics.median(c for _, c in times["full"])
    ratios = {}
    for mode, runs in times.items():
        wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
        print(
            f"{mode:<12} warm TTFT {1000 * wall:9.1f} ms (CPU {1000 * cpu:9.1f} ms)  x{full_wall / wall:6.2f} wall  x{full_cpu / cpu:6.2f} CPU"
        )
        if mode != "full":
            ratios[f"{mode}_ttft"] = f"{full_wall / wall:.2f}x"
            ratios[f"{mode}_ttft_cpu"] = f"{full_cpu / cpu:.2f}x"
    for mode in [m for m in modes if "@" in m]:
        timed = [joined[f"{mode}-{rep}"] for rep in range(args.repeats)]
        print(f"{mode}: the pair joined in {sum(timed)} of {len(timed)} timed requests")
    if args.join_share is not None and {"fusion", "fusion+pair"} <= set(modes):
        share = args.join_share
        for k, unit in ((0, "wall"), (1, "CPU")):
            alone = statistics.median(t[k] for t in times["fusion"])
            paired = statistics.median(t[k] for t in times["fusion+pair"])
            full = full_wall if k == 0 else full_cpu
            mixed = share * paired + (1 - share) * alone
            print(f"mix, pair on {share:.2f}: mean TTFT {1000 * mixed:.1f} ms {unit} (x{full / mixed:.2f})")
            ratios[f"mix{share:.2f}_ttft{'_cpu' if k else ''}"] = f"{full / mixed:.2f}x"
    plain = decode_rate(llm, docs, "full")
    for mode in [m for m in ("fusion", "fusion+pair") if m in modes]:
        fused = decode_rate(llm, docs, mode)
        print(f"decode: full {plain:.2f} tok/s, {mode} {fused:.2f} tok/s ({fused / plain:.2f}x)")
        ratios[f"{mode}_decode"] = f"{fused / plain:.2f}x"
    print(summary(f"bench_fusion model={args.model}", **ratios))


if __name__ == "__main__":
    main()
