"""Where a model named on the command line lies, and the name engines give it, without torch.

`chunkcache serve` (through `loader`) and `chunkcache route` resolve `--model` here, so that the
router reads its tokenizer from the very file or folder the replicas serve, and keys chunks under
the same model name (part of every chunk key).
"""

from __future__ import annotations

from pathlib import Path

from chunkcache.errors import ModelLoadError
from chunkcache.model import catalog


def resolve_model_path(model: str) -> Path:
    """A short name (`catalog.KNOWN_MODELS`), a local directory or .gguf file, or a hub id."""
    known = catalog.known(model)
    if known is not None:
        return catalog.locate(known)
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return path
    # Hub ids look like "org/name"; anything else that is not a directory is a bad local path.
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelLoadError(
            f"model {model!r} is not a directory with a checkpoint, nor a .gguf file, nor a "
            f"known model name ({', '.join(catalog.KNOWN_MODELS)})"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
            )
        )
    except Exception as e:  # network, auth, unknown repo: one clear message
        raise ModelLoadError(f"model {model!r} is not a local directory and could not be fetched: {e}") from e


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` in a directory that holds
    no safetensors weights (a directory with both is a transformers checkpoint). None: not GGUF."""
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is neither a checkpoint directory nor a .gguf file")
        return path
    if any(path.glob("*.safetensors")):
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ModelLoadError(f"{path} holds several GGUF files ({names}); pass one of them as the model")
    return files[0] if files else None


def default_model_name(path: Path) -> str:
    """What an engine calls the checkpoint at `path` without --served-model-name: the GGUF file's
    stem, else the directory's name (`loader.load_model`)."""
    gguf = find_gguf(path)
    return gguf.stem if gguf is not None else path.name
