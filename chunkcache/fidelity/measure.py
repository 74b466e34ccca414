"""One chunked prompt under full prefill and under reuse configurations: the replies and the cost.

Shared by `chunkcache calibrate` and benchmarks/bench_fidelity.py, so that a profile and the
benchmark measure the same thing the same way: the prompt is a chat turn `SEP doc1 ... SEP docN
SEP question` after a system turn; "full" is a plain prefill of exactly the chunked prompt's token
ids; a reuse configuration is a chunked request over a warm chunk pool (the documents were seen
before, as in production); the warm TTFT is a one-token request timed before the answer run (so
that a full prefill does not hit its own prompt's blocks in the prefix cache).

The engine runs with ENGINE_OPTIONS: `exact_prefix_reads` and `exact_follow_ups` off. On, the
full prefill of a prompt leaves its S and documents in the prefix cache as a plain prefill's KV,
and the reuse configurations measured after it would run as that plain prompt: every
configuration would report full prefill's reply and a follow-up's TTFT. `run`, which every request
of these tools goes through, refuses an engine with either on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkcache.chunk.parse import parse_chunked_prompt
from chunkcache.core.plan import ChunkedPrompt
from chunkcache.sampling import SamplingParams

if TYPE_CHECKING:
    from chunkcache.llm import LLM
    from chunkcache.outputs import RequestOutput

# The fidelity benchmark's system turn, the default of a calibration prompt without its own.
SYSTEM = "Answer the question using the documents. Reply with a short answer."
ChunkOptions = dict[str, Any]
# A request that only warms the pool: its blend key differs from every measured configuration's,
# so that no configuration finds this request's blended blocks in the prefix cache.
WARM_OPTIONS: ChunkOptions = {"chunk_layout": "isolated"}
# A request that only makes each entry measure its sensitivity (stored_deviation): nothing recomputed.
MEASURE_OPTIONS: ChunkOptions = {
    "chunk_layout": "offset",
    "blend_check_layers": [0],
    "blend_recompute_ratios": [0.0],
    "blend_selector": "stored_deviation",
}
_ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)
# Engine options of every tool that measures reuse configurations against a full prefill in one
# engine (calibrate, eval, the fidelity and fusion benchmarks): see the module's docstring.
ENGINE_OPTIONS: dict[str, Any] = {"exact_follow_ups": False, "exact_prefix_reads": False}


def check_engine(llm: LLM) -> None:
    """Refuse an engine where a full prefill's KV could serve a reuse configuration's request
    (`exact_prefix_reads` / `exact_follow_ups` read the prefix cache: without one they do nothing)."""
    config = llm.engine.config
    if (
        config.chunk.exact_prefix_reads or config.chunk.exact_follow_ups
    ) and config.cache.enable_prefix_caching:
        raise ValueError(
            "exact_prefix_reads and exact_follow_ups must be off to measure reuse against full prefill in "
            "one engine (a full prefill's exact prefix would serve every configuration): build the engine "
            "with fidelity.measure.ENGINE_OPTIONS"
        )


def render(tokenizer: Any, docs: list[str], question: str, separator: str, system: str = SYSTEM) -> str:
    """The chunked prompt: the system turn, then `SEP doc1 ... SEP docN SEP question` as the user
    turn, in the model's chat template (plain text `system SEP ... question` without one)."""
    user = "".join(separator + d for d in docs) + separator + question
    if getattr(tokenizer, "chat_template", None) is None:
        return system + user
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def parse(llm: LLM, text: str) -> ChunkedPrompt:
    """The chunked prompt's parts as the engine cuts them."""
    sep = llm.engine.config.chunk.separator
    parsed = parse_chunked_prompt(text, sep, llm.tokenizer, add_special_tokens=False)
    if parsed is None:
        raise ValueError("the rendered prompt holds no chunks (a document or the question is empty?)")
    return parsed


def run(
    llm: LLM, prompt: str | list[int], params: SamplingParams, options: ChunkOptions | None
) -> RequestOutput:
    """One request; `options` None = the engine's own (a token-id prompt takes the plain path).
    Every tool's requests come through here: an engine that would leak is refused first."""
    check_engine(llm)
    return llm.generate([prompt], params, add_special_tokens=False, chunk_options=options)[0]


def warm(llm: LLM, text: str, measure_sensitivity: bool = False) -> None:
    """Put the prompt's documents in the pool (and, for stored_deviation, their scores)."""
    run(llm, text, _ONE_TOKEN, WARM_OPTIONS)
    if measure_sensitivity:
        run(llm, text, _ONE_TOKEN, MEASURE_OPTIONS)


def ttft(llm: LLM, prompt: str | list[int], options: ChunkOptions | None) -> tuple[float, float, int]:
    """(wall, cpu) seconds of a one-token request, and the tokens it blended (the answer run that
    follows finds the blended blocks in the prefix cache and recomputes none)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = run(llm, prompt, _ONE_TOKEN, options)
    return time.perf_counter() - wall, time.process_time() - cpu, out.num_blend_recomputed_tokens


def recomputed_share(options: ChunkOptions | None, blended: int, parsed: ChunkedPrompt) -> float:
    """The share of document tokens a request recomputed: 1 for a full prefill, the blended
    tokens less the question's for layout offset, 0 for the exact layouts (isolated, fusion)."""
    if options is None:
        return 1.0
    if options.get("chunk_layout") != "offset":
        return 0.0
    doc_tokens = sum(map(len, parsed.chunks))
    return max(0, blended - len(parsed.question_token_ids)) / max(1, doc_tokens)


@dataclass(frozen=True)
class Outcome:
    """One configuration's answer to one prompt."""

    reply: str
    recomputed: float  # share of document tokens recomputed
    ttft_s: float  # warm wall-clock TTFT of a one-token request
    ttft_cpu_s: float
    decode: tuple[int, float]  # tokens after the first, seconds from the first token to the last


def measure(
    llm: LLM, text: str, configs: dict[str, ChunkOptions | None], max_tokens: int, rotate: int = 0
) -> dict[str, Outcome]:
    """`text` (a rendered chunked prompt) under every configuration (None = full prefill), in an
    order rotated by `rotate` (so that no configuration always runs first after the warm-up)."""
    parsed = parse(llm, text)
    full_ids = parsed.all_token_ids()
    warm(llm, text, any(o and o.get("blend_selector") == "stored_deviation" for o in configs.values()))
    answer = SamplingParams(temperature=0, max_tokens=max_tokens)
    names = list(configs)
    k = rotate % max(1, len(names))
    out: dict[str, Outcome] = {}
    for name in names[k:] + names[:k]:
        options = configs[name]
        prompt: str | list[int] = full_ids if options is None else text
        wall, cpu, blended = ttft(llm, prompt, options)
        res = run(llm, prompt, answer, options)
        blended = max(blended, res.num_blend_recomputed_tokens)
        m = res.metrics
        decode = (len(res.outputs[0].token_ids) - 1, (m.finished_time or 0.0) - (m.first_token_time or 0.0))
        out[name] = Outcome(
            res.outputs[0].text, recomputed_share(options, blended, parsed), wall, cpu, decode
        )
    return {name: out[name] for name in names}
