"""Penalties, logit_bias and min_tokens: against transformers' logits processors where it has
them (repetition penalty, sequence bias, min new tokens), against OpenAI's formula otherwise."""

from __future__ import annotations

import json

import pytest
import torch

from chunkcache import LLM, SamplingParams
from chunkcache.engine.sampler import History, process_logits
from chunkcache.errors import InvalidRequestError
from tests.support.oracle import hf_generate, hf_model

PROMPT = [5, 17, 17, 40, 9, 63, 17, 2, 88, 31]


@pytest.fixture(scope="module")
def llm(checkpoint):
    path = checkpoint(arch="llama")
    engine = LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=2048, chunk_cache_size_gb=0.01)
    return path, engine


def test_repetition_penalty_matches_transformers(llm) -> None:
    path, engine = llm
    for penalty in (1.3, 0.7):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=penalty)
        got = engine.generate([PROMPT], params)[0].outputs[0].token_ids
        assert got == hf_generate(path, PROMPT, 12, repetition_penalty=penalty)
    plain = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert plain.outputs[0].token_ids != got  # the option changes something on this model
    engine.check_integrity()


def test_logit_bias_matches_transformers_sequence_bias(llm) -> None:
    path, engine = llm
    bias = {7: 4.0, 11: -100.0, 3: 2.5}
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias=bias)
    got = engine.generate([PROMPT], params)[0].outputs[0].token_ids
    assert got == hf_generate(path, PROMPT, 10, sequence_bias={(t,): b for t, b in bias.items()})
    assert 11 not in got


def test_min_tokens_holds_back_eos_like_transformers(llm) -> None:
    path, engine = llm
    plain = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    eos = plain.outputs[0].token_ids[1]  # pretend the second greedy token ends the sequence
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=5, stop_token_ids=[eos])
    got = engine.generate([PROMPT], params)[0].outputs[0]
    want = hf_generate(path, PROMPT, 8, eos_token_id=eos, min_new_tokens=5)
    assert got.token_ids == want[: len(got.token_ids)]
    assert len(got.token_ids) >= 5 and eos not in got.token_ids[:5]
    early = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[eos]))[0]
    assert len(early.outputs[0].token_ids) == 2


def test_presence_and_frequency_follow_openais_formula() -> None:
    # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, c over the output.
    logits = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits, params, History([4, 4, 4], [3, 3, 1]), frozenset())
    want = torch.tensor([1.0, -2.0 - 0.25 - 0.5, 0.5, 3.0 - 0.5 - 0.5, 0.0])  # the prompt does not count
    assert torch.allclose(out, want)
    assert torch.equal(logits, torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0]))  # the raw row is untouched


def test_penalties_change_sampling_and_leave_logprobs_raw(llm) -> None:
    _, engine = llm
    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    plain = engine.generate([PROMPT], base)[0].outputs[0]
    penal = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0, frequency_penalty=2.0)
    out = engine.generate([PROMPT], penal)[0].outputs[0]
    assert out.token_ids != plain.token_ids
    # The first token's logprob is the raw model's either way (vLLM's raw_logprobs).
    assert out.logprobs[0][out.token_ids[0]] == pytest.approx(plain.logprobs[0][plain.token_ids[0]])


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_bad_values_are_rejected(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_prompt_logprobs_match_transformers(llm) -> None:
    path, engine = llm
    model = hf_model(path, "eager")
    prompt = PROMPT * 4  # 40 tokens: more than two KV blocks
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    # Twice: the second time the prompt is in the prefix cache, which prompt logprobs must not use.
    for _ in range(2):
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        for i in range(1, len(prompt)):
            entry = got[i]
            assert entry[prompt[i]] == pytest.approx(float(want[i - 1, prompt[i]]), abs=1e-4)
            top = torch.topk(want[i - 1], 3)
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert entry[t] == pytest.approx(v, abs=1e-4)
        assert out.num_cached_tokens == 0
    # The chunk path cannot give them: refused, not faked.
    with pytest.raises(Exception, match="chunked prompts"):
        engine.generate(["sys # # a # # b # # q"], SamplingParams(max_tokens=1, prompt_logprobs=1))
    engine.check_integrity()


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


def test_json_schema_output_validates(llm) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    _, engine = llm
    outs = engine.generate(
        ["Answer in JSON:"] * 4,
        [SamplingParams(temperature=1.0, seed=s, max_tokens=40, json_schema=SCHEMA) for s in range(3)]
        + [SamplingParams(temperature=0, max_tokens=40, json_schema=SCHEMA)],
    )
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text  # the grammar forces an end
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    # Unconstrained, the same model writes no JSON at all.
    free = engine.generate(
        ["Answer in JSON:"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0]
    with pytest.raises(ValueError):
        json.loads(free.outputs[0].text)
    engine.check_integrity()


def test_json_object_outputs_are_json_objects(llm) -> None:
    _, engine = llm
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=24, json_schema={"type": "object"})
        for s in range(8)
    ]
    outs = [o.outputs[0] for o in engine.generate(["Data:"] * len(params), params)]
    assert any(c.finish_reason == "stop" for c in outs)
    for c in outs:
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "nonsense"}, "nonsense"),
        ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
        ({"type": "string", "minLength": "x"}, "minLength"),
    ],
)
def test_malformed_schemas_are_refused(llm, schema: dict, message: str) -> None:
    _, engine = llm
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate(["x"], SamplingParams(max_tokens=2, json_schema=schema))
    engine.check_integrity()
