"""Where a chunkcache process's resident memory goes, stage by stage (issue 38's memory target).

Prints VmRSS (anonymous and file-backed) and the peak (VmHWM) after: the interpreter; torch;
transformers; the server's imports; the engine built (`LLM(model, dtype float32, weights
native, kv_cache_memory_gb)`: tokenizer, weights, KV blocks, chunk pool); one RAG request (four
300-token documents, 8 greedy tokens). One process per model; run it on two commits to compare.
After the engine is built, the bytes its model holds (every distinct storage of its modules'
parameters, buffers, tensor attributes and quantized parts) beside the GGUF file's size.

    OMP_NUM_THREADS=1 python benchmarks/memory_stages.py smollm2 [KV_GB] [--dtype auto]
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


def held_bytes(model) -> int:
    """Bytes of the distinct storages `model`'s modules hold: parameters, buffers, tensor attributes
    (tuples of them too) and the quantized parts' tensors (`QuantProduct.parts`)."""
    import torch

    storages: dict[int, int] = {}

    def add(t: object) -> None:
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        elif isinstance(t, tuple | list):
            for item in t:
                add(item)

    for module in model.modules():
        add([*module.parameters(recurse=False), *module.buffers(recurse=False)])
        for value in vars(module).values():
            add(value)
            for part in getattr(value, "parts", ()):
                add(part.tensors())
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("kv_gb", nargs="?", type=float, default=0.5)
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (served: auto)")
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
    from chunkcache.model.loader import model_path
    from chunkcache.sampling import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, weights="native", kv_cache_memory_gb=args.kv_gb)
    report("engine built")
    held, file = held_bytes(llm.engine.runner.model) / 1e9, Path(model_path(args.model)).stat().st_size / 1e9
    print(f"{'model holds':<22} {held:.3f} GB: {held / file:.3f}x the {file:.3f} GB file", flush=True)
    parts = (
        ["You answer."]
        + [f"Document {i}: " + "word " * 300 for i in range(4)]
        + ["What is document 2 about?"]
    )
    llm.generate(" # # ".join(parts), SamplingParams(max_tokens=8, temperature=0))
    report("after a RAG request")


if __name__ == "__main__":
    main()
