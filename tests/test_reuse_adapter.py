"""The reuse adapter's recipe (training/reuse_adapter.py): what it trains on is what the engine serves.

The student's forward (the 4D mask and positions of layout "offset") must give the log-probs the
engine computes when it reuses the documents' cached KV with no recompute; otherwise the adapter
would learn to read a cache the engine never builds. The recipe then runs end to end on a tiny
checkpoint and writes an adapter that the engine loads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from chunkcache import LLM, SamplingParams

pytest.importorskip("peft")

from tests.support.prompts import FIRST, REUSE
from training import reuse_adapter, reuse_corpus


def _options(**kw) -> argparse.Namespace:
    base = {"rank": 4, "alpha": 8.0, "targets": reuse_adapter.TARGETS, "device": "cpu"}
    return argparse.Namespace(**{**base, **kw})


def test_student_forward_is_the_engines_offset_reuse(checkpoint) -> None:
    path = checkpoint(arch="llama")
    model, tokenizer = reuse_adapter.load(str(path), _options())
    # Prefix caching off: pure offset reuse (with it on, the last document's tokens after its
    # last full block run fresh, so that follow-ups can read the blocks; see test_blended_prefix).
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        kv_cache_tokens=4096,
        chunk_cache_size_gb=0.01,
        enable_prefix_caching=False,
    )
    for sample in reuse_corpus.samples(tokenizer, 2, seed=1):
        prompt = sample.text
        llm.generate([prompt], FIRST, add_special_tokens=False, chunk_options={"chunk_layout": "isolated"})
        out = llm.generate([prompt], FIRST, add_special_tokens=False, chunk_options=REUSE)[0]
        assert out.num_cached_tokens > len(sample.sys_ids)  # the documents came from the cache
        with torch.no_grad():
            ref = reuse_adapter.student_logprobs(model, sample, [out.outputs[0].token_ids[0]], "cpu")[0]
        for token, lp in out.outputs[0].logprobs[0].items():
            assert abs(ref[token].item() - lp) < 1e-4, (token, ref[token].item(), lp)


def test_recipe_writes_an_adapter_the_engine_loads(checkpoint, tmp_path: Path) -> None:
    path = checkpoint(arch="llama")
    out = tmp_path / "adapter"
    reuse_adapter.main(
        ["--model", str(path), "--out", str(out), "--samples", "4", "--val", "2", "--max-new", "4",
         "--val-every", "2", "--rank", "4", "--lr", "1e-2"]
    )  # fmt: skip
    log = json.loads((out / "training_log.json").read_text())
    assert len(log["loss"]) == 4 and [v["seen"] for v in log["val"]] == [0, 2, 4]
    llm = LLM(str(path), device="cpu", dtype="float32", adapter=str(out), enable_chunk_cache=False)
    plain = LLM(str(path), device="cpu", dtype="float32", enable_chunk_cache=False)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    a, b = (x.generate(["Where does Alice live?"], params)[0].outputs[0].logprobs[0] for x in (llm, plain))
    assert a != b  # one pass at this learning rate moves the weights
