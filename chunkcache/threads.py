"""How many threads torch's CPU kernels use (engine option `threads`).

The default is one thread per physical core this process may run on: a second hyper-thread on a
core adds little to matmuls and makes oneDNN's threads wait on each other. Where other work shares
the cores, fewer threads (often 1) is faster still, because a parallel kernel runs at the pace of
its slowest thread (docs/operations.md, "Memory and threads").
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from chunkcache import envs


def physical_cores() -> int:
    """Physical cores among the CPUs this process may use (Linux topology files; elsewhere the
    logical CPU count, halved by psutil's physical count where psutil is installed)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(
                (
                    (topology / "physical_package_id").read_text().strip(),
                    (topology / "core_id").read_text().strip(),
                )
            )
        except OSError:
            cores.clear()
            break
    if cores:
        return len(cores)
    logical = len(cpus) or os.cpu_count() or 1
    try:
        import psutil

        per_core = max(1, (psutil.cpu_count(logical=True) or 1) // (psutil.cpu_count(logical=False) or 1))
    except ImportError:
        per_core = 1
    return max(1, logical // per_core)


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to `threads`; returns the number in use. None: the physical
    cores, unless OMP_NUM_THREADS is set, which torch has applied already and is kept."""
    if threads is None and envs.omp_num_threads() is not None:
        return torch.get_num_threads()
    n = threads if threads is not None else physical_cores()
    torch.set_num_threads(n)
    return n
