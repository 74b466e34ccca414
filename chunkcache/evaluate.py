"""`chunkcache eval`: what chunk reuse costs in quality, on your model and your prompts.

For every chunked prompt the reference is a full prefill of the same tokens (full causal
attention, natural positions). Each reuse mode is measured against it: top-1 agreement of the
first token, mean KL divergence KL(full || mode) of the first-token distribution, exact match of
the greedy continuation, and mean TTFT with the prompt's chunks already in the pool (warm).
The engine must not let the reference's KV serve a mode (`fidelity.measure.check_engine`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from chunkcache.chunk.parse import parse_chunked_prompt
from chunkcache.fidelity.measure import check_engine
from chunkcache.llm import LLM
from chunkcache.outputs import RequestOutput
from chunkcache.sampling import SamplingParams


@dataclass(frozen=True)
class Mode:
    name: str
    # None = the reference: a full prefill of the prompt's tokens, no chunk reuse.
    chunk_options: dict[str, Any] | None


def default_modes(ratios: list[float], boundary_tokens: int, check_layer: int = 1) -> list[Mode]:
    modes = [
        Mode("full", None),
        Mode("isolated", {"chunk_layout": "isolated"}),
        Mode(
            "offset", {"chunk_layout": "offset", "blend_check_layers": [0], "blend_recompute_ratios": [0.0]}
        ),
    ]
    for r in ratios:
        modes.append(
            Mode(
                f"blend@{r:g}",
                {
                    "chunk_layout": "offset",
                    "blend_check_layers": [check_layer],
                    "blend_recompute_ratios": [r],
                },
            )
        )
    if boundary_tokens > 0:
        modes.append(
            Mode(
                f"boundary-{boundary_tokens}",
                {
                    "chunk_layout": "offset",
                    "blend_check_layers": [0],
                    "blend_recompute_ratios": [0.0],
                    "blend_boundary_tokens": boundary_tokens,
                },
            )
        )
    return modes


@dataclass
class ModeResult:
    mode: str
    prompts: int = 0
    top1_agreement: float = 0.0
    mean_kl: float = 0.0
    exact_match: float = 0.0
    mean_ttft_ms: float = 0.0
    recomputed_share: float = 0.0  # of chunk tokens run through every layer (blend modes)
    kl_values: list[float] = field(default_factory=list, repr=False)


def load_prompts(path: str | Path, separator: str) -> list[str]:
    """JSONL lines of {"prompt": "S # # C1 ... # # Q"} or {"system", "chunks", "question"}."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "prompt" in record:
            prompts.append(record["prompt"])
        elif {"system", "chunks", "question"} <= record.keys():
            prompts.append(separator.join([record["system"], *record["chunks"], record["question"]]))
        else:
            raise ValueError(f"{path}:{number}: need 'prompt' or 'system', 'chunks' and 'question'")
    return prompts


def _first_token_logprobs(out: RequestOutput, vocab: int) -> list[float]:
    dense = [-math.inf] * vocab
    for token, lp in (out.outputs[0].logprobs or [{}])[0].items():
        dense[token] = lp
    return dense


def _kl(ref: list[float], other: list[float]) -> float:
    total = 0.0
    for p_log, q_log in zip(ref, other, strict=True):
        if p_log == -math.inf:
            continue
        total += math.exp(p_log) * (p_log - q_log)
    return total


def evaluate(llm: LLM, prompts: list[str], modes: list[Mode], max_tokens: int) -> list[ModeResult]:
    check_engine(llm)
    engine = llm.engine
    vocab = engine.spec.vocab_size
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=vocab)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results = {m.name: ModeResult(m.name) for m in modes}
    separator = engine.config.chunk.separator
    for prompt in tqdm(prompts, desc="eval", unit="prompt"):
        chunked = parse_chunked_prompt(prompt, separator, engine.tokenizer)
        if chunked is None:
            raise ValueError(f"not a chunked prompt (needs two {separator!r} separators): {prompt[:80]!r}")
        token_ids = chunked.all_token_ids()
        chunk_tokens = sum(map(len, chunked.chunks))
        llm.generate(prompt, first)  # fill the pool: reuse modes are measured warm
        reference: tuple[list[float], list[int]] | None = None
        for mode in modes:
            source: str | list[int] = token_ids if mode.chunk_options is None else prompt
            dist = _first_token_logprobs(
                llm.generate(source, first, chunk_options=mode.chunk_options)[0], vocab
            )
            start = time.perf_counter()
            out = llm.generate(source, greedy, chunk_options=mode.chunk_options)[0]
            elapsed = (out.metrics.ttft or time.perf_counter() - start) * 1000
            tokens = out.outputs[0].token_ids
            if reference is None:
                reference = (dist, tokens)
            r = results[mode.name]
            r.prompts += 1
            top = max(range(vocab), key=dist.__getitem__)
            r.top1_agreement += top == max(range(vocab), key=reference[0].__getitem__)
            r.kl_values.append(_kl(reference[0], dist))
            r.exact_match += tokens == reference[1]
            r.mean_ttft_ms += elapsed
            if chunk_tokens and out.num_blend_recomputed_tokens:
                r.recomputed_share += (chunk_tokens - out.num_blend_reused_tokens) / chunk_tokens
    for r in results.values():
        n = max(r.prompts, 1)
        r.top1_agreement /= n
        r.mean_kl = sum(r.kl_values) / n
        r.exact_match /= n
        r.mean_ttft_ms /= n
        r.recomputed_share /= n
    return list(results.values())


def format_table(results: list[ModeResult], max_tokens: int) -> str:
    header = (
        f"{'mode':<16} {'top1':>6} {'mean KL':>10} {f'exact@{max_tokens}':>9} {'TTFT ms':>9} {'recomp':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.mode:<16} {r.top1_agreement:>6.1%} {r.mean_kl:>10.5f} {r.exact_match:>9.1%} "
            f"{r.mean_ttft_ms:>9.1f} {r.recomputed_share:>7.1%}"
        )
    return "\n".join(lines)


def results_json(results: list[ModeResult]) -> list[dict[str, Any]]:
    return [{k: v for k, v in asdict(r).items() if k != "kl_values"} for r in results]
