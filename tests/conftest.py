"""Shared pytest fixtures: tiny random checkpoints built on demand, once per session; the fixtures of
tests/support (a Redis server, the tiny served model); the markers that sort the tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# tests/ is a package, so pytest puts the repository root on sys.path: `chunkcache` is this
# checkout's and the helpers import as `tests.support.*`.
from tests.support.tiny_checkpoint import build_checkpoint

# Before anything imports `tokenizers`: its thread pool and forked test helpers do not mix.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Fixtures every module may ask for by name: `redis_server` (a real redis-server, skipped without
# one) and the tiny served model of the server tests (`model_dir`, `server`, `client`, `reference`).
pytest_plugins = ["tests.support.redis_server", "tests.support.tiny_server"]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory `checkpoint(arch="llama", rope="default", **kw) -> Path`.

    Arguments are those of `tiny_checkpoint.build_checkpoint`. Each distinct set of
    arguments is built once per test session (a tiny checkpoint takes well under a second) and
    shared by every test that asks for it; treat the directory as read-only.
    """
    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, Path] = {}

    def make(arch: str = "llama", rope: str = "default", **kw: Any) -> Path:
        items = sorted({"arch": arch, "rope": rope, **kw}.items())
        key = repr(items)  # repr, not the tuple itself: override values need not be hashable
        if key not in built:
            name = f"{len(built):03d}-" + "-".join(f"{k}={v}" for k, v in items)
            name = "".join(c if c.isalnum() or c in "-=._" else "_" for c in name)[:120]
            built[key] = build_checkpoint(root / name, arch=arch, rope=rope, **kw)
        return built[key]

    return make


# Fixtures (this suite's names, shared and per module) that start an HTTP server.
_SERVER_FIXTURES = frozenset({"server", "client", "proc", "inproc"})
# Fixtures that build a checkpoint or a model: a test asking for one is slow.
_MODEL_FIXTURES = frozenset({"checkpoint", "model_dir", "reference"})
_SLOW_MARKERS = ("server", "redis", "large_model")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks that follow from a test's fixtures (their closure: a fixture's own fixtures count):
    `server` and `redis` where one is started, and `slow` for everything that builds a model or a
    process. Tests that start one inline carry the marker themselves."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & _SERVER_FIXTURES:
            item.add_marker(pytest.mark.server)
        if "redis_server" in names:
            item.add_marker(pytest.mark.redis)
        if names & _MODEL_FIXTURES or any(item.get_closest_marker(m) for m in _SLOW_MARKERS):
            item.add_marker(pytest.mark.slow)


_REPORTED_MARKERS = ("slow", "server", "redis", "large_model")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How many tests ran, were skipped or failed per marker (scripts/test.sh): a marker whose
    tests all skip (no Redis, no SmolLM2) shows here instead of hiding in a green total."""
    counts: dict[str, dict[str, int]] = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "when", "call") not in ("call", "setup") or not hasattr(report, "keywords"):
                continue
            if outcome == "passed" and report.when != "call":
                continue
            marks = [m for m in _REPORTED_MARKERS if m in report.keywords] or ["unmarked"]
            for mark in marks:
                counts.setdefault(mark, {}).setdefault(outcome, 0)
                counts[mark][outcome] += 1
    if counts:
        terminalreporter.write_sep("-", "tests per marker")
        for mark in (*_REPORTED_MARKERS, "unmarked"):
            if mark in counts:
                line = ", ".join(f"{n} {outcome}" for outcome, n in counts[mark].items())
                terminalreporter.write_line(f"{mark}: {line}")
