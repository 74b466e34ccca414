"""Where a chunkcache process's resident memory goes, stage by stage (issue 38's memory target).

Prints VmRSS (anonymous and file-backed) and the peak (VmHWM) after: the interpreter; torch;
transformers; the server's imports; the engine built (`LLM(model, dtype float32, weights
native, kv_cache_memory_gb)`: tokenizer, weights, KV blocks, chunk pool); one RAG request (four
300-token documents, 8 greedy tokens). One process per model; run it on two commits to compare.

    OMP_NUM_THREADS=1 python benchmarks/memory_stages.py smollm2 [KV_GB]
    OMP_NUM_THREADS=1 python benchmarks/memory_stages.py qwen2.5-coder-1.5b 0.5
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path


def _field(text: str, name: str) -> float:
    match = re.search(rf"^{name}:\s+(\d+)", text, re.M)
    assert match is not None, name
    return int(match.group(1)) / 1e6  # kB -> GB


def report(stage: str) -> None:
    status = Path("/proc/self/status").read_text()
    anon = _field(Path("/proc/self/smaps_rollup").read_text(), "Anonymous")
    rss, file, peak = (_field(status, k) for k in ("VmRSS", "RssFile", "VmHWM"))
    print(f"{stage:<22} RSS {rss:.3f} GB (anon {anon:.3f}, file {file:.3f}) peak {peak:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("kv_gb", nargs="?", type=float, default=0.5)
    args = parser.parse_args()
    report("start")
    for module, stage in (
        ("torch", "torch"),
        ("transformers", "transformers"),
        ("chunkcache.server.app", "server imports"),
    ):
        importlib.import_module(module)
        report(stage)
    from chunkcache.llm import LLM
    from chunkcache.sampling import SamplingParams

    llm = LLM(args.model, dtype="float32", weights="native", kv_cache_memory_gb=args.kv_gb)
    report("engine built")
    parts = (
        ["You answer."]
        + [f"Document {i}: " + "word " * 300 for i in range(4)]
        + ["What is document 2 about?"]
    )
    llm.generate(" # # ".join(parts), SamplingParams(max_tokens=8, temperature=0))
    report("after a RAG request")


if __name__ == "__main__":
    main()
