"""Shared pytest fixtures: tiny random checkpoints built on demand, once per session."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Before anything imports `tokenizers`: its thread pool and forked test helpers do not mix.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# `pytest` run from the repo root does not put the root on sys.path (only this tests/ folder,
# for `import oracle`); make `import chunkcache` work without installing the package.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tiny_checkpoint import build_checkpoint  # noqa: E402


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
