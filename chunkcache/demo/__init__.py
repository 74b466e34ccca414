"""The demo model's task and where its checkpoints live.

`chunkcache.demo.corpus` is the synthetic document-QA task (documents about invented entities, a
question answered from one or two of them) and its exact prompt format; the training script
`scripts/train_demo_model.py --out-dir chunkcache/demo` trains two small Qwen3 checkpoints on it
into this folder:

* `model-block` (the default, `DEMO_MODEL_DIR`): trained on full causal prompts *and* on the
  chunk-isolated layout (Block-Attention style), so answers survive chunk-cache reuse;
* `model-full`: trained on full causal prompts only (the baseline that shows what reuse costs a
  model never trained for it).

Both checkpoints ship (4.2 M parameters, 17 MB each; `train_summary.json` beside each holds the
settings). They answer all 500 held-out questions of `benchmarks/bench_quality.py` word for word,
single- and two-hop, under full prefill and under every reuse mode (`benchmarks/RESULTS.md`,
section bench_quality), as long as no two documents describe the same kind of entity
(`corpus.py` says why). Where `model-block/config.json` is absent (a build
without the weights), the CLI's default model is a tiny random checkpoint instead
(`chunkcache.cli.default_model`).

Prompts follow the training format: `format_prompt(system, docs, question)` for `LLM.generate`,
or `chat_messages(system, docs, question)` for `LLM.chat`.
"""

from __future__ import annotations

from pathlib import Path

from chunkcache.demo.corpus import (
    DEFAULT_SYSTEM_PROMPT,
    SEPARATOR,
    chat_messages,
    exact_match,
    format_prompt,
    held_out_set,
    make_example,
)

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "DEFAULT_VARIANT",
    "DEMO_DIR",
    "DEMO_MODEL_DIR",
    "SEPARATOR",
    "VARIANTS",
    "chat_messages",
    "demo_model_path",
    "exact_match",
    "format_prompt",
    "held_out_set",
    "make_example",
]

DEMO_DIR = Path(__file__).resolve().parent
VARIANTS: tuple[str, ...] = ("block", "full")
# The variant served by default: it does as well as "full" on full prompts and keeps its accuracy
# under chunk-cache reuse (benchmarks/RESULTS.md, section bench_quality).
DEFAULT_VARIANT = "block"


def demo_model_path(variant: str | None = None) -> Path:
    """The checkpoint directory of a demo variant ("block" or "full"; None = the default)."""
    variant = DEFAULT_VARIANT if variant is None else variant
    if variant not in VARIANTS:
        raise ValueError(f"unknown demo model variant {variant!r}; expected one of {VARIANTS}")
    return DEMO_DIR / f"model-{variant}"


DEMO_MODEL_DIR: Path = demo_model_path()
