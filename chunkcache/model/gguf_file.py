"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

A GGUF file is turned into exactly what the safetensors path produces: an HF-style config dict
(for `ModelSpec.from_hf`) and tensors under their transformers names (for the loader's
`_fill_state`), so the model is built by one code path whatever the file format. Quantized
tensors are dequantized at load (`gguf.quants.dequantize`) and llama.cpp's row permutation of
Llama's Q/K projections is undone, as transformers does in `modeling_gguf_pytorch_utils`.

Everything that can be wrong with a file (truncated, not GGUF, unknown architecture, a quant
type we cannot dequantize, a partial-rotary or per-frequency-scaled RoPE) is found when the file
is opened, before any weight is materialised, and raised as a ModelLoadError that names it.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from chunkcache.errors import ModelLoadError
from chunkcache.model.gguf_blocks import RawTensor

# general.architecture -> transformers architecture. llama.cpp writes Mistral models as "llama";
# like transformers, we tell them apart by general.name.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# general.architecture values whose Q/K rows llama.cpp's converter permuted (its rope kernel for
# them is "normal", not NEOX). Mistral files are "llama" too.
_PERMUTED = ("llama",)

# Types `gguf.quants.dequantize` turns into float32 (tested here: F32, F16, BF16, Q8_0, Q4_0, Q4_1,
# Q4_K, Q5_K, Q6_K; the others share gguf's implementation).
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


@dataclass
class GGUFCheckpoint:
    """An opened GGUF file: its HF-style config, and its tensors on demand."""

    file: Path
    arch: str  # the key prefix of the metadata (general.architecture)
    config: dict[str, Any]
    _reader: Any
    _by_name: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, file: Path) -> GGUFCheckpoint:
        try:
            from gguf import GGUFReader
        except ImportError as e:  # a declared dependency; only a broken install lacks it
            raise ModelLoadError(f"reading {file.name} needs the `gguf` package: {e}") from e
        try:
            reader = GGUFReader(str(file))
        except Exception as e:  # truncated, not GGUF, unknown type id: gguf raises many kinds
            raise ModelLoadError(
                f"{file} is not a readable GGUF file (truncated, or not GGUF): {type(e).__name__}: {e}"
            ) from e
        gguf_arch = _field(reader, "general.architecture")
        name = str(_field(reader, "general.name", "") or "")
        arch = "mistral" if gguf_arch == "llama" and "mistral" in name.lower() else gguf_arch
        if arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"{file.name}: GGUF architecture {gguf_arch!r} is not supported "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        _check_tensors(file, reader)
        return cls(file, gguf_arch, _hf_config(file, reader, gguf_arch, ARCHITECTURES[arch]), reader)

    def tensors(self, dense: Callable[[str, str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(transformers name, float32 tensor) for every tensor of the file, dequantized; those
        for which `dense(name, type name)` is false only as a float32 tensor of their shape on the
        meta device (no memory: `weights=native` builds them from `raw`)."""
        from gguf.quants import dequantize

        permute = self.arch in _PERMUTED
        heads, kv_heads = self.config["num_attention_heads"], self.config["num_key_value_heads"]
        for t in tqdm(self._reader.tensors, desc=f"loading {self.file.name}", unit="tensor", leave=False):
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
            name = hf_name(t.name)
            if dense is not None and not dense(name, t.tensor_type.name):
                yield name, torch.empty(shape, dtype=torch.float32, device="meta")
                continue
            array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                array = _unpermute(array, heads)
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                array = _unpermute(array, kv_heads)
            yield name, torch.from_numpy(np.array(array, copy=True))

    def release_pages(self) -> None:
        """Unmap the file's pages this process has read (they stay in the page cache; a later
        read faults them back): a native load reads each tensor once to convert it, and the
        mapped pages would otherwise count in its resident memory until the file closes (~1 GB
        of the 1.5B's file by the end of its load). Views already handed out stay valid."""
        mapping = getattr(self._reader.data, "_mmap", None)  # numpy's memmap keeps its mmap there
        if mapping is not None and hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_DONTNEED)

    def qtype(self, name: str) -> str:
        """The GGUF type of the tensor `name` (its transformers name), without reading its data."""
        if not self._by_name:
            self._by_name.update((hf_name(t.name), t) for t in self._reader.tensors)
        if name not in self._by_name:
            raise ModelLoadError(f"{self.file.name}: no tensor {name!r}")
        return self._by_name[name].tensor_type.name

    def raw(self, name: str) -> RawTensor:
        """The 2-D tensor `name` (its transformers name) as the file stores it, quantized blocks
        and all (`weights=native`), its rows in transformers' order: llama.cpp permutes whole
        rows of Llama's Q/K, and a row's blocks are its own, so the rows are unpermuted as bytes."""
        if not self._by_name:
            self._by_name.update((hf_name(t.name), t) for t in self._reader.tensors)
        t = self._by_name.get(name)
        if t is None or len(t.shape) != 2:
            raise ModelLoadError(f"{self.file.name}: no 2-D tensor {name!r} to serve quantized")
        rows, cols = (int(d) for d in reversed(t.shape.tolist()))
        data = np.asarray(t.data).reshape(rows, -1)
        if self.arch in _PERMUTED and name.endswith("q_proj.weight"):
            data = _unpermute(data, self.config["num_attention_heads"])
        elif self.arch in _PERMUTED and name.endswith("k_proj.weight"):
            data = _unpermute(data, self.config["num_key_value_heads"])
        return RawTensor(name, t.tensor_type.name, np.ascontiguousarray(data), (rows, cols))


def hf_name(name: str) -> str:
    """The transformers name of a GGUF tensor; an unknown one is returned as it is, so that the
    loader rejects it by that name."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_TENSOR.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return name


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute`: per head, rows (pairs, 2) -> (2, pairs),
    i.e. interleaved rotary halves back to transformers' rotate_half layout."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_tensors(file: Path, reader: Any) -> None:
    from gguf import GGML_QUANT_SIZES

    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{file.name}: tensor {t.name} has quantization type {kind}, which is not supported "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        block, size = GGML_QUANT_SIZES[t.tensor_type]
        expected = int(t.n_elements) // block * size
        if t.data.nbytes != expected:  # the reader slices a memory map: a short file gives short data
            raise ModelLoadError(
                f"{file.name}: tensor {t.name} has {t.data.nbytes} bytes of data, expected {expected} "
                "(truncated file?)"
            )
        if t.name == "rope_freqs.weight":
            raise ModelLoadError(
                f"{file.name}: per-frequency RoPE factors (rope_freqs.weight, e.g. Llama 3.1 scaling) "
                "are not supported"
            )


def _hf_config(file: Path, reader: Any, arch: str, hf_arch: str) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ModelLoadError(f"{file.name}: GGUF metadata lacks {arch}.{key}")
        return value

    tensor_names = {t.name for t in reader.tensors}
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts: only a uniform one fits this model
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(
                f"{file.name}: per-layer KV head counts {sorted(set(kv_heads))} are not supported"
            )
        kv_heads = kv_heads[0]
    head_dim = int(get("attention.key_length", 0) or hidden // heads)
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ModelLoadError(
            f"{file.name}: partial rotary embedding ({rotary_dim} of {head_dim} dims) is not supported"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = get("vocab_size") or len(tokens) or (int(embed.shape[-1]) if embed is not None else 0)
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        # Llama's attention_bias: biases on q/k/v/o. Qwen2 has q/k/v biases by architecture.
        "attention_bias": hf_arch != "Qwen2ForCausalLM" and "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "torch_dtype": _checkpoint_dtype(reader),
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        }
    window = get("attention.sliding_window")
    if window:
        config["sliding_window"], config["use_sliding_window"] = int(window), True
    # End-of-turn and end-of-message ids end generation too (llama.cpp's "end of generation" set).
    for key in ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    return config


def _checkpoint_dtype(reader: Any) -> str:
    """The dtype a device engine uses under dtype "auto" (CPU always uses float32)."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    if "BF16" in kinds:
        return "bfloat16"
    return "float32" if kinds <= {"F32"} else "float16"


def load_gguf_tokenizer(file: Path) -> Any:
    """transformers' tokenizer built from the GGUF metadata (vocab, merges, special tokens, chat
    template)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as e:
        raise ModelLoadError(
            f"could not build a tokenizer from {file.name}'s metadata ({e}); pass --tokenizer DIR"
        ) from e
