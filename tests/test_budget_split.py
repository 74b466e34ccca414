"""Prefills that the per-step token budget splits beyond plain prompts (engine/scheduler.py): a
blend by layers (engine/blend.py's BlendRun), a fusion group's streams by pieces of their tokens
together. Split or not, the result is the same: compared with the same request run unsplit
(a budget that holds it whole), KV, logprobs and greedy tokens. Counted in steps, never in time."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

from chunkcache import SamplingParams
from chunkcache.core.sequence import Sequence
from chunkcache.engine import blend as blend_module
from chunkcache.engine.blend import BlendRun
from chunkcache.engine.engine import LLMEngine
from chunkcache.engine.scheduler import ScheduledBatch
from tests.support.engines import tiny_llm
from tests.support.prompts import ALICE, BOB, CAROL, COINS, DOCS, QUESTIONS, SYSTEM, chunked

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
# A check layer that leaves fewer tokens running: later layers cost less, so pieces grow.
OFFSET = {"chunk_layout": "offset", "blend_check_layers": [1], "blend_recompute_ratios": [0.3]}
# The blend alone: with the prefix cache on, a follow-up could read an earlier blend's blocks.
_llm = partial(tiny_llm, enable_prefix_caching=False)
SMALL = {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 8}


def _blend_prompt() -> str:
    return chunked(SYSTEM, [DOCS[0], DOCS[2], DOCS[1]], QUESTIONS[0])


def _watch_blends(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Record each BlendRun.run's stop layer, and each finished blend's KV in the request's own
    slots, every layer [layers, 2, tokens, heads, dim], read when its result is taken."""
    seen: dict[str, list[Any]] = {"runs": [], "kv": []}
    run, result = blend_module.BlendRun.run, blend_module.BlendRun.result

    def spy_run(self: blend_module.BlendRun, stop: int) -> None:
        seen["runs"].append(stop)
        run(self, stop)

    def spy_result(self: blend_module.BlendRun) -> blend_module.BlendResult:
        slots = self.inp.own_slots
        seen["kv"].append(torch.stack([torch.stack((k[slots], v[slots])) for k, v in self.kv_caches]))
        return result(self)

    monkeypatch.setattr(blend_module.BlendRun, "run", spy_run)
    monkeypatch.setattr(blend_module.BlendRun, "result", spy_result)
    return seen


def _run(engine: LLMEngine) -> dict[str, Any]:
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        engine.check_integrity()
    return outs


def _warm(engine: LLMEngine, prompt: str) -> int:
    """The chunks' entries into the pool (a first request), so that the next one blends at once;
    returns the prompt's length in tokens."""
    engine.add_request("warm", prompt, SamplingParams(temperature=0, max_tokens=1), chunk_options=OFFSET)
    return len(_run(engine)["warm"].prompt_token_ids)


def _run_of(seq: Sequence) -> BlendRun | None:
    """The blend under way of `seq`, if any."""
    return None if seq.blend is None else seq.blend.run


def _budget(engine: LLMEngine, budget: int, threshold: int) -> None:
    """Give the engine's scheduler another budget: one engine runs a request split and unsplit,
    over the same pool entries (entries computed in other pieces would differ by rounding)."""
    engine.scheduler.max_num_batched_tokens = budget
    engine.scheduler.long_prefill_token_threshold = threshold


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_blend_split_by_layers_equals_the_unsplit_blend(checkpoint, monkeypatch, arch: str) -> None:
    """A blend in pieces of 8 tokens runs its layers over several steps; its blended KV (every
    layer, the request's own slots), first-token logprobs and greedy tokens are exactly those of
    the same blend run in one step."""
    engine = _llm(checkpoint(arch=arch, num_hidden_layers=4)).engine
    _warm(engine, _blend_prompt())
    seen = _watch_blends(monkeypatch)
    results = {}
    for name, (budget, threshold) in (("whole", (2048, 2048)), ("split", (64, 8))):
        _budget(engine, budget, threshold)
        seen["runs"].clear()
        engine.add_request(name, _blend_prompt(), GREEDY, chunk_options=OFFSET)
        results[name] = (_run(engine)[name], seen["kv"][-1], list(seen["runs"]))
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    whole, split = results["whole"], results["split"]
    assert whole[2] == [4] and len(split[2]) > 2, (whole[2], split[2])  # one call, against several
    assert split[2] == sorted(split[2]) and split[2][-1] == 4
    assert torch.equal(split[1], whole[1])
    assert split[0].outputs[0].logprobs[0] == whole[0].outputs[0].logprobs[0]
    assert split[0].outputs[0].token_ids == whole[0].outputs[0].token_ids
    assert split[0].num_blend_recomputed_tokens == whole[0].num_blend_recomputed_tokens > 0


def test_a_short_request_is_answered_while_a_blend_is_split(checkpoint) -> None:
    """The point of the split: a short request that arrives during a large blend gets its first
    token in the next step, while the blend still has layers to run."""
    engine = _llm(checkpoint(arch="llama", num_hidden_layers=4), **SMALL).engine
    _warm(engine, _blend_prompt())
    engine.add_request("blend", _blend_prompt(), GREEDY, chunk_options=OFFSET)
    engine.step()
    blend = next(s for s in engine.scheduler.running if s.request_id == "blend")
    assert _run_of(blend) is not None and not _run_of(blend).done
    engine.add_request("short", "Hi", SamplingParams(temperature=0, max_tokens=1))
    out = {o.request_id: o for o in engine.step()}
    assert out["short"].finished and out["short"].outputs[0].token_ids
    assert _run_of(blend) is not None and blend.num_computed == 0  # still under way
    _run(engine)


@pytest.mark.parametrize("steps", [1, 2])
def test_abort_mid_split_gives_everything_back(checkpoint, steps: int) -> None:
    """Aborted between two pieces of its blend: its blocks and pins go back, nothing is left
    half done, and the same prompt then blends to the same answer as before the abort."""
    engine = _llm(checkpoint(arch="llama", num_hidden_layers=4), **SMALL).engine
    _warm(engine, _blend_prompt())
    engine.add_request("before", _blend_prompt(), GREEDY, chunk_options=OFFSET)
    before = _run(engine)["before"]
    engine.add_request("a", _blend_prompt(), GREEDY, chunk_options=OFFSET)
    for _ in range(steps):
        engine.step()
    seq = next(s for s in engine.scheduler.running if s.request_id == "a")
    assert _run_of(seq) is not None and not _run_of(seq).done
    engine.abort_request("a")
    final = engine.step()
    assert final[0].finished and final[0].outputs[0].finish_reason == "abort"
    assert _run_of(seq) is None
    engine.check_integrity()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(e.pins == 0 for e in engine.chunks.pool.entries())
    engine.add_request("after", _blend_prompt(), GREEDY, chunk_options=OFFSET)
    after = _run(engine)["after"]
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert after.outputs[0].logprobs == before.outputs[0].logprobs


def test_a_blend_preempted_mid_split_is_recomputed_by_a_plain_prefill(checkpoint) -> None:
    """A blend preempted between pieces (a running stream needs the block it holds) starts again
    from nothing, as any preempted blend: a plain prefill, whose answer is the plain prompt's."""
    path = checkpoint(arch="llama", num_hidden_layers=4)
    length = _warm(_llm(path).engine, _blend_prompt())
    # Blocks for the blend's prompt and one for a 15-token stream: its 17th token needs a second.
    engine = _llm(path, kv_cache_tokens=16 * (-(-length // 16) + 1), **SMALL).engine
    _warm(engine, _blend_prompt())
    engine.add_request(
        "stream", list(range(3, 18)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass  # the stream's prompt, in pieces: then 16 tokens, one block
    engine.add_request("blend", _blend_prompt(), GREEDY, chunk_options=OFFSET)
    engine.step()  # the stream's 17th token (one block still), the blend's first piece
    blend = next(s for s in engine.scheduler.running if s.request_id == "blend")
    assert _run_of(blend) is not None and not _run_of(blend).done
    engine.step()  # the stream's next token needs a block: the blend gives its own back
    assert engine.scheduler.num_preemptions == 1 and _run_of(blend) is None and blend.blend is None
    out = _run(engine)["blend"]
    assert out.num_blend_recomputed_tokens == 0 and not out.blend_fallback
    engine.add_request("plain", out.prompt_token_ids, GREEDY)
    assert out.outputs[0].token_ids == _run(engine)["plain"].outputs[0].token_ids
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


# ---- fusion: a group's streams take one piece's worth of tokens together --------------------

FUSION_DOCS = [ALICE, COINS, BOB, CAROL]
# A question long enough that its streams together exceed a piece: 4 documents + the no-document
# stream compute it 5 times.
LONG_QUESTION = "Where does Alice live, what does she drink, and how many coins are in the red box?"


def _fusion_tokens_per_step(engine: LLMEngine) -> list[int]:
    """From now on, per step, the tokens the fusion streams compute together (appended as each
    step is scheduled)."""
    per_step: list[int] = []
    schedule = engine.scheduler.schedule

    def spy() -> ScheduledBatch:
        batch = schedule()
        streams = [n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if s.fusion is not None]
        per_step.append(sum(streams))
        return batch

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    return per_step


@pytest.mark.parametrize("pair", ["none", "lead"])
def test_a_fusion_group_is_split_within_a_piece_and_answers_the_same(checkpoint, pair: str) -> None:
    """A fusion group whose streams' questions together exceed a piece computes them over several
    steps, at most one piece (8 tokens) a step, its streams' prompts still ending in one step (the
    group's first combined token needs every stream's row: `fuse_rows` fails a group whose streams
    arrive apart); its logprobs and greedy tokens are the unsplit group's."""
    path = checkpoint(arch="llama", num_hidden_layers=2)
    prompt = chunked(SYSTEM, FUSION_DOCS, LONG_QUESTION)
    options = {"chunk_layout": "fusion", "fusion_amateur": True, "fusion_pair": pair}
    threshold = SMALL["long_prefill_token_threshold"]
    outs = {}
    for name, budget in (("whole", {}), ("split", SMALL)):
        # No exact-prefix job (the request is the order's second sight): the fusion group alone.
        engine = tiny_llm(path, exact_follow_ups=False, **budget).engine
        engine.add_request("warm", prompt, SamplingParams(temperature=0, max_tokens=1), chunk_options=options)
        _run(engine)  # the documents' entries into the pool
        per_step = _fusion_tokens_per_step(engine)
        engine.add_request(name, prompt, GREEDY, chunk_options=options)
        outs[name] = _run(engine)[name]
        question = len(engine.tokenizer.encode(LONG_QUESTION, add_special_tokens=False))
        if name == "split":
            assert 5 * question > threshold  # five streams compute the question: it had to be split
            assert max(per_step) <= threshold, per_step
        else:
            assert max(per_step) >= 5 * question, per_step  # every stream's question in one step
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    whole, split = outs["whole"].outputs[0], outs["split"].outputs[0]
    assert split.token_ids == whole.token_ids
    for got, want in zip(split.logprobs, whole.logprobs, strict=True):
        assert got.keys() == want.keys()
        assert all(abs(got[t] - want[t]) < 1e-4 for t in got)
