"""llama.cpp's own server (`llama-server`), built once from the llama.cpp that llama-cpp-python vendors.

bench_serve's peer side. The source is the sdist of the llama-cpp-python version pinned by
pyproject's `peer` extra (`pip download --no-binary :all:`), so that the server is the llama.cpp
bench_llamacpp measures through Python; it is configured and built with cmake into
`~/.cache/chunkcache/llama-server/` (the `llama-server` target only, ~10-15 minutes on 2 cores).

On a CPU with AMX, llama.cpp's native build (`GGML_NATIVE=ON`, its AMX path) died at its first
prompt (history/RESULTS-narrative.md, "Native weights on a CPU with AMX"): there it is built with
its AVX512 kernels named one by one, as bench_llamacpp's peer was; elsewhere natively.

    python benchmarks/llama_server.py      # build it (if absent) and print its path
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"  # pyproject's `peer` extra pins this version
CACHE = Path.home() / ".cache" / "chunkcache" / "llama-server"
# The AVX512 kernels without AMX: the best build that ran on the AMX Xeon (RESULTS.md).
AVX512_FLAGS = (
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
    "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
    "-DGGML_AVX_VNNI=ON",
)  # fmt: skip
COMMON_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF",
)  # fmt: skip


def cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llama_cpp_source(cache: Path = CACHE, version: str = LLAMA_CPP_PYTHON) -> Path:
    """llama.cpp's tree from the llama-cpp-python sdist of `version`, downloaded once."""
    root = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (root / "CMakeLists.txt").exists():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"llama_cpp_python-{version}.tar.gz"
    if not archive.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", str(cache)],
            check=True,
        )  # fmt: skip
    shutil.unpack_archive(archive, cache)
    return root


def llama_server_binary(cache: Path = CACHE, version: str = LLAMA_CPP_PYTHON, jobs: int = 2) -> Path:
    """The path of `llama-server`, built first if it is not there yet."""
    flavor = "avx512" if cpu_has_amx() else "native"
    build = cache / f"build-{version}-{flavor}"
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    if shutil.which("cmake") is None:
        raise SystemExit(
            "building llama-server needs cmake (apt-get install -y cmake), or pass --llama-server PATH"
        )
    source = llama_cpp_source(cache, version)
    flags = AVX512_FLAGS if flavor == "avx512" else ("-DGGML_NATIVE=ON",)
    print(
        f"building llama-server from llama-cpp-python {version}'s llama.cpp ({flavor} kernels) into "
        f"{build}: once, ~10-15 minutes on 2 cores (--llama-server PATH uses an existing one)",
        flush=True,
    )
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *COMMON_FLAGS, *flags], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], check=True)
    if not binary.exists():
        raise SystemExit(f"the build finished without {binary}")
    return binary


if __name__ == "__main__":
    print(llama_server_binary())
