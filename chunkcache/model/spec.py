"""The shape of a model, read from its HF `config.json`; unsupported features fail here, by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkcache.errors import ModelLoadError
from chunkcache.model.rope import RopeSpec

# architecture -> (qkv bias, per-head q/k norm). Chosen by `architectures`, never by path.
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeSpec
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str  # the checkpoint's dtype

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelSpec:
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        qkv_bias, qk_norm = ARCHITECTURES[arch]
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        _reject_sliding_window(hf)
        heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch,
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=hf["vocab_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=RopeSpec.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=qk_norm,
            torch_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        )

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size


def _reject_sliding_window(hf: dict[str, Any]) -> None:
    window = hf.get("sliding_window")
    uses_window = hf.get("use_sliding_window", window is not None)
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ModelLoadError(f"sliding window attention is not supported (layer_types={set(layer_types)})")
    if window is not None and uses_window:
        raise ModelLoadError(f"sliding window attention is not supported (sliding_window={window})")
