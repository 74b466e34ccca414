"""Building and loading the C kernels (`qkernel*.c` beside this file, see `qkernel` for what they
serve): compiled with the system C compiler (`cc -O3 -mavx2 -mfma -mf16c -fopenmp`: 4.5-5.3 s
wall on a loaded 2-core EPYC, logged) into one shared library, cached by the hash of every source,
header and flag under `envs.kernel_dir()`, loaded with ctypes (its functions' signatures declared
here). Where the CPU has no AVX2, FMA or F16C, or the library does not build or load, `loaded()`
says why and one WARNING names the reason and the cost (`COST`); the engine's `require_kernels`
refuses to start instead (engine/build.py)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from chunkcache import envs
from chunkcache.model.kernels.block_types import BLOCK_FUNCTIONS, TILED

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qkernel.c")
# Compiled together into one library (`SOURCE` first); the header is hashed with them.
EXTRA_SOURCES = tuple(
    Path(__file__).with_name(f"qkernel_{n}.c") for n in ("q6k", "q4k", "q8_0", "q4_1", "bf16", "amx", "row")
)
HEADER = Path(__file__).with_name("qkernel.h")
# Included by one source twice (per dot product instruction), hashed with the sources.
TEMPLATES = (Path(__file__).with_name("qkernel_q4k_q8.h"),)

FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
# What serving without the library costs, in the WARNING at load (benchmarks/history/
# RESULTS-narrative.md, "A float32 AVX2 kernel for decode's quantized products" and the sections on
# GGUF blocks and AMX after it; the current speeds: benchmarks/RESULTS.md "bench_llamacpp").
COST = (
    "served with torch's kernels: decode's quantized products in bfloat16 at 3.5-4.4 GB/s of codes "
    "where the kernel reads ~10 (a 1.5B step's int4 projections 177 ms, not 107), no GGUF blocks "
    "served as they are, no AMX prefill; the speeds of benchmarks/RESULTS.md do not apply"
)
COMPILER_LINES = 12  # the compiler's last lines quoted when the build fails


def why_not() -> str | None:
    """Why the kernel cannot serve on this CPU, or None. (The compiler is needed only where the
    library is not built yet: `_build`; a container image ships it built, without a compiler.)"""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU has no AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "/proc/cpuinfo is unreadable (FMA unknown)"
    if " fma" not in flags or " f16c" not in flags:
        return "the CPU has no FMA or no F16C"
    return None


def _library_path() -> Path:
    """Where the library of the current sources lies once built: the cache directory, by hash."""
    missing = [p.name for p in (SOURCE, *EXTRA_SOURCES, HEADER, *TEMPLATES) if not p.is_file()]
    if missing:  # an install that dropped some of them (pyproject's package data)
        raise OSError(f"the kernel sources {', '.join(missing)} are missing from {SOURCE.parent}")
    text = b"".join(p.read_bytes() for p in (SOURCE, *EXTRA_SOURCES, HEADER, *TEMPLATES))
    digest = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:16]
    return Path(envs.kernel_dir()).expanduser() / f"qkernel-{digest}.so"


def _build(target: Path) -> Path:
    """The shared library for the current source, compiled once into the cache directory (under
    a temporary name, renamed into place, so concurrent first uses never load half a file)."""
    if target.exists():
        return target
    sources = [SOURCE, *EXTRA_SOURCES]
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [envs.c_compiler(), *FLAGS, f"-I{HEADER.parent}", *map(str, sources), "-o", str(built)],
            check=True,
            capture_output=True,
        )
        os.replace(built, target)
    logger.info("quantized products: built %s in %.1f s", target, time.perf_counter() - start)
    return target


@functools.cache
def loaded() -> tuple[ctypes.CDLL | None, str | None]:
    """The built library, or None and why not: then one WARNING (per process) names the reason,
    with the compiler's last lines where it failed, and what serving without it costs."""
    lib, reason = _load()
    if reason is not None:
        logger.warning("C kernels unavailable: %s; %s", reason, COST)
    return lib, reason


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    reason = why_not()
    if reason is not None:
        return None, reason
    try:
        target = _library_path()
        if not target.exists() and shutil.which(envs.c_compiler()) is None:
            return (
                None,
                f"no C compiler ({envs.c_compiler()}) on PATH, and no {target.name} built in {target.parent}",
            )
        lib = ctypes.CDLL(str(_build(target)))
    except subprocess.CalledProcessError as e:
        lines = e.stderr.decode(errors="replace").strip().splitlines()[-COMPILER_LINES:]
        return (
            None,
            f"building {SOURCE.name} failed ({envs.c_compiler()} exit {e.returncode}):\n" + "\n".join(lines),
        )
    except OSError as e:
        return None, f"building or loading {SOURCE.name} failed: {e}"
    p, i = ctypes.c_void_p, ctypes.c_int
    block_product, block_dequantize = [p, i, i, i, p, p, i, i], [p, i, i, p, i, i]
    for name, argtypes in (
        ("int4_product", [p, i, i, i, p, p, p, p, i, i]),
        ("int8_product", [p, i, i, i, p, p, p, i, i]),
        ("int4_dequantize", [p, p, p, i, i, i, p, i]),
        ("int4_dequantize_bf16", [p, p, i, i, i, i, p, i]),
        ("q4_1_product_isa", [p, i, i, i, p, p, i]),
        ("blocks_product_rows", [i, p, i, i, i, p, p, i, i, p, i, i]),
        ("row_rms_norm", [p, i, i, p, ctypes.c_float, p, i]),
        ("row_attend", [p, p, p, i, i, i, p, p, p, i, ctypes.c_float, p, i]),
        *((tile, [p, i, i, p]) for tile in TILED.values()),
        *((product, block_product) for product, _ in BLOCK_FUNCTIONS.values()),
        *((dequantize, block_dequantize) for _, dequantize in BLOCK_FUNCTIONS.values()),
    ):
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, None
    lib.omp_team.argtypes, lib.omp_team.restype = [i], i
    lib.omp_default_threads.argtypes, lib.omp_default_threads.restype = [], i
    if hasattr(lib, "amx_ready"):  # where the compiler has AMX's intrinsics (qkernel.h's HAS_AMX)
        for name, argtypes in (
            ("amx_pack_x", [p, i, i, p]),
            ("amx_product", [p, i, i, p, i, p, i, i]),
            ("amx_blocks_product", [i, p, i, i, p, i, i, p, i, i]),
        ):
            getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, None
        lib.amx_ready.argtypes, lib.amx_ready.restype = [], ctypes.c_int
    return lib, None


def openmp_threads() -> tuple[int, int] | None:
    """(the team the kernels' OpenMP regions get, called as every call here calls them, with
    torch's count; the library's OpenMP default), None where the library does not build. Both are
    torch's count: the kernels are passed it, and share torch's OpenMP runtime where torch ships
    its own libgomp.so.1 (the loader resolves the kernels' libgomp.so.1 to the one loaded)."""
    lib = loaded()[0]
    if lib is None:
        return None
    return lib.omp_team(torch.get_num_threads()), lib.omp_default_threads()


@dataclass(frozen=True)
class Kernels:
    """Which kernels serve the quantized products in this process: "c" (this module's library,
    built and loaded; what parts of it serve depends on the CPU and torch's packing) or "torch"."""

    kind: str
    reason: str | None  # why not "c"
    library: str | None  # the loaded library's file


def kernels() -> Kernels:
    """The library's state (building it at first call): what the engine logs and exports at load,
    `--require-kernels` checks and `chunkcache env` reports."""
    lib, reason = loaded()
    if lib is None:
        return Kernels("torch", reason, None)
    return Kernels("c", None, lib._name)
