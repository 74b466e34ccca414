"""What `pip install` delivers: the wheel built from this checkout, installed into a fresh folder,
imported from there (not from the checkout), builds and loads its C kernels on this CPU.

The speed figures of benchmarks/RESULTS.md were measured in editable checkouts, whose kernels
compile from the sources beside `qkernel.py`; a wheel missing one of them (pyproject's package
data once named `qkernel.c` alone) silently served torch's kernels instead (issue 58).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chunkcache.model import qkernel

ROOT = Path(__file__).resolve().parents[1]

# What the installed package runs, in a process whose sys.path starts with the install folder.
_PROBE = """
import json, sys
import chunkcache
from chunkcache.model import qkernel
k = qkernel.kernels()
print(json.dumps({"package": chunkcache.__file__, "source": str(qkernel.SOURCE),
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


@pytest.mark.slow
@pytest.mark.skipif(
    qkernel.kernels().kind != "c", reason="the kernels do not build here from the checkout either"
)
def test_the_installed_wheel_builds_and_loads_its_kernels(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path / "wheels", tmp_path)
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
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
