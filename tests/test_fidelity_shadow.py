"""Online shadow checks and the fidelity controller (issue 34): sampled chunked requests are
re-run as a full prefill in background time and compared token by token; the controller moves the
engine along its profile when the rolling agreement misses the target, and back when it is met
with a margin. The tiny model's layout "isolated" is lossy (its greedy replies differ from full
prefill's on these prompts, and its sampled replies' next-token distributions are far from full
prefill's), layout "offset" recomputing every chunk token at layer 0 is exact."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from chunkcache import LLM, SamplingParams
from chunkcache.config import ReuseOptions
from chunkcache.core.sequence import Sequence, SequenceKind
from chunkcache.engine.engine import LLMEngine
from chunkcache.fidelity import profile as profiles
from chunkcache.fidelity.gate import identity
from chunkcache.fidelity.shadow import MAX_QUEUED
from chunkcache.model.loader import load_model
from chunkcache.server.metrics import ServerMetrics
from tests.support.engines import tiny_llm
from tests.support.oracle import hf_teacher_forced_logprobs
from tests.support.tiny_checkpoint import corpus

SEP = " # # "
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
LOSSY = {"chunk_layout": "isolated"}
EXACT = {"chunk_layout": "offset", "blend_check_layers": [0], "blend_recompute_ratios": [1.0]}


def _prompt(i: int) -> str:
    lines = corpus()
    docs = [" ".join(lines[i * 7 + j * 3 : i * 7 + j * 3 + 3]) for j in range(2)]
    return "sys" + SEP + SEP.join(docs) + SEP + "question " + lines[i]


def _drain(engine: LLMEngine, check: bool = True) -> int:
    """Step until requests and background work are done, checking integrity after each step."""
    steps = 0
    while engine.has_unfinished_requests() or engine.has_background_work():
        engine.step()
        steps += 1
        if check:
            engine.check_integrity()
    return steps


def _fidelity(engine: LLMEngine) -> dict[str, Any]:
    stats = engine.chunk_cache_stats()
    assert stats is not None
    return stats["fidelity"]


def _serve(engine: LLMEngine, first: int, count: int, salt: str | None = None, **kw: Any) -> None:
    for i in range(first, first + count):
        engine.add_request(f"r{i}-{salt}", _prompt(i), GREEDY, cache_salt=salt, **kw)
    _drain(engine)


@pytest.fixture(scope="module")
def model(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama")


def _llm(model: Path, options: dict[str, Any], **kw: Any) -> LLM:
    # Every drawn request checked: no CPU cap (tested apart below).
    return tiny_llm(model, threads=1, fidelity_sample_rate=1.0, fidelity_max_share=1.0, **options, **kw)


@pytest.mark.parametrize(("options", "result"), [(EXACT, "agree"), (LOSSY, "disagree")])
def test_shadow_checks_compare_with_full_prefill(model: Path, options: dict[str, Any], result: str) -> None:
    llm = _llm(model, options)
    try:
        engine = llm.engine
        _serve(engine, 0, 4)
        fid = _fidelity(engine)
        agreement = 1.0 if result == "agree" else 0.0
        assert fid["configs"] == {"default": {result: 4, "agreement": agreement, "total_variation": None}}
        # Every shadow's KV blocks are back (free, or cached and evictable).
        assert fid["pending"] == 0 and not engine.scheduler.running and not engine.scheduler.waiting
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        # Requests with their own chunk options are not sampled: they say nothing of the engine's.
        for i in range(4, 6):
            engine.add_request(f"own{i}", _prompt(i), GREEDY, chunk_options=LOSSY)
        _drain(engine)
        assert _fidelity(engine)["configs"] == fid["configs"]
    finally:
        llm.close()


def test_no_sampling_without_a_rate(model: Path) -> None:
    llm = tiny_llm(model, threads=1, **EXACT)
    try:
        _serve(llm.engine, 0, 3)
        assert _fidelity(llm.engine)["configs"] == {}
    finally:
        llm.close()


def test_shadow_queue_is_bounded_and_excess_dropped(model: Path) -> None:
    llm = _llm(model, EXACT)
    try:
        engine = llm.engine
        n = MAX_QUEUED + 4
        for i in range(n):
            engine.add_request(f"r{i}", _prompt(i), GREEDY)
        most = 0
        while engine.has_unfinished_requests() or engine.has_background_work():
            engine.step()
            engine.check_integrity()
            pending = sum(
                s.kind is SequenceKind.SHADOW for s in [*engine.scheduler.waiting, *engine.scheduler.running]
            )
            assert pending == _fidelity(engine)["pending"] <= MAX_QUEUED
            most = max(most, pending)
        fid = _fidelity(engine)
        assert most == MAX_QUEUED and fid["dropped"] == n - MAX_QUEUED
        assert fid["configs"]["default"]["agree"] == MAX_QUEUED
        assert engine.blocks.num_free_blocks + engine.blocks.num_cached_blocks >= engine.blocks.num_blocks
    finally:
        llm.close()


def _first_token_steps(engine: LLMEngine, prompt: str | list[int]) -> int:
    """Steps from a live request's arrival to its first token."""
    request_id = f"live-{len(engine.counters)}-{engine.counters['requests']}"
    engine.add_request(request_id, prompt, GREEDY)
    steps = 0
    while True:
        steps += 1
        outputs = engine.step()
        engine.check_integrity()
        if any(o.request_id == request_id and o.outputs[0].token_ids for o in outputs):
            return steps


def test_shadows_are_background_work_and_never_delay_a_live_request(model: Path) -> None:
    llm = _llm(model, EXACT, max_num_batched_tokens=64)
    try:
        engine = llm.engine
        idle = _first_token_steps(engine, "a live question about the cat")
        _drain(engine)
        for i in range(6):
            engine.add_request(f"r{i}", _prompt(i), GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        queued = [
            s for s in [*engine.scheduler.waiting, *engine.scheduler.running] if s.kind is SequenceKind.SHADOW
        ]
        assert queued and len(queued) == _fidelity(engine)["pending"]
        assert all(s.kind.is_background for s in queued)
        assert _first_token_steps(engine, "a live question about the dog") == idle
        assert engine.has_background_work()  # the live request came first: shadows still pending
        _drain(engine)
        assert _fidelity(engine)["configs"]["default"]["agree"] == 6
    finally:
        llm.close()


def _probe(engine: LLMEngine, ids: list[int], salt: str | None) -> int:
    """Prompt tokens a plain request of `ids` under `salt` found cached."""
    request_id = f"probe-{salt}"
    engine.add_request(request_id, ids, GREEDY, cache_salt=salt)
    outs: list[Any] = []
    while engine.has_unfinished_requests() or engine.has_background_work():
        outs += engine.step()
        engine.check_integrity()
    (out,) = [o for o in outs if o.request_id == request_id and o.finished]
    return out.num_cached_tokens


def test_shadows_keep_the_request_salt(model: Path) -> None:
    llm = _llm(model, EXACT)
    try:
        engine = llm.engine
        added: list[Sequence] = []
        served = engine.shadows.served

        def keep(seq: Sequence) -> Sequence | None:
            shadow = served(seq)
            if shadow is not None:
                added.append(shadow)
            return shadow

        engine.shadows.served = keep  # type: ignore[method-assign]
        _serve(engine, 0, 1, salt="tenant-a")
        assert [s.prefix_keys.cache_salt for s in added] == ["tenant-a"]
        ids = added[0].prompt_token_ids
        # The shadow's plain blocks (the whole prompt's, more than the served request's exact
        # prefix) are found under its tenant's salt only.
        whole = (len(ids) - 1) // engine.blocks.block_size * engine.blocks.block_size
        assert _probe(engine, ids, "tenant-b") == 0
        assert _probe(engine, ids, None) == 0
        assert _probe(engine, ids, "tenant-a") == whole
    finally:
        llm.close()


def _profile_file(model: Path, tmp_path: Path, rungs: list[tuple[str, dict[str, Any], float, float]]) -> Path:
    loaded = load_model(str(model), "cpu", "float32", None, None, True)
    ident = identity(loaded.model, loaded.tokenizer, loaded.name)
    n = 1000  # the gate ranks by the kept share's 95% lower bound: 950 of 1,000 is at least 93.5%
    configs = tuple(
        profiles.Measured(
            name,
            ReuseOptions.from_mapping(options),
            n,
            n,
            round(n * kept),
            round(n * kept) / n,
            kept,
            None,
            0.5,
            1 / speed,
            speed,
        )
        for name, options, kept, speed in rungs
    )
    profile = profiles.Profile(Path(model).name, ident, "cpu", "float32", "test", 6, n, None, None, configs)
    path = tmp_path / "profile.json"
    path.write_text(profile.to_json())
    return path


def test_controller_climbs_when_lossy_and_steps_back_when_met(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="chunkcache.fidelity")
    # The profile is optimistic about "isolated" (calibrated on other prompts): the gate starts
    # there; live traffic shows it loses replies.
    path = _profile_file(
        model,
        tmp_path,
        [("isolated", LOSSY, 0.95, 8.0), ("exact", EXACT, 1.0, 1.2), ("slow", LOSSY, 0.9, 1.0)],
    )
    window = 3
    llm = tiny_llm(
        model, threads=1, fidelity_target=0.9, fidelity_profile=str(path), fidelity_sample_rate=1.0,
        fidelity_max_share=1.0,
        fidelity_window=window,
    )  # fmt: skip
    try:
        engine = llm.engine
        ctl = engine.shadows.controller
        assert ctl is not None and [r.name for r in ctl.rungs] == ["isolated", "exact"]  # "slow" dominated
        assert ctl.current.name == "isolated"
        history = []
        for i in range(4 * window - 1):
            _serve(engine, i, 1)  # one at a time: each check lands before the next request
            history.append(ctl.current.name)
        fid = _fidelity(engine)
        # Climbs after `window` lossy checks; meets the target there; steps back after `window`
        # exact checks; climbs again after `window` lossy ones: never sooner than `window` checks.
        iso, exact = ["isolated"] * window, ["exact"] * window
        assert history == iso[1:] + exact + iso + exact
        assert fid["moves"] == {"up": 2, "down": 1} and fid["current"] == "exact"
        assert fid["configs"]["isolated"]["disagree"] == 2 * window
        assert fid["configs"]["exact"]["agree"] >= window
        assert "moving up (more accurate) to exact" in caplog.text
        assert "moving down (faster) to isolated" in caplog.text
        # A request's own options: neither moved nor counted.
        engine.add_request("own", _prompt(40), GREEDY, chunk_options=LOSSY)
        _drain(engine)
        assert _fidelity(engine)["configs"] == fid["configs"]
    finally:
        llm.close()


def _sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=6, seed=seed)


def _record_checks(engine: LLMEngine) -> list[dict[str, Any]]:
    """Each finished shadow's prompt, forced tokens and output, and the distributions compared."""
    checks: list[dict[str, Any]] = []
    shadows = engine.shadows
    finished, distributions = shadows.finished, shadows._distributions

    def on_finished(shadow: Sequence) -> Any:
        checks.append({"ids": shadow.prompt_token_ids, "forced": shadow.fidelity.forced_token_ids if shadow.fidelity else None,
                       "output": list(shadow.output_token_ids)})  # fmt: skip
        return finished(shadow)

    def on_distributions(name: str, served: list[Any], full: list[Any]) -> Any:
        checks[-1].update(served=list(served), full=list(full))
        return distributions(name, served, full)

    shadows.finished = on_finished  # type: ignore[method-assign]
    shadows._distributions = on_distributions  # type: ignore[method-assign]
    return checks


@pytest.mark.parametrize("options", [EXACT, LOSSY], ids=["exact", "lossy"])
def test_sampled_replies_are_compared_by_their_next_token_distributions(
    model: Path, options: dict[str, Any]
) -> None:
    """The shadow of a sampled reply is teacher-forced on it, and its distributions are full
    prefill's (transformers on the prompt and the served tokens); reuse that is exact serves the
    same distributions, lossy reuse measurably other ones."""
    llm = _llm(model, options, fidelity_distribution_steps=3)
    try:
        engine = llm.engine
        checks = _record_checks(engine)
        for i in range(3):
            engine.add_request(f"s{i}", _prompt(i), _sampled(i))
        _drain(engine)
        fid = _fidelity(engine)["configs"]["default"]
        assert fid["distribution"] == 3 and set(fid) == {"distribution", "agreement", "total_variation"}
        for check in checks:
            assert check["forced"] is not None and check["output"] == check["forced"]  # teacher-forced
            assert len(check["forced"]) == len(check["served"]) == len(check["full"]) == 3
            oracle = hf_teacher_forced_logprobs(model, check["ids"], check["forced"])
            torch.testing.assert_close(torch.stack(check["full"]), oracle, atol=1e-4, rtol=0)
            if options is EXACT:
                torch.testing.assert_close(torch.stack(check["served"]), oracle, atol=1e-4, rtol=0)
        if options is EXACT:
            assert fid["total_variation"] < 1e-4 and fid["agreement"] > 0.999
        else:
            assert fid["total_variation"] > 0.1 and fid["agreement"] < 0.5
        # Nothing kept: no shadow pending, every block back, no request holds vocab rows.
        assert _fidelity(engine)["pending"] == 0
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        assert all(
            seq.fidelity is None or seq.fidelity.step_logprobs is None for seq in engine._requests.values()
        )
    finally:
        llm.close()


def test_controller_moves_on_sampled_traffic(model: Path, tmp_path: Path) -> None:
    """Sampled replies alone drive the controller: the lossy rung's distributions miss the
    target, the exact one's meet it with the margin."""
    path = _profile_file(model, tmp_path, [("isolated", LOSSY, 0.95, 8.0), ("exact", EXACT, 1.0, 1.2)])
    window = 2
    llm = tiny_llm(
        model, threads=1, fidelity_target=0.9, fidelity_profile=str(path), fidelity_sample_rate=1.0,
        fidelity_max_share=1.0,
        fidelity_window=window, fidelity_distribution_steps=2,
    )  # fmt: skip
    try:
        engine = llm.engine
        ctl = engine.shadows.controller
        assert ctl is not None and ctl.current.name == "isolated"
        history = []
        for i in range(3 * window):
            engine.add_request(f"s{i}", _prompt(i), _sampled(i))
            _drain(engine)
            history.append(ctl.current.name)
        assert history == ["isolated", "exact", "exact", "isolated", "isolated", "exact"]
        fid = _fidelity(engine)
        assert fid["moves"] == {"up": 2, "down": 1}
        assert fid["configs"]["isolated"]["distribution"] == 2 * window
        assert fid["configs"]["exact"]["total_variation"] < 1e-4
    finally:
        llm.close()


def test_checks_stop_while_over_their_cpu_share(model: Path) -> None:
    """With a cap below any check's cost, the first drawn request is checked and the next ones are
    not (counted over_budget) while the shadows' share of the steps' CPU time stays above it."""
    llm = tiny_llm(model, threads=1, fidelity_sample_rate=1.0, fidelity_max_share=1e-9, **EXACT)
    try:
        engine = llm.engine
        for i in range(4):  # one at a time: each is served after the previous check ran
            _serve(engine, i, 1)
        fid = _fidelity(engine)
        assert fid["configs"]["default"]["agree"] == 1 and fid["configs"]["default"]["over_budget"] == 3
        assert 0 < fid["cpu_share"] < 1 and fid["max_share"] == 1e-9
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    finally:
        llm.close()


def test_cpu_is_split_between_shadows_and_other_work_by_tokens() -> None:
    from chunkcache.config import FidelityConfig
    from chunkcache.fidelity.shadow import ShadowChecks

    def seq(kind: SequenceKind) -> Sequence:
        return Sequence(request_id=kind.value, prompt_token_ids=[1], token_ids=[1], params=GREEDY, kind=kind)

    checks = ShadowChecks(FidelityConfig(sample_rate=0.5, max_share=0.15), 0, None, 64, None)  # type: ignore[arg-type]
    live, shadow = seq(SequenceKind.REQUEST), seq(SequenceKind.SHADOW)
    checks.account([live, shadow], [30, 10], 2.0)  # a quarter of the tokens: a quarter of the CPU
    assert (checks.shadow_cpu, checks.step_cpu) == (0.5, 2.0) and checks.cpu_share == 0.25
    checks.account([live], [1], 3.0)
    assert checks.cpu_share == 0.1 and checks.stats()["cpu_share"] == 0.1
    # One check started so far, costing 0.5 s: another would make (0.5 + 0.5) / (5 + 0.5) > 0.15...
    checks._number = 1
    assert not checks.within_budget()
    checks.account([live], [1], 2.0)  # ...and fits once the steps' time allows it: 1.0 / 7.5
    assert checks.within_budget()
    off = ShadowChecks(FidelityConfig(), 0, None, 64, None)  # type: ignore[arg-type]
    off.account([shadow], [5], 1.0)  # no rate: nothing is measured
    assert off.step_cpu == 0.0 and off.cpu_share == 0.0


def test_metrics_parse(model: Path) -> None:
    llm = _llm(model, LOSSY)
    try:
        _serve(llm.engine, 0, 2)
        llm.engine.add_request("sampled", _prompt(3), _sampled(3))
        _drain(llm.engine)
        metrics = ServerMetrics("tiny")
        metrics.update_engine_stats(llm.engine.stats())
        families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
        checks = {
            (s.labels["config"], s.labels["result"]): s.value
            for s in families["chunkcache_fidelity_checks"].samples
            if s.name.endswith("_total")
        }
        assert checks[("default", "disagree")] == 2 and checks[("default", "agree")] == 0
        assert checks[("default", "distribution")] == 1
        (agreement,) = families["chunkcache_fidelity_agreement"].samples
        assert agreement.labels == {"config": "default"} and 0.0 <= agreement.value < 1 / 3
        (variation,) = families["chunkcache_fidelity_total_variation"].samples
        assert variation.labels == {"config": "default"} and 0.1 < variation.value <= 1.0
        (share,) = families["chunkcache_fidelity_shadow_cpu_share"].samples
        assert 0.0 < share.value < 1.0
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("fidelity_sample_rate", 1.5),
        ("fidelity_sample_rate", -0.1),
        ("fidelity_window", 0),
        ("fidelity_margin", 1),
        ("fidelity_max_share", 0),
        ("fidelity_max_share", 1.5),
    ],
)
def test_bad_options_are_named(option: str, value: object) -> None:
    from chunkcache.config import EngineConfig

    with pytest.raises(ValueError, match=option):
        EngineConfig.from_options("m", use_env=False, **{option: value})


def test_default_sample_rate_follows_the_target() -> None:
    from chunkcache.config import EngineConfig

    assert EngineConfig.from_options("m", use_env=False).fidelity.effective_sample_rate == 0
    with_target = EngineConfig.from_options("m", use_env=False, fidelity_target=0.95)
    assert with_target.fidelity.effective_sample_rate == 0.01
    assert dataclasses.replace(with_target.fidelity, sample_rate=0.5).effective_sample_rate == 0.5
    assert json.dumps(with_target.fidelity.window) == "20"


def _live_ids(engine: LLMEngine, first: int) -> list[int]:
    text = " ".join(corpus()[first : first + 40])
    return engine.tokenizer.encode(text, add_special_tokens=False)[:150]


def test_a_live_request_takes_a_running_shadows_blocks(model: Path) -> None:
    # 16 blocks: a shadow of one of these prompts holds 12, a 150-token live prompt needs 10.
    llm = _llm(model, EXACT, kv_cache_tokens=256)
    try:
        engine = llm.engine
        idle = _first_token_steps(engine, _live_ids(engine, 100))
        _drain(engine)
        engine.add_request("r", _prompt(1), GREEDY)
        while not any(s.kind is SequenceKind.SHADOW for s in engine.scheduler.running):
            engine.step()
            engine.check_integrity()
        assert _first_token_steps(engine, _live_ids(engine, 200)) == idle
        # It yielded its blocks and waits, not done: it resumes once the live request leaves room.
        assert _fidelity(engine)["pending"] == 1
        assert not any(s.kind is SequenceKind.SHADOW for s in engine.scheduler.running)
        _drain(engine)
        assert _fidelity(engine)["configs"]["default"] == {
            "agree": 1,
            "agreement": 1.0,
            "total_variation": None,
        }
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    finally:
        llm.close()
