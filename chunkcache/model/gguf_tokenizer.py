"""A GGUF file's tokenizer and chat template, built from its metadata without torch.

transformers' own GGUF path (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, what the engine
uses) reads the metadata through a reader module that imports torch; the router must not (it runs
on a small machine, and `tests/test_cli.py` checks it). So the metadata is read here with the
`gguf` package and handed to the same transformers converter (`convert_gguf_tokenizer`), grouped as
transformers groups it: the router tokenizes exactly as the engines do (tests/test_cluster.py
compares the two on the same file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chunkcache.errors import ModelLoadError

# Special tokens as transformers names them -> the GGUF key of their id (transformers' table).
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _metadata(file: Path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(file)
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.") or key == "general.architecture"
    }


def load_gguf_tokenizer_without_torch(file: Path) -> Any:
    """transformers' fast tokenizer for the GGUF `file` (vocab, merges, special tokens, chat
    template); a ModelLoadError naming the file when its metadata cannot make one."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    try:
        meta = _metadata(file)
        grouped = {
            group: {
                name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta
            }
            for group, renames in GGUF_TOKENIZER_MAPPING.items()
        }
        tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
        if tokenizer.get("tokenizer_type") == "llama":
            # As transformers: llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
            config.setdefault("add_bos_token", True)
        for name, key in _SPECIAL_TOKENS.items():
            token_id = meta.get(f"tokenizer.ggml.{key}")
            config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
        backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    except Exception as e:  # not GGUF, truncated, no tokenizer in its metadata, an unknown kind
        raise ModelLoadError(
            f"could not build a tokenizer from {file}'s metadata ({type(e).__name__}: {e}); pass --tokenizer DIR"
        ) from e
