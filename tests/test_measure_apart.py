"""Tools that measure reuse configurations against a full prefill in one engine (calibrate, eval,
the fidelity and fusion benchmarks) keep them apart: with `exact_follow_ups` (a user may serve with it on) the
reference's plain prefill leaves the prompt's S and documents in the prefix cache, and a reuse
request after it would run as that plain prompt and report full prefill's reply. The tools build
their engines with `fidelity.measure.ENGINE_OPTIONS` and refuse one that would leak."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkcache.evaluate import default_modes, evaluate
from chunkcache.fidelity import measure
from chunkcache.fidelity.configs import CANDIDATES
from chunkcache.sampling import SamplingParams
from tests.support.engines import tiny_llm
from tests.support.prompts import DOCS, QUESTION, SYSTEM, chunked
from tests.test_cli import TINY, _error_line

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _hits(llm) -> tuple[int, int]:
    stats = llm.chunk_cache_stats()
    return stats["exact_prefix_hits"], stats["exact_prefix_jobs"]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["fusion/contrastive", "offset"])
def test_no_configuration_reads_the_full_prefills_prefix(
    checkpoint: Callable[..., Path], config: str
) -> None:
    path = checkpoint(arch="llama", num_hidden_layers=3)
    options = CANDIDATES[config]
    llm = tiny_llm(path, kv_cache_tokens=4096, **measure.ENGINE_OPTIONS)
    text = measure.render(llm.tokenizer, DOCS[:3], QUESTION, llm.engine.config.chunk.separator)
    configs = {"full": None, config: options}
    # Twice, each configuration first once: the reuse request after the full prefill, and after
    # its own earlier sights of the prompt (which at the default two sights would queue a job).
    outcomes = [measure.measure(llm, text, configs, 6, rotate) for rotate in range(2)]
    assert _hits(llm) == (0, 0)
    # Its reply is what an engine that never ran the full prefill serves.
    fresh = tiny_llm(path, kv_cache_tokens=4096, **measure.ENGINE_OPTIONS)
    measure.warm(fresh, text)
    alone = measure.run(fresh, text, SamplingParams(temperature=0, max_tokens=6), options)
    assert all(o[config].reply == alone.outputs[0].text for o in outcomes)
    llm.check_integrity()

    # The option on (as a user may serve) would leak, so the tools' helpers refuse it ...
    leaky = tiny_llm(path, kv_cache_tokens=4096, exact_follow_ups=True)
    with pytest.raises(ValueError, match="exact_follow_ups"):
        measure.measure(leaky, text, configs, 6)
    with pytest.raises(ValueError, match="exact_follow_ups"):
        evaluate(leaky, [chunked(SYSTEM, DOCS[:3], QUESTION)], default_modes([0.3], 0), 4)
    # ... as it would: after a full prefill of the same tokens the reuse request is an exact hit.
    ids = measure.parse(leaky, text).all_token_ids()
    leaky.generate([ids], GREEDY, add_special_tokens=False)
    leaky.generate([text], GREEDY, add_special_tokens=False, chunk_options=options)
    assert _hits(leaky)[0] == 1
    # So does an engine with its defaults (exact prefixes read, no job queued).
    with pytest.raises(ValueError, match="exact_prefix_reads"):
        measure.check_engine(tiny_llm(path, kv_cache_tokens=4096))
    # Without prefix caching nothing can leak (and no job is queued for no one).
    plain = tiny_llm(path, kv_cache_tokens=4096, enable_prefix_caching=False, exact_follow_ups=True)
    measure.check_engine(plain)
    for _ in range(3):
        plain.generate([text], GREEDY, add_special_tokens=False, chunk_options=options)
    assert _hits(plain) == (0, 0)


def test_calibrate_and_eval_refuse_exact_follow_ups(
    capsys: pytest.CaptureFixture[str], checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Before the model loads: the flag would make every configuration a full prefill."""
    model = str(checkpoint("llama"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"system": SYSTEM, "chunks": DOCS[:2], "question": QUESTION}) + "\n")
    line = _error_line(
        capsys, ["calibrate", "--model", model, "--out", str(tmp_path), "--exact-follow-ups", *TINY]
    )
    assert "exact_follow_ups" in line
    line = _error_line(
        capsys, ["eval", "--model", model, "--prompts", str(prompts), "--exact-follow-ups", *TINY]
    )
    assert "--exact-follow-ups" in line
    line = _error_line(
        capsys, ["eval", "--model", model, "--prompts", str(prompts), "--exact-prefix-reads", *TINY]
    )
    assert "--exact-prefix-reads" in line
