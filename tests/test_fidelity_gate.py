"""The fidelity gate (issue 34): `chunkcache calibrate` writes a profile keyed by the model's
identity, resumes where it stopped, and an engine with `fidelity_target` serves with the fastest
configuration of that profile meeting the target (else the most accurate one), refusing a profile
that is malformed or of another model."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkcache import LLM
from chunkcache.cli import main
from chunkcache.config import ChunkConfig, EngineConfig, ReuseOptions
from chunkcache.fidelity import profile as profiles
from chunkcache.fidelity.calibrate import read_results
from chunkcache.fidelity.configs import CANDIDATES, fits
from chunkcache.fidelity.prompts import builtin_questions, parse_line
from chunkcache.model.catalog import QWEN_CODER_1_5B

TINY = ["--device", "cpu", "--threads", "1", "--kv-cache-tokens", "2048"]
ENGINE = {"device": "cpu", "threads": 1, "kv_cache_tokens": 2048}
LINES = [
    {
        "documents": ["the cat sat on the mat by the door", "a dog ran in the park with a red ball"],
        "question": "where did the cat sit?",
        "answers": ["mat"],
    },
    {"documents": ["the sun is bright"], "question": 42},  # invalid: line 2
    {
        "documents": ["birds fly over the river", "the river is cold and deep"],
        "question": "what is the river?",
    },
]
EXTRA = {"documents": ["a small boat on the lake", "the lake is calm"], "question": "what is on the lake?"}


def _measured(name: str, kept: float | None, speedup: float | None, n: int = 10_000) -> profiles.Measured:
    """`kept` of `n` prompts kept: a large n puts the 95% lower bound within a point of it."""
    count = round(n * (kept or 0))
    return profiles.Measured(
        name, ReuseOptions(chunk_layout="isolated"), n, n, count, None if kept is None else count / n, kept, None,
        0.0, None if speedup is None else 1 / speedup, speedup,
    )  # fmt: skip


def _profile(*configs: profiles.Measured) -> profiles.Profile:
    return profiles.Profile("m", "0" * 64, "cpu", "float32", "test", 8, 10, None, None, configs)


def test_choice_is_the_fastest_meeting_the_target() -> None:
    p = _profile(_measured("slow", 1.0, 2.0), _measured("fast", 0.96, 8.0), _measured("lossy", 0.5, 20.0))
    choice = profiles.choose(p, 0.95)
    assert choice.chosen.name == "fast" and choice.met
    assert profiles.choose(p, 0.97).chosen.name == "slow"
    assert profiles.choose(p, 0.4).chosen.name == "lossy"


def test_ties_go_to_the_more_accurate_then_the_first_listed() -> None:
    p = _profile(_measured("a", 0.96, 4.0), _measured("b", 0.99, 4.0), _measured("c", 0.99, 4.0))
    assert profiles.choose(p, 0.95).chosen.name == "b"
    unmet = _profile(_measured("a", 0.8, 2.0), _measured("b", 0.9, 2.0), _measured("c", 0.9, 3.0))
    assert profiles.choose(unmet, 0.95).chosen.name == "c"  # equally accurate: the faster


def test_missing_entries_are_skipped_and_named() -> None:
    p = _profile(
        _measured("unmeasured", None, None), _measured("no-ttft", 1.0, None), _measured("ok", 0.97, 3.0)
    )
    choice = profiles.choose(p, 0.95)
    assert choice.chosen.name == "ok" and choice.skipped == ("unmeasured", "no-ttft")
    assert "unmeasured, no-ttft" in choice.reason(0.95)
    with pytest.raises(profiles.ProfileError, match="no configuration"):
        profiles.choose(_profile(_measured("x", None, 2.0)), 0.95)


def test_unmet_target_takes_the_most_accurate() -> None:
    p = _profile(_measured("fast", 0.6, 10.0), _measured("best", 0.9, 2.0))
    choice = profiles.choose(p, 0.95)
    assert choice.chosen.name == "best" and not choice.met
    assert "no configuration's 95% lower bound meets the target 0.95" in choice.reason(0.95)
    # Most accurate by the bound: 95 of 100 (at least 88.8%) over 10 of 10 (at least 72.2%).
    few = _profile(_measured("ten", 1.0, 3.0, n=10), _measured("hundred", 0.95, 2.0, n=100))
    assert profiles.choose(few, 0.99).chosen.name == "hundred"


def test_few_prompts_do_not_pass_a_target_by_luck() -> None:
    """14 of 14 estimates 100% but bounds it at 78%; 990 of 1,000 bounds it at 98.2%."""
    few, many = _measured("few", 1.0, 4.0, n=14), _measured("many", 0.99, 2.0, n=1000)
    assert round(few.kept_lower, 3) == 0.785 and round(many.kept_lower, 3) == 0.982
    choice = profiles.choose(_profile(few, many), 0.95)
    assert choice.chosen.name == "many" and choice.met and choice.unsure == (few,)
    reason = choice.reason(0.95)
    assert "kept 990 of 1000 (estimate 99.0%, 95% lower bound 98.2%)" in reason
    assert "meeting it by estimate only (too few prompts): few (kept 14 of 14 (estimate 100.0%" in reason
    # With more prompts at the same share the fast one passes, and nothing is unsure.
    choice = profiles.choose(_profile(_measured("few", 1.0, 4.0, n=200), many), 0.95)
    assert choice.chosen.name == "few" and choice.unsure == ()
    # Alone, the small sample is the most accurate there is: chosen, but not as meeting the target.
    alone = profiles.choose(_profile(few), 0.95)
    assert alone.chosen.name == "few" and not alone.met


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda raw: "{not json", "is not JSON"),
        (lambda raw: json.dumps({**raw, "format": "other"}), "'format' field"),
        (lambda raw: json.dumps({**raw, "configurations": []}), "non-empty list"),
        (lambda raw: json.dumps({**raw, "configurations": [{**raw["configurations"][0], "kept_fraction": 2}]}), "kept_fraction 2"),
        (lambda raw: json.dumps({**raw, "configurations": [{**raw["configurations"][0], "kept_fraction": 0.5}]}), r"kept_fraction 0.5 is not kept / counted \(10000 / 10000\)"),
        (lambda raw: json.dumps({**raw, "configurations": [{**raw["configurations"][0], "kept": 10001}]}), "kept <= counted <= prompts"),
        (lambda raw: json.dumps({**raw, "configurations": [{**raw["configurations"][0], "options": {"bogus": 1}}]}), "unknown chunk options"),
        (lambda raw: json.dumps({**raw, "configurations": [{**raw["configurations"][0], "options": {"chunk_layout": "diagonal"}}]}), r"configurations\[0\] \(a\): options: chunk_layout 'diagonal' is not one of"),
        (lambda raw: json.dumps({**raw, "configurations": [{**raw["configurations"][0], "options": {"blend_check_layers": ["1"]}}]}), r"\(a\): options: blend_check_layers must be a list of integers, got \['1'\]"),
        (lambda raw: json.dumps({**raw, "configurations": [{**raw["configurations"][0], "options": {"fusion_amateur": 1}}]}), r"\(a\): options: fusion_amateur must be true or false, got 1"),
        (lambda raw: json.dumps({**raw, "configurations": [{**raw["configurations"][0], "options": {"blend_check_layers": [1], "blend_recompute_ratios": [1.5]}}]}), r"\(a\): options: blend_recompute_ratios must be in \[0, 1\]"),
        (lambda raw: json.dumps({k: v for k, v in raw.items() if k != "model"}), "missing or malformed field"),
    ],
)  # fmt: skip
def test_a_malformed_profile_is_refused_naming_it(edit: Callable, message: str) -> None:
    raw = json.loads(_profile(_measured("a", 1.0, 2.0)).to_json())
    with pytest.raises(profiles.ProfileError, match=message) as e:
        profiles.parse(edit(raw), "p.json")
    assert "fidelity_profile p.json" in str(e.value)


@pytest.mark.parametrize("target", [0, 1.5, -0.1, True, float("nan")])
def test_a_target_out_of_range_is_an_error_naming_it(target: float) -> None:
    with pytest.raises(ValueError, match="fidelity_target"):
        EngineConfig.from_options("m", use_env=False, fidelity_target=target)


def test_gate_options_that_contradict_are_errors() -> None:
    with pytest.raises(ValueError, match="fidelity_profile is read only with fidelity_target"):
        EngineConfig.from_options("m", use_env=False, fidelity_profile="x")
    with pytest.raises(ValueError, match="do not also set chunk_layout"):
        EngineConfig.from_options("m", use_env=False, fidelity_target=0.9, chunk_layout="isolated")


def test_prompt_lines_name_what_is_wrong() -> None:
    assert parse_line(json.dumps(LINES[0]), " # # ").answers == (("mat",),)
    assert parse_line(json.dumps({**LINES[0], "answers": [["a"], ["b", "c"]]}), " # # ").answers == (
        ("a",),
        ("b", "c"),
    )
    for bad, message in (
        (LINES[1], "question"),
        ({"documents": [], "question": "q"}, "documents"),
        ({**LINES[0], "answer": "mat"}, "unknown fields"),
        ({**LINES[0], "answers": "mat"}, "answers"),
        ({"documents": ["a # # b"], "question": "q"}, "separator"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_line(json.dumps(bad), " # # ")


def _calibrate_argv(model: Path, prompts: Path, out: Path) -> list[str]:
    """`chunkcache calibrate` on the tiny model over `prompts`, its profile in `out`."""
    return [
        "calibrate",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--max-tokens",
        "6",
        *TINY,
    ]


@pytest.fixture(scope="module")
def calibrated(
    checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, Path]:
    """(model, prompt file, profile folder) after one calibrate run on a 3-line file."""
    model = checkpoint("llama")
    root = tmp_path_factory.mktemp("calibrate")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    out = root / "profiles"
    assert main(_calibrate_argv(model, prompts, out)) == 0
    return model, prompts, out


def _files(out: Path) -> tuple[Path, Path]:
    (profile,) = out.glob("*[0-9a-f].json")
    return profile, profile.with_suffix(".results.jsonl")


def test_calibrate_writes_a_profile_the_engine_loads(
    calibrated: tuple[Path, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    model, _, out = calibrated
    path, results = _files(out)
    profile = profiles.parse(path.read_text(), str(path))
    assert profile.prompts == 2  # the invalid line skipped
    names = [c.name for c in profile.configurations]
    assert "isolated" in names and "blend@0.3/L4" not in names  # the tiny model has 2 layers
    assert all(c.complete for c in profile.configurations)
    assert len(read_results(results)) == 2
    with caplog.at_level(logging.INFO, logger="chunkcache.fidelity.gate"):
        llm = LLM(str(model), fidelity_target=0.5, fidelity_profile=str(out), **ENGINE)
    try:
        chosen = profiles.choose(profile, 0.5).chosen
        assert isinstance(chosen.options, ReuseOptions)  # typed when the profile was read
        expected = llm.engine.config.chunk.with_request_options(chosen.options, llm.engine.spec.num_layers)
        assert llm.engine.config.chunk == expected
        assert f"use {chosen.name}" in caplog.text
        # The log line gives n, the estimate and the bound (two prompts: nothing meets 0.5).
        assert f"kept {chosen.kept} of {chosen.counted} (estimate" in caplog.text
        assert "95% lower bound" in caplog.text and "no configuration's 95% lower bound" in caplog.text
    finally:
        llm.close()


def test_no_profile_keeps_the_default_and_says_how_to_make_one(
    calibrated: tuple[Path, Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = calibrated[0]
    with caplog.at_level(logging.INFO, logger="chunkcache.fidelity.gate"):
        llm = LLM(str(model), fidelity_target=0.95, fidelity_profile=str(tmp_path), **ENGINE)
    try:
        assert llm.engine.config.chunk == EngineConfig.from_options(str(model), use_env=False).chunk
        assert "chunkcache calibrate --model" in caplog.text
    finally:
        llm.close()


def test_unmet_target_is_logged_and_another_models_profile_refused(
    calibrated: tuple[Path, Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, _, out = calibrated
    path, _ = _files(out)
    raw = json.loads(path.read_text())
    for i, c in enumerate(raw["configurations"]):  # nothing meets 0.99; the 2nd is the most accurate
        c.update(prompts=100, counted=100, kept=90 if i == 1 else 50, kept_fraction=0.9 if i == 1 else 0.5)
    unmet = tmp_path / "unmet.json"
    unmet.write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="chunkcache.fidelity.gate"):
        llm = LLM(str(model), fidelity_target=0.99, fidelity_profile=str(unmet), **ENGINE)
    llm.close()
    assert (
        f"use {raw['configurations'][1]['name']}" in caplog.text
        and "no configuration's 95% lower bound" in caplog.text
    )
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**raw, "identity": "f" * 64}))
    with pytest.raises(profiles.ProfileError, match="measured on another model"):
        LLM(str(model), fidelity_target=0.9, fidelity_profile=str(other), **ENGINE)


def test_calibrate_resumes_where_it_stopped(
    calibrated: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model, prompts, out = calibrated
    _, results = _files(out)
    before = results.read_text().splitlines()
    with results.open("a") as f:
        f.write('{"key": "torn')  # a run killed mid-line
    with prompts.open("a") as f:
        f.write(json.dumps(EXTRA) + "\n")
    assert main(_calibrate_argv(model, prompts, out)) == 0
    after = [line for line in results.read_text().splitlines() if not line.startswith('{"key": "torn')]
    assert after[: len(before)] == before and len(after) == len(before) + 1  # only the new prompt ran
    assert "skipped" in capsys.readouterr().err  # line 2 still reported
    path, _ = _files(out)
    assert profiles.parse(path.read_text(), str(path)).prompts == 3


def test_dataclass_round_trip() -> None:
    p = _profile(_measured("a", 1.0, 2.0))
    assert profiles.parse(p.to_json(), "x") == dataclasses.replace(p)
    blend = ReuseOptions(chunk_layout="offset", blend_check_layers=(1,), blend_recompute_ratios=(0.3,))
    p = _profile(dataclasses.replace(_measured("b", 1.0, 2.0), options=blend))
    assert json.loads(p.to_json())["configurations"][0]["options"] == {
        "chunk_layout": "offset", "blend_check_layers": [1], "blend_recompute_ratios": [0.3],
    }  # fmt: skip
    assert profiles.parse(p.to_json(), "x").configurations[0].options == blend


def test_candidates_are_bench_fidelitys_modes_and_the_15b_default_among_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A profile row, a RESULTS.md row of bench_fidelity and a model's catalog default that share a
    name mean the same options; the 1.5B's default (the conditional joint stream) is calibrated."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_fidelity import MODES

    shared = set(CANDIDATES) & set(MODES)
    default = "fusion/contrastive/joint3/m0.6/s1"
    assert default in shared and len(shared) >= len(CANDIDATES) - 1
    for name in shared:
        assert MODES[name] == CANDIDATES[name], name
    pair = ReuseOptions.from_mapping(CANDIDATES[default])
    # The 1.5B's default as served: the catalog's options over the generic default (the catalog
    # names only what differs from it), every chunk option equal to the candidate's over it.
    served = EngineConfig.from_options(QWEN_CODER_1_5B.name, use_env=False).chunk
    assert ChunkConfig().with_request_options(pair, None) == served
    assert (pair.fusion_pair_margin, pair.fusion_max_joint, pair.fusion_max_streams) == (0.6, 3, 1)
    assert pair.fusion_joint_excerpt == 0 and "fusion/contrastive/joint3/m0.6/s1/x48" in shared
    assert fits(CANDIDATES[default], 1)
    p = _profile(dataclasses.replace(_measured(default, 0.9, 4.0), options=pair))
    assert profiles.parse(p.to_json(), "x").configurations[0].options == pair


def test_builtin_splits_are_disjoint_halves() -> None:
    """Calibrating on the tune half leaves the held-out half unseen (bench_fidelity_gate's stream);
    both sets alternate within a half, so a limit keeps both kinds."""
    halves = {split: [q.qid for q in builtin_questions(0, "both", split)] for split in ("tune", "heldout")}
    everything = {q.qid for q in builtin_questions(0)}
    assert halves["tune"] and halves["heldout"] and not set(halves["tune"]) & set(halves["heldout"])
    assert set(halves["tune"]) | set(halves["heldout"]) == everything
    first = builtin_questions(6, "both", "heldout")
    assert len(first) == 6 and {type(q).__name__ for q in first[:2]} == {"Question", "CounterfactualQuestion"}
    assert all(q.split == "heldout" for q in first)
    with pytest.raises(ValueError, match="split must be one of"):
        builtin_questions(1, "both", "test")


def test_check_layers_beyond_the_model_are_refused_at_start(
    calibrated: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """Parsing cannot know the model's depth; the gate, merging for the model, names them."""
    model, _, out = calibrated
    path, _ = _files(out)
    raw = json.loads(path.read_text())
    for c in raw["configurations"]:
        c["options"] = {"chunk_layout": "offset", "blend_check_layers": [7], "blend_recompute_ratios": [0.3]}
    deep = tmp_path / "deep.json"
    deep.write_text(json.dumps(raw))
    with pytest.raises(
        profiles.ProfileError, match=r"deep.json: [^:]+: blend_check_layers \[7\] out of range"
    ):
        LLM(str(model), fidelity_target=0.5, fidelity_profile=str(deep), **ENGINE)


def test_command_line_mistakes_are_one_line_errors(
    calibrated: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, prompts, _ = calibrated
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    generate = ["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "1", *TINY]
    for argv, message in (
        ([*generate, "--fidelity-target", "0.9", "--fidelity-profile", str(bad)], f"fidelity_profile {bad}"),
        ([*generate, "--fidelity-target", "1.5"], "fidelity_target must be a fraction in (0, 1]"),
        (["calibrate", "--model", str(model), "--prompts", str(prompts), "--target", "0", *TINY], "--target"),
        (["calibrate", "--model", str(model), "--chunk-layout", "isolated", *TINY], "chunk_layout"),
        (["calibrate", "--model", str(model), "--configs", "nope", *TINY], "unknown configurations"),
        (["calibrate", "--model", str(model), "--no-enable-chunk-cache", *TINY], "enable_chunk_cache"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and message in err, err


def test_kept_interval_is_wilsons() -> None:
    def interval(kept: int, counted: int) -> tuple[float, float]:
        m = dataclasses.replace(_measured("a", 1.0, 1.0), kept=kept, counted=counted)
        lo, hi = m.kept_interval() or (-1.0, -1.0)
        return round(lo, 4), round(hi, 4)

    assert interval(0, 10) == (0.0, 0.2775) and interval(10, 10) == (0.7225, 1.0)
    assert interval(5, 10) == (0.2366, 0.7634)
    assert dataclasses.replace(_measured("a", None, None), counted=0).kept_interval() is None
