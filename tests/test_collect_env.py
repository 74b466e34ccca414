"""`chunkcache env` (chunkcache/collect_env.py): the report's facts against their sources (the
installed packages' metadata, /proc/cpuinfo's flags, the kernel library's state, the dtype rule),
in both outputs; a kernel build that fails shows its reason in the report."""

from __future__ import annotations

import importlib.metadata
import json
import platform
from pathlib import Path

import pytest

from chunkcache.cli import main as cli_main
from chunkcache.collect_env import CPU_FEATURES
from chunkcache.model import catalog
from chunkcache.model.kernels import build, qkernel
from chunkcache.model.loader import cpu_auto_dtype
from chunkcache.threads import choose_threads


def _report(capsys, *flags: str) -> str:
    assert cli_main(["env", *flags]) == 0
    return capsys.readouterr().out


def test_the_json_report_holds_what_its_sources_say(capsys, monkeypatch) -> None:
    monkeypatch.delenv("CHUNKCACHE_THREADS", raising=False)
    report = json.loads(_report(capsys, "--json"))
    versions = report["versions"]
    assert versions["python"] == platform.python_version()
    for package in ("torch", "transformers", "gguf", "chunkcache"):
        assert versions[package] == importlib.metadata.version(package)
    flags_line = next(
        (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
    )
    flags = set(flags_line.partition(":")[2].split())
    assert report["cpu"]["features"] == {name: flag in flags for flag, name in CPU_FEATURES.items()}
    state = build.kernels()
    assert (report["kernels"]["kind"], report["kernels"]["reason"]) == (state.kind, state.reason)
    dtype, why = cpu_auto_dtype()
    assert report["dtype_auto"] == {"cpu": str(dtype).removeprefix("torch."), "why": why}
    assert (report["threads"]["engine"], report["threads"]["why"]) == choose_threads(None)
    monkeypatch.setenv("CHUNKCACHE_THREADS", "3")  # the option's variable wins, as in an engine
    threads = json.loads(_report(capsys, "--json"))["threads"]
    assert (threads["engine"], threads["why"]) == (3, "CHUNKCACHE_THREADS=3")
    names = [m["name"] for m in report["models"]["known"]]
    assert names == list(catalog.KNOWN_MODELS)
    for model in report["models"]["known"]:
        path = catalog.candidate_path(catalog.KNOWN_MODELS[model["name"]])
        installed = path is not None and path.is_file()
        assert (model["state"] != "not installed") == installed


def test_the_text_report_says_the_same(capsys) -> None:
    text = _report(capsys)
    report = json.loads(_report(capsys, "--json"))
    assert f"torch: {report['versions']['torch']}" in text
    features = report["cpu"]["features"]
    assert "  features: " + ", ".join(f"{n} {'yes' if v else 'no'}" for n, v in features.items()) in text
    assert f"dtype auto: {report['dtype_auto']['cpu']} on this CPU" in text
    for model in report["models"]["known"]:
        assert f"  {model['name']}: {model['state']}" in text
    kernels = report["kernels"]
    assert (f"kernels: C, built and loaded: {kernels['library']}" in text) == (kernels["kind"] == "c")


def test_a_failed_kernel_build_shows_its_reason(capsys, monkeypatch, tmp_path) -> None:
    reason = build.why_not()
    if reason is not None and "compiler" not in reason:  # the CPU rules the kernels out: no build
        pytest.skip(reason)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("CHUNKCACHE_KERNEL_DIR", str(tmp_path))
    qkernel.cache_clear()
    try:
        text = _report(capsys)
        report = json.loads(_report(capsys, "--json"))
    finally:
        monkeypatch.undo()
        qkernel.cache_clear()
    assert report["kernels"]["kind"] == "torch" and "/nonexistent/cc" in report["kernels"]["reason"]
    assert "kernels: torch's (the C kernels did not build or load: no C compiler (/nonexistent/cc)" in text
