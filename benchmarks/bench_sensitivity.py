"""What the stored-sensitivity selector costs when the documents are new (cold TTFT).

`blend_selector="stored_deviation"` ranks the document tokens by a score each chunk entry measures
once, the first time a request ranks by it: one extra pass of the entry's S, a fixed passage P
and the document (chunkcache/engine/sensitivity.py). Warm requests pay nothing for it
(bench_fidelity measures those); the request that first sees a document pays it on top of
computing the document. This measures that, on the real default model and bench_fidelity's
documents: per question, its documents are evicted from the chunk pool, then one request per
mode computes them cold; modes interleaved, order rotated per question.

Modes: a full prefill of the same tokens (prefix cache off, so nothing is reused), the default
blend (k_deviation at layer 1, 15%), and the stored selector chosen before layer 0 at 15% and
30%. Reported: median cold TTFT (wall and CPU time) and each mode's ratio against full prefill
and against the default blend.

    python benchmarks/bench_sensitivity.py --threads 1 [--questions 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import bench_fidelity
import fidelity_set
from tqdm import tqdm

from chunkcache import LLM, SamplingParams
from chunkcache.chunk.parse import parse_chunked_prompt

MODES: dict[str, dict[str, Any] | None] = {
    "full": None,
    "blend@0.15": bench_fidelity.MODES["blend@0.15"],
    "stored@0.15/L0": bench_fidelity.MODES["stored@0.15/L0"],
    "stored@0.3/L0": bench_fidelity.MODES["stored@0.3/L0"],
}
ONE = SamplingParams(temperature=0, max_tokens=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--questions", type=int, default=12, help="tune questions, from the first")
    args = parser.parse_args(argv)
    from chunkcache.model.loader import model_path

    llm = LLM(str(model_path("smollm2")), dtype="float32", threads=args.threads, enable_prefix_caching=False)
    elements = fidelity_set.load_elements()
    questions = [q for q in fidelity_set.load() if q.split == "tune"][: args.questions]
    names = list(MODES)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for i, q in enumerate(tqdm(questions, desc="questions", unit="q")):
        text = bench_fidelity.render(llm.tokenizer, [elements[n].document() for n in q.doc_ids], q.question)
        parsed = parse_chunked_prompt(text, bench_fidelity.SEP, llm.tokenizer, add_special_tokens=False)
        assert parsed is not None
        for name in names[i % len(names) :] + names[: i % len(names)]:
            options = MODES[name]
            llm.engine.reset_chunk_cache()  # cold: S and every document computed by this request
            wall, cpu = time.perf_counter(), time.process_time()
            prompt = parsed.all_token_ids() if options is None else text
            llm.generate([prompt], ONE, add_special_tokens=False, chunk_options=options)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    med = {
        n: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for n, t in times.items()
    }
    print(f"{len(questions)} questions, cold TTFT (median), one request per mode per question")
    print(f"{'mode':<16}{'wall ms':>9}{'cpu ms':>9}{'full/x wall':>13}{'full/x cpu':>12}{'vs blend cpu':>14}")
    for name in names:
        wall, cpu = med[name]
        print(
            f"{name:<16}{wall * 1e3:>9.0f}{cpu * 1e3:>9.0f}{med['full'][0] / wall:>13.2f}"
            f"{med['full'][1] / cpu:>12.2f}{cpu / med['blend@0.15'][1]:>14.2f}"
        )
    ratios = " ".join(f"{n}={med['full'][1] / med[n][1]:.2f}x" for n in names[1:])
    extra = med["stored@0.3/L0"][1] / med["blend@0.15"][1]
    print(
        f"SUMMARY bench_sensitivity n={len(questions)} cold cpu speedup over full: {ratios} | "
        f"stored@0.3/L0 costs {extra:.2f}x blend@0.15 cold"
    )


if __name__ == "__main__":
    sys.exit(main())
