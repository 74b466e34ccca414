"""`chunkcache env`: what a bug report needs about this machine and this install (as vLLM's
`collect-env`): versions, the CPU and its vector and matrix units, whether the C kernels built (or
why not), what `--dtype auto` and `--weights auto` choose here and why, threads, and the known
models installed with their verification state.

The same machine served with and without the kernels, or in bfloat16 and float32, differs by
1.5-5x in speed and in the last bits of every reply (benchmarks/RESULTS.md): a report without these
lines cannot be reproduced. Building the kernels takes a few seconds the first time (cached).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any

from chunkcache import envs

# /proc/cpuinfo flag -> the unit's usual name. What each serves: AVX2 + FMA + F16C the C kernels at
# all; AVX-512 torch's int4 packing in tiles of 64 rows; AVX512-BF16 / AMX-BF16 `--dtype auto`'s
# bfloat16; AMX-TILE the AMX prefill blocks; the VNNI units llama.cpp's int8 dot products.
CPU_FEATURES = {
    "avx2": "AVX2",
    "fma": "FMA",
    "f16c": "F16C",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX512-BF16",
    "avx512_vnni": "AVX512-VNNI",
    "avx_vnni": "AVX-VNNI",
    "amx_tile": "AMX-TILE",
    "amx_bf16": "AMX-BF16",
    "amx_int8": "AMX-INT8",
}
PACKAGES = ("chunkcache", "torch", "transformers", "gguf", "tokenizers", "numpy")
WEIGHTS_AUTO = (
    "a GGUF on a CPU: per projection kind and GGUF type, native (the file's own codes) unless dense "
    "measures over 1.1x as fast at both 1 and 128 rows, timed at load; anything else: dense"
)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu(cpuinfo: str) -> dict[str, Any]:
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
        None,
    )
    flags_line = next((line for line in cpuinfo.splitlines() if line.startswith(("flags", "Features"))), "")
    flags = set(flags_line.split(":", 1)[1].split()) if ":" in flags_line else set()
    import torch

    from chunkcache.threads import physical_cores

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": model or platform.processor() or None,
        "machine": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "physical_cores": physical_cores(),
        "features": {name: flag in flags for flag, name in CPU_FEATURES.items()},
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _kernels() -> dict[str, Any]:
    from chunkcache.model.kernels import build, qkernel

    state = build.kernels()
    return {
        "kind": state.kind,
        "reason": state.reason,
        "library": state.library,
        "directory": str(Path(envs.kernel_dir()).expanduser()),
        "compiler": envs.c_compiler(),
        "serves": {
            "decode int4/int8 products": qkernel.available(),
            "GGUF blocks as they are": qkernel.blocks_available(),
            "prefill int4 blocks in bfloat16": qkernel.bf16_blocks(),
            "AMX prefill": qkernel.amx(),
        },
    }


def _models() -> dict[str, Any]:
    from chunkcache.model import catalog, fetch

    known = []
    for model in catalog.KNOWN_MODELS.values():
        path = catalog.candidate_path(model)
        if path is None or not path.is_file():
            state = "not installed"
        elif model.source is catalog.Source.PART_PACKAGES:
            state = "verified (sha256)" if fetch.is_verified(model, path) else "present, not verified"
        else:  # a package's file: its size and header, as `catalog.identify` knows it
            state = "verified (size, header)" if catalog.identify(str(path)) is model else "present, differs"
        known.append({"name": model.name, "path": str(path) if path is not None else None, "state": state})
    return {"directory": str(catalog.model_folder()), "default": catalog.DEFAULT_MODEL, "known": known}


def collect() -> dict[str, Any]:
    """The report as one JSON-ready dict (`chunkcache env --json`)."""
    import torch

    from chunkcache.model.loader import cpu_auto_dtype
    from chunkcache.threads import choose_threads, default_threads

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    dtype, why = cpu_auto_dtype()
    option = envs.env_options().get("threads")  # CHUNKCACHE_THREADS, the option's variable
    threads, threads_why = choose_threads(option)
    if option is not None:
        threads_why = f"CHUNKCACHE_THREADS={option}"
    return {
        "versions": {"python": platform.python_version(), **{p: _version(p) for p in PACKAGES}},
        "platform": platform.platform(),
        "cpu": _cpu(cpuinfo),
        "kernels": _kernels(),
        "dtype_auto": {"cpu": str(dtype).removeprefix("torch."), "why": why},
        "weights_auto": WEIGHTS_AUTO,
        # What an engine without --threads would use here (threads.choose_threads: the same rule).
        "threads": {
            "engine": threads,
            "why": threads_why,
            "without_environment": default_threads()[0],
            "torch_now": torch.get_num_threads(),
        },
        "models": _models(),
    }


def format_text(report: dict[str, Any]) -> str:
    """The report as lines for a terminal or an issue."""
    lines = ["versions:"]
    lines += [f"  {name}: {version or 'not installed'}" for name, version in report["versions"].items()]
    cpu = report["cpu"]
    lines += [
        f"platform: {report['platform']}",
        f"cpu: {cpu['model']} ({cpu['machine']}), {cpu['physical_cores']} physical cores, "
        f"{cpu['usable_cpus']} of {cpu['logical_cpus']} logical CPUs usable; torch's capability {cpu['torch_capability']}",
        "  features: "
        + ", ".join(f"{name} {'yes' if has else 'no'}" for name, has in cpu["features"].items()),
    ]
    kernels = report["kernels"]
    if kernels["kind"] == "c":
        lines.append(f"kernels: C, built and loaded: {kernels['library']}")
    else:
        lines.append(f"kernels: torch's (the C kernels did not build or load: {kernels['reason']})")
    lines.append(f"  compiler {kernels['compiler']}, cache {kernels['directory']}")
    lines.append(
        "  serving: " + ", ".join(f"{part} {'yes' if on else 'no'}" for part, on in kernels["serves"].items())
    )
    lines += [
        f"dtype auto: {report['dtype_auto']['cpu']} on this CPU ({report['dtype_auto']['why']})",
        f"weights auto: {report['weights_auto']}",
    ]
    threads = report["threads"]
    lines.append(
        f"threads: an engine without --threads uses {threads['engine']} ({threads['why']}); "
        f"{threads['without_environment']} without OMP_NUM_THREADS / CHUNKCACHE_THREADS"
    )
    models = report["models"]
    lines.append(f"models: {models['directory']} (default {models['default']})")
    lines += [f"  {m['name']}: {m['state']}{': ' + m['path'] if m['path'] else ''}" for m in models["known"]]
    return "\n".join(lines)


def command(as_json: bool, require_kernels: bool = False) -> int:
    """Print the report; with `require_kernels`, then fail (exit 2, the reason on one line) where
    the C kernels did not build or load: the container image's build step (Dockerfile)."""
    report = collect()
    print(json.dumps(report, indent=2) if as_json else format_text(report), flush=True)
    if require_kernels and report["kernels"]["kind"] != "c":
        from chunkcache.errors import KernelsUnavailableError

        raise KernelsUnavailableError(f"the C kernels are unavailable: {report['kernels']['reason']}")
    return 0
