"""Engine option `threads` (flag --threads, env CHUNKCACHE_THREADS)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

import pytest
import torch

from chunkcache import LLM
from chunkcache.config import EngineConfig
from chunkcache.engine_args import add_engine_arguments, engine_options
from chunkcache.envs import env_options
from chunkcache.threads import physical_cores, set_threads


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_physical_cores_is_within_the_usable_cpus() -> None:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert 1 <= physical_cores() <= (usable or 1)


def test_threads_option_from_flag_env_and_config() -> None:
    parser = add_engine_arguments(argparse.ArgumentParser())
    assert engine_options(parser.parse_args(["--threads", "3"])) == {"threads": 3}
    assert env_options({"CHUNKCACHE_THREADS": "2"}) == {"threads": 2}
    with pytest.raises(ValueError, match="CHUNKCACHE_THREADS='many' is invalid"):
        env_options({"CHUNKCACHE_THREADS": "many"})
    assert EngineConfig.from_options("m", use_env=False, threads=4).threads == 4
    with pytest.raises(ValueError, match="threads must be > 0"):
        EngineConfig.from_options("m", use_env=False, threads=0)


def test_set_threads(restore_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert set_threads(1) == 1 and torch.get_num_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert set_threads(None) == physical_cores() == torch.get_num_threads()
    # OMP_NUM_THREADS set: torch applied it at start-up, and the default leaves torch's value be.
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert set_threads(None) == 1 and torch.get_num_threads() == 1


def test_engine_applies_threads(checkpoint, restore_threads: None) -> None:
    torch.set_num_threads(2)
    LLM(str(checkpoint()), device="cpu", dtype="float32", kv_cache_tokens=256, threads=1)
    assert torch.get_num_threads() == 1
