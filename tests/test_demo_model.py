"""The demo model's training script and task: it runs, writes a checkpoint the engine serves, and
packs its samples exactly as the engine lays the prompt out.

These tests train a tiny configuration for a few steps into a temp dir; the shipped checkpoints
are checked in test_demo_shipped.py.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from chunkcache import LLM, SamplingParams
from chunkcache.chunk.parse import parse_chunked_prompt
from chunkcache.demo import (
    DEFAULT_SYSTEM_PROMPT,
    SEPARATOR,
    chat_messages,
    demo_model_path,
    exact_match,
    format_prompt,
    held_out_set,
    make_example,
)
from chunkcache.demo.corpus import KINDS, QA, make_world

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "train_demo_model", ROOT / "scripts" / "train_demo_model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_demo_model", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return _load_script()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, script: ModuleType) -> Path:
    out = tmp_path_factory.mktemp("demo") / "tiny"
    # bf16 autocast on: the faster path must train and still save float32 weights.
    assert script.main(["--tiny", "--steps", "3", "--bf16", "--out", str(out), "--variant", "block"]) == 0
    return out


def test_training_script_tiny_run_gives_a_loadable_checkpoint(tiny_checkpoint: Path) -> None:
    out = tiny_checkpoint
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
                 "train_log.tsv", "train_summary.json"):  # fmt: skip
        assert (out / name).is_file(), name
    log = (out / "train_log.tsv").read_text().splitlines()
    assert log[0].startswith("step\t") and len(log) == 1 + 3
    generation = json.loads((out / "generation_config.json").read_text())
    tok_ids = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in tok_ids}
    assert sorted(generation["eos_token_id"]) == sorted([ids["<|eos|>"], ids["<|im_end|>"]])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.float32}
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())

    ex = make_example(random.Random(0))
    for chunk_cache in (False, True):
        llm = LLM(str(out), enable_chunk_cache=chunk_cache)
        result = llm.generate(ex.prompt(), GREEDY)[0]
        assert len(result.outputs[0].token_ids) == 4


def test_chat_and_prompt_forms_give_the_same_tokens(tiny_checkpoint: Path) -> None:
    llm = LLM(str(tiny_checkpoint))
    ex = make_example(random.Random(3), system=DEFAULT_SYSTEM_PROMPT)
    tok = llm.tokenizer
    prompt = format_prompt(ex.system, ex.docs, ex.question)
    rendered = llm.engine.render_chat(chat_messages(ex.system, ex.docs, ex.question))
    # generate() adds BOS to the system part; chat() renders it from the template.
    as_prompt = parse_chunked_prompt(prompt, SEPARATOR, tok, add_special_tokens=True)
    as_chat = parse_chunked_prompt(rendered, SEPARATOR, tok, add_special_tokens=False)
    assert as_prompt is not None and as_prompt == as_chat
    assert as_prompt.sys_token_ids[0] == tok.bos_token_id
    assert len(as_prompt.chunks) == len(ex.docs)
    by_chat = llm.chat(chat_messages(ex.system, ex.docs, ex.question), GREEDY)[0]
    by_prompt = llm.generate(prompt, GREEDY)[0]
    assert by_chat.prompt_token_ids == by_prompt.prompt_token_ids
    assert by_chat.outputs[0].token_ids == by_prompt.outputs[0].token_ids


@pytest.mark.parametrize("layout", ["text", "full", "isolated"])
def test_training_samples_are_laid_out_as_the_engine_lays_the_prompt(
    tiny_checkpoint: Path, script: ModuleType, layout: str
) -> None:
    """A packed sample's first question block, cut before its answer, has the engine's tokens,
    positions and mask for that prompt: training sees what serving computes."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    enc = script.Encoder(tok)
    ex = make_example(random.Random(11), min_docs=3, max_docs=3, hops=1)
    qas = [q for q in ex.all_qa if q.hops == 1][:3]
    sample = enc.sample(ex, qas, layout, chat=True)
    prompt = format_prompt(ex.system, ex.docs, qas[0].question)
    parsed = parse_chunked_prompt(prompt, SEPARATOR, tok)
    assert parsed is not None
    if layout == "text":
        want = list(tok.encode(prompt))
        positions = list(range(len(want)))
    else:
        want = parsed.all_token_ids()
        if layout == "full":
            positions = list(range(len(want)))
        else:
            s, q0 = len(parsed.sys_token_ids), parsed.question_position()
            positions = list(range(s))
            for chunk in parsed.chunks:
                positions += range(s, s + len(chunk))
            positions += range(q0, q0 + len(parsed.question_token_ids))
    n = len(want)
    assert sample.ids[:n] == want
    assert sample.positions[:n] == positions
    # The answer follows, supervised, then the second question block restarts at Q's position.
    answer = enc.answer_ids(qas[0].answer, chat=True)
    assert sample.ids[n : n + len(answer)] == answer
    assert sample.targets[n - 1 : n - 1 + len(answer)] == answer
    assert all(sample.is_answer[n - 1 : n - 1 + len(answer)])
    q_len = len(parsed.question_token_ids) if layout != "text" else None
    if q_len is not None:
        second = n + len(answer)
        assert sample.positions[second] == positions[n - q_len]
        # The second block sees the shared context but not the first block.
        assert not sample.mask[second, n - q_len : n + len(answer)].any()
        assert sample.mask[second, : n - q_len].all() if layout != "isolated" else True
    if layout == "isolated":
        # A chunk sees S and itself only.
        s = len(parsed.sys_token_ids)
        c1 = len(parsed.chunks[0])
        assert not sample.mask[s + c1, s : s + c1].any()
        assert sample.mask[s + c1, :s].all()


def test_copy_only_lm_loss_keeps_targets_visible_earlier(tiny_checkpoint: Path, script: ModuleType) -> None:
    from transformers import AutoTokenizer

    enc = script.Encoder(AutoTokenizer.from_pretrained(tiny_checkpoint))
    ex = make_example(random.Random(5), min_docs=2, max_docs=2, hops=1)
    sample = enc.sample(ex, [QA(ex.question, ex.answer, 1, ex.kind)], "full", chat=True)
    kept = script._copyable(sample, [True] * len(sample.ids))
    ids = torch.tensor(sample.ids)
    for i, (keep, target) in enumerate(zip(kept, sample.targets, strict=True)):
        visible = set(ids[sample.mask[i]].tolist())
        assert keep == (target in visible), i


def test_corpus_examples_and_metric() -> None:
    examples = held_out_set(123, 50)
    assert examples == held_out_set(123, 50)  # seeded
    assert {ex.hops for ex in examples} == {1, 2}
    for ex in examples:
        assert 2 <= len(ex.docs) <= 6
        # The answer restates the fact sentence(s) it rests on, word for word; the last holds the value.
        sentences = re.split(r"(?<=\.) ", ex.answer)
        assert len(sentences) == ex.hops
        assert all(any(s in doc for doc in ex.docs) for s in sentences)
        assert f" {ex.value}" in sentences[-1]
    # One document per kind of entity: the demo model tells documents apart by kind (corpus.py).
    for seed in range(20):
        world = make_world(random.Random(seed), 6)
        assert sorted(e.kind for e in world) == sorted(KINDS)
        assert len({e.name for e in world}) == 6
    assert exact_match(" Zorvak has 4120 people. ", "Zorvak has 4120 people.")
    assert not exact_match("Zorvak has 4120 people", "Zorvak has 4120 people.")
    with pytest.raises(ValueError, match="unknown demo model variant"):
        demo_model_path("nope")
