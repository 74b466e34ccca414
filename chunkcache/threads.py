"""How many threads torch's CPU kernels and the C kernels' OpenMP regions use (engine option `threads`).

The default is one thread per physical core this process may run on (its CPU affinity), capped by
its cgroup's CPU quota: a second hyper-thread on a core adds little to matmuls and makes oneDNN's
threads wait on each other, and a container limited to 2 CPUs of a 64-core host that starts 64
threads gets throttled every CFS period, each parallel kernel then running at the pace of its
slowest (descheduled) thread. Where other work shares the cores, fewer threads (often 1) is faster
still (docs/operations.md, "Memory and threads").

The C kernels (model/kernels/qkernel*.c) are passed torch's count at every call (`num_threads(threads)` on
each OpenMP region), so one `set_threads` sets both.

The file-reading functions take `root` (default "/") so tests can feed them a fake /proc and /sys.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from chunkcache import envs

logger = logging.getLogger(__name__)

ROOT = Path("/")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def physical_cores(root: Path = ROOT) -> int:
    """Physical cores among the CPUs this process may use (Linux topology files; elsewhere the
    logical CPU count, halved by psutil's physical count where psutil is installed)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topology = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        package, core = _read(topology / "physical_package_id"), _read(topology / "core_id")
        if package is None or core is None:
            cores.clear()
            break
        cores.add((package.strip(), core.strip()))
    if cores:
        return len(cores)
    logical = len(cpus) or os.cpu_count() or 1
    try:
        import psutil

        per_core = max(1, (psutil.cpu_count(logical=True) or 1) // (psutil.cpu_count(logical=False) or 1))
    except ImportError:
        per_core = 1
    return max(1, logical // per_core)


def _own_cgroups(root: Path) -> dict[str, str]:
    """This process's cgroup paths from /proc/self/cgroup: "cpu" for cgroup v1's cpu controller,
    "" for the v2 (unified) hierarchy, which holds the cpu controller on a v2-only host."""
    found: dict[str, str] = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if parts[0] == "0" and controllers == "":
            found[""] = path
        elif "cpu" in controllers.split(","):
            found["cpu"] = path
    return found


# Where /proc/self/mountinfo is unreadable: the usual mount points, each mounted at the hierarchy's root.
_USUAL_MOUNTS = [("cpu", "/", "/sys/fs/cgroup/cpu"), ("", "/", "/sys/fs/cgroup")]


def _cgroup_mounts(root: Path) -> list[tuple[str, str, str]]:
    """(hierarchy key as in `_own_cgroups`, mount root, mount point) of the cgroup file systems
    mounted: the mount root is the cgroup the mount shows (a container's own, with cgroup namespaces
    not in use), so a process's cgroup path is found below the mount point relative to it."""
    text = _read(root / "proc/self/mountinfo")
    if text is None:
        return _USUAL_MOUNTS
    mounts = []
    for line in text.splitlines():
        head, _, tail = (part.split() for part in line.partition(" - "))
        if len(head) < 5 or len(tail) < 3:
            continue
        mount_root, point, fstype, options = head[3], head[4], tail[0], tail[2]
        if fstype == "cgroup2":
            mounts.append(("", mount_root, point))
        elif fstype == "cgroup" and "cpu" in options.split(","):
            mounts.append(("cpu", mount_root, point))
    return mounts


def _quota_in(directory: Path, key: str) -> float | None:
    """The CPUs one cgroup directory's quota allows (quota / period), None where unlimited or absent:
    cgroup v2's cpu.max ("max 100000" or "200000 100000"), v1's cpu.cfs_quota_us (-1: unlimited)."""
    if key == "":
        fields = (_read(directory / "cpu.max") or "").split()
        quota, period = (fields + ["", ""])[:2]
    else:
        quota = (_read(directory / "cpu.cfs_quota_us") or "").strip()
        period = (_read(directory / "cpu.cfs_period_us") or "").strip()
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max", or no such file
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_limit(root: Path = ROOT) -> float | None:
    """The CPUs this process's cgroup quota allows (e.g. 2.5), None where no quota applies. The
    lowest along the cgroup and its ancestors up to the mount point: a parent's quota binds too."""
    own = _own_cgroups(root)
    limits = []
    for key, mount_root, point in _cgroup_mounts(root):
        if key not in own:
            continue
        relative = os.path.relpath(own[key], mount_root)
        top = root / point.lstrip("/")
        directory = top / relative if not relative.startswith("..") else top
        while True:
            limit = _quota_in(directory, key)
            if limit is not None:
                limits.append(limit)
            if directory == top or top not in directory.parents:
                break
            directory = directory.parent
    return min(limits) if limits else None


def default_threads(root: Path = ROOT) -> tuple[int, str]:
    """The default thread count and why: the physical cores in the affinity, capped by the cgroup
    quota rounded down (a fraction of a core cannot run one more thread unthrottled), at least 1."""
    cores = physical_cores(root)
    limit = cgroup_cpu_limit(root)
    if limit is None:
        return cores, f"{cores} physical cores in the CPU affinity, no cgroup CPU quota"
    threads = min(cores, max(1, math.floor(limit)))
    return threads, f"{cores} physical cores in the CPU affinity, cgroup CPU quota {limit:g} CPUs"


def choose_threads(threads: int | None, root: Path = ROOT) -> tuple[int, str]:
    """The thread count an engine with option `threads` uses, and why (logged at start)."""
    if threads is not None:
        return threads, "the threads option"
    omp = envs.omp_num_threads()
    if omp is not None:  # torch applied it at start-up
        return torch.get_num_threads(), f"OMP_NUM_THREADS={omp}"
    return default_threads(root)


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (and with them the C kernels') to `threads`, or the default
    where None; logs the count and why; returns it."""
    n, why = choose_threads(threads)
    torch.set_num_threads(n)
    logger.info("threads: %d (%s)", n, why)
    return n
