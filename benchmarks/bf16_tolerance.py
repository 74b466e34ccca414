"""How far the engine in bfloat16 lands from transformers in bfloat16, against how far bfloat16 itself
moves transformers from float32: the measurement behind the bf16 oracle tests' tolerance.

Per model: greedy decodes by the engine in bfloat16 (log-probs of its top 5 at every step), then one
transformers forward over prompt + the engine's tokens in bfloat16 and in float32 (teacher-forced,
so a different greedy path cannot blur the numbers). Printed: the largest |difference| over the
reported tokens and their mean: engine-bf16 vs hf-bf16, hf-bf16 vs hf-fp32 (the scale of bf16
rounding itself) and engine-bf16 vs hf-fp32.

    OMP_NUM_THREADS=1 python benchmarks/bf16_tolerance.py [--models llama qwen2 qwen3 smollm2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import common  # noqa: F401 (puts the repo root, for tests.support, on sys.path)
import torch

from chunkcache import LLM, SamplingParams
from chunkcache.model.loader import model_path
from tests.support.oracle import hf_teacher_forced_logprobs
from tests.support.tiny_checkpoint import build_checkpoint

PROMPTS = [
    "The quick brown fox jumps over the lazy dog near the river bank",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "In 1905 Einstein published four papers that changed physics: the photoelectric effect,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


def gaps(steps: list[dict[int, float]], ref: torch.Tensor) -> list[float]:
    """|ref - the engine's| for each of the engine's reported tokens at each step."""
    return [abs(ref[i, t].item() - lp) for i, step in enumerate(steps) for t, lp in step.items()]


def measure(path: str, tokens: int) -> dict[str, list[float]]:
    """Per comparison, the gaps over every prompt's reported tokens."""
    llm = LLM(path, device="cpu", dtype="bfloat16", kv_cache_tokens=4096, chunk_cache_size_gb=0.01)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=5)
    found: dict[str, list[float]] = {
        "engine-bf16 vs hf-bf16": [],
        "hf-bf16 vs hf-fp32": [],
        "engine-bf16 vs hf-fp32": [],
    }
    for out in llm.generate(PROMPTS, params):
        steps, gen = out.outputs[0].logprobs, out.outputs[0].token_ids
        bf16 = hf_teacher_forced_logprobs(path, out.prompt_token_ids, gen, torch.bfloat16)
        fp32 = hf_teacher_forced_logprobs(path, out.prompt_token_ids, gen, torch.float32)
        hf_steps = [{t: bf16[i, t].item() for t in step} for i, step in enumerate(steps)]
        found["engine-bf16 vs hf-bf16"] += gaps(steps, bf16)
        found["hf-bf16 vs hf-fp32"] += gaps(hf_steps, fp32)
        found["engine-bf16 vs hf-fp32"] += gaps(steps, fp32)
    llm.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["llama", "qwen2", "qwen3", "smollm2"])
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = (
                model_path(name) if name == "smollm2" else str(build_checkpoint(Path(tmp) / name, arch=name))
            )
            found = measure(path, args.tokens)
            line = "; ".join(f"{k}: mean {sum(v) / len(v):.4f} max {max(v):.4f}" for k, v in found.items())
            print(f"{name} ({len(PROMPTS)} prompts x {args.tokens} steps, top 5): {line}", flush=True)


if __name__ == "__main__":
    main()
