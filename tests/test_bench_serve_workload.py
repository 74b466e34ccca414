"""bench_serve's workload and figures (benchmarks/serve_workload.py, serve_metrics.py): seeded,
the same prompts for the same arguments, Zipf draws without replacement, Poisson offsets, SLOs."""

from __future__ import annotations

import math
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serve_metrics as sm
import serve_workload as wl


def corpus(m: int = 10) -> list[wl.Chunk]:
    return [wl.Chunk(f"e{i}", f"text of chunk {i}", (f"question {i}a?", f"question {i}b?")) for i in range(m)]


def test_requests_are_seeded_and_well_formed() -> None:
    chunks = corpus()
    a = wl.build_requests(chunks, 30, (2, 4), (16, 128), 1.0, seed=3)
    assert a == wl.build_requests(chunks, 30, (2, 4), (16, 128), 1.0, seed=3)
    assert a != wl.build_requests(chunks, 30, (2, 4), (16, 128), 1.0, seed=4)
    for r in a:
        assert 2 <= len(r.chunks) <= 4 and len(set(r.chunks)) == len(r.chunks)
        assert 16 <= r.max_tokens <= 128
        parts = r.prompt.split(wl.SEPARATOR)
        assert parts[0] == wl.SYSTEM and parts[-1] == r.question
        assert parts[1:-1] == [chunks[c].text for c in r.chunks]
        assert any(r.question in chunks[c].questions for c in r.chunks)


def test_zipf_favours_the_top_ranks_and_zero_is_uniform() -> None:
    weights = wl.zipf_weights(8, 1.0, seed=0)
    assert sorted(weights, reverse=True) == [1 / r for r in range(1, 9)]
    assert wl.zipf_weights(8, 0.0, seed=0) == [1.0] * 8
    rng = random.Random(0)
    counts = Counter(i for _ in range(2000) for i in wl.draw_without_replacement(rng, weights, 1))
    top, bottom = weights.index(1.0), weights.index(1 / 8)
    assert counts[top] > 4 * counts[bottom]


def test_draws_are_distinct_and_in_random_order() -> None:
    rng = random.Random(1)
    weights = wl.zipf_weights(6, 2.0, seed=0)
    draws = [wl.draw_without_replacement(rng, weights, 6) for _ in range(50)]
    assert all(sorted(d) == list(range(6)) for d in draws)
    assert len({tuple(d) for d in draws}) > 10  # not always popular first
    with pytest.raises(ValueError):
        wl.draw_without_replacement(rng, weights, 7)


def test_warmup_sees_every_chunk_once() -> None:
    chunks = corpus(10)
    prompts = wl.warmup_prompts(chunks, per_prompt=4)
    assert len(prompts) == 3
    seen = [t for p in prompts for t in p.split(wl.SEPARATOR)[1:-1]]
    assert seen == [c.text for c in chunks]


def test_arrivals_and_slices() -> None:
    offsets = wl.arrival_offsets(2000, 4.0, seed=0)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[-1] / 1999 == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    assert wl.arrival_offsets(3, math.inf, seed=0) == [0.0] * 3
    assert wl.parse_list("0.5, inf") == [0.5, math.inf] and wl.parse_list(None) == []
    assert [list(s) for s in wl.slices(5, 2)] == [[0, 1], [2, 3, 4]]
    assert len(wl.slices(2, 6)) == 2


def test_figures_goodput_and_unmet_slo() -> None:
    fast = sm.RequestResult(
        ok=True, ttft=1.0, e2e=2.0, itls=[0.1] * 10, prompt_tokens=100, output_tokens=11, cached_tokens=80
    )
    slow = sm.RequestResult(ok=True, ttft=5.0, e2e=6.0, itls=[0.1] * 10, prompt_tokens=100, output_tokens=11)
    failed = sm.RequestResult(ok=False, error="HTTP 500")
    f = sm.run_figures([fast, slow, failed], duration=10.0, slo_ttft=2.0, slo_tpot=0.2)
    assert (f["ok"], f["errors"], f["slo_met"]) == (2, 1, 1)
    assert f["goodput"] == pytest.approx(0.1) and f["req_per_s"] == pytest.approx(0.2)
    assert f["tpot_mean"] == pytest.approx(0.1) and f["cached_share"] == pytest.approx(0.4)
    assert f["ttft_p50"] == pytest.approx(3.0)
    assert not sm.slo_note(f, 2.0, 0.2)
    none = sm.run_figures([slow], duration=10.0, slo_ttft=1.0, slo_tpot=0.2)
    assert none["goodput"] == 0 and "goodput 0" in sm.slo_note(none, 1.0, 0.2)
    assert sm.ratio(0.0, 0.0) == "nan" and sm.ratio(1.0, 0.0) == "inf" and sm.ratio(1.0, 4.0) == "0.25x"


def test_real_corpus_chunks_ask_what_they_state() -> None:
    pytest.importorskip("mendeleev")
    chunks = wl.element_corpus(8, 500, seed=0)
    assert chunks == wl.element_corpus(8, 500, seed=0) and len({c.name for c in chunks}) == 8
    for c in chunks:
        assert wl.SEPARATOR.strip() not in c.text and c.questions


def test_cluster_sides_are_named_and_compared() -> None:
    """A cluster side per router policy, each with its own SUMMARY key; cache_aware's figures are
    set against every other policy run beside it (issue 57's cluster on the real model)."""
    import bench_serve
    import serve_sides

    assert {f"cluster-{p}" for p in serve_sides.CLUSTER_POLICIES} <= set(serve_sides.SIDES)
    assert len(set(serve_sides.SHORT.values())) == len(serve_sides.SHORT) == len(serve_sides.SIDES)
    args, _ = bench_serve.parse_args(["--model", "smollm2"])
    assert args.sides == ["chunkcache", "chunkcache-off", "llama.cpp"]  # clusters only when asked
    args, _ = bench_serve.parse_args(
        ["--sides", "cluster-cache_aware,cluster-round_robin", "--replicas", "3"]
    )
    assert args.replicas == 3
    figures = {"goodput": 2.0, "ttft_p50": 1.0, "ttft_p90": 2.0, "ttft_p99": 3.0, "errors": 0}
    runs = {"c2": {"cluster-cache_aware": {"figures": figures},
                   "cluster-round_robin": {"figures": {**figures, "goodput": 1.0, "ttft_p90": 4.0}}}}  # fmt: skip
    line = bench_serve.summary_line(args, runs)
    assert "c2_goodput_cl_ca_over_cl_rr=2.00x" in line and "c2_ttft_p90_cl_ca_over_cl_rr=0.50x" in line
