"""Engine option `threads` (flag --threads, env CHUNKCACHE_THREADS)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from chunkcache import LLM
from chunkcache.config import EngineConfig
from chunkcache.engine_args import add_engine_arguments, engine_options
from chunkcache.envs import env_options
from chunkcache.model.kernels import build, qkernel
from chunkcache.threads import (
    cgroup_cpu_limit,
    choose_threads,
    default_threads,
    physical_cores,
    set_threads,
)


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
    assert set_threads(None) == default_threads()[0] == torch.get_num_threads()
    # OMP_NUM_THREADS set: torch applied it at start-up, and the default leaves torch's value be.
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert set_threads(None) == 1 and torch.get_num_threads() == 1


def test_engine_applies_threads(checkpoint, restore_threads: None) -> None:
    torch.set_num_threads(2)
    LLM(str(checkpoint()), device="cpu", dtype="float32", kv_cache_tokens=256, threads=1)
    assert torch.get_num_threads() == 1


# --- the default: CPU affinity and cgroup quota, read from fake /proc and /sys trees ---------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _cpus(root: Path, monkeypatch: pytest.MonkeyPatch, core_ids: list[int]) -> None:
    """The process may run on CPUs 0..len(core_ids)-1, CPU i on physical core core_ids[i]."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(len(core_ids))), raising=False)
    for cpu, core in enumerate(core_ids):
        topology = f"sys/devices/system/cpu/cpu{cpu}/topology"
        _tree(root, {f"{topology}/physical_package_id": "0\n", f"{topology}/core_id": f"{core}\n"})


MOUNT_V2 = "30 23 0:26 {root} /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
MOUNT_V1 = "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"


def test_hyper_threads_count_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cpus(tmp_path, monkeypatch, [0, 1, 0, 1])  # 2 cores, 2 hyper-threads each
    assert physical_cores(tmp_path) == 2
    assert default_threads(tmp_path) == (2, "2 physical cores in the CPU affinity, no cgroup CPU quota")


def test_cgroup_v2_quota_caps_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container (cgroup namespace: its cgroup is "/") limited to 2.5 CPUs on 4 cores: 2 threads."""
    _cpus(tmp_path, monkeypatch, [0, 1, 2, 3])
    _tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/\n",
            "proc/self/mountinfo": MOUNT_V2.format(root="/"),
            "sys/fs/cgroup/cpu.max": "250000 100000\n",
        },
    )
    assert cgroup_cpu_limit(tmp_path) == 2.5
    assert default_threads(tmp_path) == (
        2,
        "4 physical cores in the CPU affinity, cgroup CPU quota 2.5 CPUs",
    )
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None and default_threads(tmp_path)[0] == 4
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert cgroup_cpu_limit(tmp_path) == 0.5 and default_threads(tmp_path)[0] == 1
    (tmp_path / "sys/fs/cgroup/cpu.max").write_text("800000 100000\n")  # above the cores: the cores
    assert default_threads(tmp_path)[0] == 4


def test_cgroup_v2_a_parents_quota_binds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen from the host (no cgroup namespace): the process's cgroup is a path below the mount, and
    the pod's quota, one level up, binds although the container's own is "max"."""
    _cpus(tmp_path, monkeypatch, [0, 1, 2, 3, 4, 5, 6, 7])
    pod = "sys/fs/cgroup/kubepods.slice/pod1"
    _tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/kubepods.slice/pod1/ctr\n",
            "proc/self/mountinfo": MOUNT_V2.format(root="/"),
            "sys/fs/cgroup/cpu.max": "max 100000\n",  # the root cgroup has none; never a limit
            f"{pod}/cpu.max": "300000 100000\n",
            f"{pod}/ctr/cpu.max": "max 100000\n",
        },
    )
    assert cgroup_cpu_limit(tmp_path) == 3.0 and default_threads(tmp_path)[0] == 3
    (tmp_path / f"{pod}/ctr/cpu.max").write_text("200000 100000\n")  # the lower of the two
    assert cgroup_cpu_limit(tmp_path) == 2.0


def test_cgroup_v1_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cgroup v1 (a hybrid host: the unified hierarchy mounted too, without the cpu controller):
    a Docker container's cpu controller mounted at its own cgroup (mountinfo's root field)."""
    _cpus(tmp_path, monkeypatch, [0, 1, 2, 3])
    cpu = "sys/fs/cgroup/cpu,cpuacct"
    _tree(
        tmp_path,
        {
            "proc/self/cgroup": "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n",
            "proc/self/mountinfo": MOUNT_V1.format(root="/docker/abc")
            + MOUNT_V2.format(root="/docker/abc").replace("/sys/fs/cgroup ", "/sys/fs/cgroup/unified "),
            f"{cpu}/cpu.cfs_quota_us": "150000\n",
            f"{cpu}/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpu_limit(tmp_path) == 1.5 and default_threads(tmp_path)[0] == 1
    (tmp_path / f"{cpu}/cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path) is None and default_threads(tmp_path)[0] == 4


def test_without_mountinfo_the_usual_mount_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _cpus(tmp_path, monkeypatch, [0, 1])
    _tree(tmp_path, {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "100000 100000\n"})
    assert cgroup_cpu_limit(tmp_path) == 1.0 and default_threads(tmp_path)[0] == 1
    _tree(tmp_path, {"proc/self/cgroup": "garbage\n"})  # no line of ours: no quota known
    assert cgroup_cpu_limit(tmp_path) is None


def test_this_machine() -> None:
    limit = cgroup_cpu_limit()
    assert limit is None or limit > 0
    threads, why = default_threads()
    assert 1 <= threads <= physical_cores() and "physical cores" in why


def test_choose_threads_says_why(
    tmp_path: Path, restore_threads: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert choose_threads(3, tmp_path) == (3, "the threads option")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    assert choose_threads(None, tmp_path) == (1, "OMP_NUM_THREADS=1")
    monkeypatch.delenv("OMP_NUM_THREADS")
    with caplog.at_level(logging.INFO, logger="chunkcache.threads"):
        n = set_threads(None)
    assert [r.getMessage() for r in caplog.records] == [f"threads: {n} ({default_threads()[1]})"]


# --- the C kernels' OpenMP: the same count as torch's ---------------------------------------------


def test_every_kernel_region_takes_the_count_it_is_passed() -> None:
    """A region without `num_threads(threads)` would take its OpenMP runtime's default (every CPU
    where torch's runtime is not the kernels'), whatever the engine's `threads`."""
    sources = sorted(Path(qkernel.__file__).parent.glob("qkernel*.[ch]"))
    regions = [
        (source.name, line)
        for source in sources
        for line in source.read_text().splitlines()
        if re.match(r"\s*#\s*pragma\s+omp\s+parallel\b", line)
    ]
    assert len(regions) > 10
    assert [r for r in regions if "num_threads(threads)" not in r[1]] == []


@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_use_torchs_count(threads: int, restore_threads: None) -> None:
    if build.openmp_threads() is None:
        pytest.skip("the C kernels do not build here")
    set_threads(threads)
    assert torch.get_num_threads() == threads
    assert build.openmp_threads() == (threads, threads)
    # In another thread (the server's engine thread): torch applies its count there on first use.
    seen: list[tuple[int, int] | None] = []
    worker = threading.Thread(target=lambda: seen.append(build.openmp_threads()))
    worker.start()
    worker.join()
    assert seen == [(threads, threads)]
