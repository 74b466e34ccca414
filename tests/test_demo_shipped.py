"""The shipped demo checkpoints (chunkcache/demo/model-*): loadable as committed, and answering.

Nothing is trained here: the test reads the committed files and answers a fixed held-out set
(a seed that neither training nor bench_quality uses) greedily with a plain causal prefill.
"""

from __future__ import annotations

import json

import pytest

from chunkcache import LLM, SamplingParams
from chunkcache.cli import default_model
from chunkcache.demo import (
    DEMO_MODEL_DIR,
    VARIANTS,
    demo_model_path,
    exact_match,
    format_prompt,
    held_out_set,
)

HELD_OUT_SEED = 4242
N_QUESTIONS = 60
# Issue 7's target. The shipped checkpoints answer all 60 of these questions on the machine that
# trained them (and 500/500 in bench_quality), so another CPU's rounding, which may flip a greedy
# token here and there, has 6 questions of room. A model that does not read the documents gets 0/60.
MIN_EXACT_MATCH = 0.9
GREEDY = SamplingParams(temperature=0, max_tokens=48)


@pytest.mark.parametrize("variant", VARIANTS)
def test_shipped_checkpoint_is_complete_and_small(variant: str) -> None:
    path = demo_model_path(variant)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), f"{path / name} is missing"
    assert (path / "model.safetensors").stat().st_size <= 25 * 2**20
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())


def test_commands_default_to_the_shipped_model() -> None:
    assert default_model() == str(DEMO_MODEL_DIR)


@pytest.mark.parametrize("variant", VARIANTS)
def test_shipped_model_answers_single_hop_questions(variant: str) -> None:
    examples = [ex for ex in held_out_set(HELD_OUT_SEED, N_QUESTIONS * 2) if ex.hops == 1][:N_QUESTIONS]
    llm = LLM(str(demo_model_path(variant)))
    prompts = [format_prompt(ex.system, ex.docs, ex.question) for ex in examples]
    outputs = llm.generate(prompts, GREEDY)
    hits = [exact_match(out.outputs[0].text, ex.answer) for ex, out in zip(examples, outputs, strict=True)]
    misses = [
        (ex.question, out.outputs[0].text)
        for ex, out, ok in zip(examples, outputs, hits, strict=True)
        if not ok
    ]
    assert len(examples) == N_QUESTIONS
    assert sum(hits) / len(hits) >= MIN_EXACT_MATCH, f"{sum(hits)}/{len(hits)} exact; misses: {misses[:5]}"
