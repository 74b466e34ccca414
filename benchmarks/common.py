"""Shared helpers of the benchmarks: the benchmark checkpoint, timing, prompts of exact token counts.

The scripts run as `python benchmarks/<name>.py`, so this module is imported as `common` (the
script's directory is first on `sys.path`). Importing it puts the repository root on `sys.path`
too, so that `chunkcache` is this checkout's and the tests' helper package imports as
`tests.support` (`tiny_checkpoint`: the random checkpoints the tests use, and the
Qwen2.5-0.5B-shaped one here).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import string
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkcache.chunk.parse import parse_chunked_prompt
from chunkcache.core.plan import ChunkedPrompt

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

if TYPE_CHECKING:
    from chunkcache import SamplingParams
    from chunkcache.engine.engine import LLMEngine
    from chunkcache.outputs import RequestOutput

DEFAULT_MODEL_DIR = Path(
    os.environ.get("CHUNKCACHE_BENCH_MODEL_DIR", Path.home() / ".cache" / "chunkcache" / "bench-qwen2.5-0.5b")
)
# Ids 0..4 are the tiny tokenizer's special tokens (BOS, EOS, PAD, ChatML); 5.. are ordinary.
FIRST_ORDINARY_TOKEN = 5
SEP = " # # "


@dataclass(frozen=True)
class ChunkShapes:
    """Token counts of a chunked prompt `S # # C1 ... # # Cn # # Q` (S with BOS) and the tokens
    generated per request."""

    sys_len: int = 128
    chunk_len: int = 1024
    num_chunks: int = 4
    q_len: int = 64
    new_tokens: int = 16


QUICK_CHUNK_SHAPES = ChunkShapes(sys_len=32, chunk_len=128, num_chunks=4, q_len=16, new_tokens=4)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a checkpoint directory or .gguf file to measure, a known model's short name (smollm2, "
        "qwen2.5-coder-1.5b), or 'default' for chunkcache's default model (qwen2.5-coder-1.5b; "
        "SmolLM2-135M-Instruct before issue 33); without it, the random Qwen2.5-0.5B-shaped checkpoint "
        "of --model-dir",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="the Qwen2.5-0.5B-shaped random checkpoint; built there if missing (default: %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads, for both sides (default: the engine's, the physical cores)",
    )
    parser.add_argument("--seed", type=int, default=0)


def ensure_checkpoint(model_dir: Path) -> Path:
    """The random Qwen2.5-0.5B-shaped checkpoint (hidden 896, 24 layers, 14 heads, 2 KV heads,
    vocab 151936, tied embeddings), built once (~2 GB, about a minute) and reused."""
    from tests.support.tiny_checkpoint import build_checkpoint

    return build_checkpoint(model_dir, arch="qwen2", preset="qwen2.5-0.5b")


def bench_model(args: argparse.Namespace) -> str:
    """The model a benchmark measures: --model (`default` = chunkcache's default model, a short name
    = that model's file), else the random Qwen2.5-0.5B-shaped checkpoint, built on first use."""
    from chunkcache.model import catalog
    from chunkcache.model.loader import model_path

    if args.model == "default":
        return model_path(catalog.DEFAULT_MODEL)
    if args.model is not None and catalog.known(args.model) is not None:
        return model_path(args.model)
    return args.model or str(ensure_checkpoint(args.model_dir))


def hf_causal_lm(model: str, **kwargs: Any) -> Any:
    """transformers' model of a checkpoint directory or a .gguf file (its own GGUF reader)."""
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    return AutoModelForCausalLM.from_pretrained(model, **kwargs)


def ordinary_token_ids(tokenizer: Any, vocab_size: int) -> list[int]:
    """Ids below both the tokenizer's and the model's vocab size that are not special tokens."""
    special = set(tokenizer.all_special_ids) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special
    }
    return [i for i in range(min(len(tokenizer), vocab_size)) if i not in special]


def setup_torch(threads: int | None) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


def describe_machine() -> str:
    import torch
    import transformers

    return (
        f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


@contextmanager
def timed() -> Iterator[list[float]]:
    """`with timed() as t: ...` then `t[0]` is the wall time in seconds."""
    out: list[float] = []
    start = time.perf_counter()
    try:
        yield out
    finally:
        out.append(time.perf_counter() - start)


def now() -> tuple[float, float]:
    """(wall, process CPU) clocks in seconds. With one torch thread, the process CPU time of a run
    hardly depends on how busy the rest of the machine is; its wall time does."""
    return time.perf_counter(), time.process_time()


def chunked_prompt(
    tokenizer: Any, shapes: ChunkShapes, sys: str, chunks: list[str], q: str
) -> tuple[str, ChunkedPrompt]:
    """`S # # C1 ... # # Q` joined, and its parse, checked to have exactly the shapes' token counts
    (any number of chunks)."""
    text = SEP.join([sys, *chunks, q])
    parsed = parse_chunked_prompt(text, SEP, tokenizer)
    assert parsed is not None
    assert len(parsed.sys_token_ids) == shapes.sys_len
    assert [len(c) for c in parsed.chunks] == [shapes.chunk_len] * len(chunks)
    assert len(parsed.question_token_ids) == shapes.q_len
    return text, parsed


def first_token_time(
    engine: LLMEngine,
    request_id: str,
    prompt: str | list[int],
    params: SamplingParams,
    chunk_options: dict[str, Any] | None = None,
) -> tuple[float, float, RequestOutput]:
    """Run one request to its end on an otherwise idle engine: (wall TTFT, process CPU time to the
    first token, the final output). TTFT counts from just before `add_request`, so parsing and
    tokenizing are inside it."""
    first: tuple[float, float] | None = None
    final: RequestOutput | None = None
    start = now()
    engine.add_request(request_id, prompt, params, chunk_options=chunk_options)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if first is None and out.outputs[0].token_ids:
                first = now()
            if out.finished:
                final = out
    assert first is not None and final is not None
    return first[0] - start[0], first[1] - start[1], final


def median(values: list[float]) -> float:
    return statistics.median(values)


def fmt_runs(values: list[float], unit: str = "s", scale: float = 1.0) -> str:
    """`1.234 s (runs 1.2, 1.3, 1.2)`: the median and every run."""
    runs = ", ".join(f"{v * scale:.3g}" for v in values)
    return f"{median(values) * scale:.4g} {unit} (runs {runs})"


def interleaved(reps: int, a: Callable[[int], Any], b: Callable[[int], Any]) -> None:
    """Run `a(i)` and `b(i)` for each repetition, alternating which goes first, so that a slow
    drift of the machine's load does not favour either side."""
    for i in range(reps):
        if i % 2 == 0:
            a(i)
            b(i)
        else:
            b(i)
            a(i)


def random_token_ids(rng: random.Random, n: int, vocab: int | list[int]) -> list[int]:
    """`n` ordinary token ids drawn from `rng`: from `vocab` when it is a list of ids (see
    `ordinary_token_ids`), else from FIRST_ORDINARY_TOKEN..vocab-1 (the tiny tokenizer's)."""
    if isinstance(vocab, list):
        return [rng.choice(vocab) for _ in range(n)]
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(n)]


class TextMaker:
    """Random text of an exact token count under a given tokenizer.

    Text is random lowercase words (so two texts never share content by accident, and never
    contain a chunk separator), topped up with words that are a single token each until the count
    is exact. The byte-level pre-tokenizer splits before every space, so word tokens add up.
    """

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tok = tokenizer
        self.rng = random.Random(seed)
        fillers = []
        for tid in range(FIRST_ORDINARY_TOKEN, len(tokenizer)):
            s = tokenizer.decode([tid])
            word = s[1:]
            if (
                s.startswith(" ")
                and word.isalpha()
                and word.isascii()
                and len(tokenizer.encode(s, add_special_tokens=False)) == 1
            ):
                fillers.append(word)
        if not fillers:
            raise RuntimeError("the tokenizer has no single-token words to pad texts with")
        self.fillers = fillers

    def count(self, text: str, special: bool = False) -> int:
        return len(self.tok.encode(text, add_special_tokens=special))

    def _word(self) -> str:
        if self.rng.random() < 0.5:
            return self.rng.choice(self.fillers)
        return "".join(self.rng.choice(string.ascii_lowercase) for _ in range(self.rng.randint(2, 9)))

    def text(self, num_tokens: int, special: bool = False) -> str:
        """Text of exactly `num_tokens` tokens (`special=True`: counting the tokenizer's special
        prefix, such as BOS, as the engine does for the system part of a chunked prompt)."""
        words: list[str] = []
        # Bulk: words until close to the target (a word is 1-5 tokens).
        while (deficit := num_tokens - self.count(" ".join(words), special)) > 8:
            words.extend(self._word() for _ in range(max(1, deficit // 4)))
        while words and self.count(" ".join(words), special) > num_tokens:
            words.pop()
        # Top up one single-token word at a time.
        for _ in range(10 * num_tokens + 100):
            c = self.count(" ".join(words), special)
            if c == num_tokens:
                return " ".join(words)
            if c < num_tokens:
                words.append(self.rng.choice(self.fillers))
            else:
                words.pop()
        raise RuntimeError(f"could not make a text of exactly {num_tokens} tokens")


def passages(tokenizer: object, min_tokens: int) -> list[tuple[str, str]]:
    """(title, text) of the reference documentation's topics, the longest first, each cut to about
    `min_tokens` tokens at a word boundary; shorter topics are left out."""
    from pydoc_data.topics import topics

    out = []
    for title, text in sorted(topics.items(), key=lambda kv: -len(kv[1])):
        ids = tokenizer.encode(" ".join(text.split()), add_special_tokens=False)  # type: ignore[attr-defined]
        if len(ids) >= min_tokens:
            cut = tokenizer.decode(ids[:min_tokens]).rsplit(" ", 1)[0]  # type: ignore[attr-defined]
            out.append((title, cut))
    return out


def summary(name: str, **ratios: str) -> str:
    return f"SUMMARY {name}: " + " ".join(f"{k}={v}" for k, v in ratios.items())
