"""A LoRA adapter in peft's format, merged into the base weights at load.

Why merged and not applied per token: the engine serves one adapter per process (the reuse
adapter of training/reuse_adapter.py teaches the model to read independently encoded documents),
so folding `W + (alpha / r) B A` into each weight once costs nothing per step and keeps every
kernel (packing included) as it is.

The format is peft's own: `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules,
use_rslora) and `adapter_model.safetensors` with tensors named
`base_model.model.<HF weight name without .weight>.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r]. Anything this merge would get wrong (DoRA, per-module ranks, biases, trained extra
modules, fan_in_fan_out) is refused with a ModelLoadError naming it, never half-applied.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from chunkcache.errors import ModelLoadError

_PREFIX = "base_model.model."
# Config keys whose non-default values change the arithmetic of the merge.
_UNSUPPORTED: dict[str, object] = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "lora_bias": False,
    "layer_replication": None,
    "alora_invocation_tokens": None,  # activated LoRA: only after given tokens, not a weight merge
    "arrow_config": None,
    "use_qalora": False,
    "kasa_config": None,
    "monteclora_config": None,
    "trainable_token_indices": None,
    "target_parameters": None,
}


@dataclass(frozen=True)
class LoraAdapter:
    """Per HF weight name, the low-rank update (scale * B @ A) to add to it."""

    path: Path
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # name -> (A, B, scale)

    @classmethod
    def open(cls, path: str | Path) -> LoraAdapter:
        folder = Path(path).expanduser()
        config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
        if not config_file.is_file() or not weights_file.is_file():
            raise ModelLoadError(
                f"adapter {str(path)!r} is not a peft LoRA directory (adapter_config.json and "
                "adapter_model.safetensors)"
            )
        config = json.loads(config_file.read_text())
        if config.get("peft_type") != "LORA":
            raise ModelLoadError(f"adapter {str(path)!r}: peft_type {config.get('peft_type')!r} is not LORA")
        for key, default in _UNSUPPORTED.items():
            if config.get(key, default) not in (default, None, {}, []):
                raise ModelLoadError(f"adapter {str(path)!r}: {key}={config[key]!r} is not supported")
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        tensors = load_file(str(weights_file))
        deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        for key in tensors:
            if not key.endswith(".lora_A.weight"):
                if not key.endswith(".lora_B.weight"):
                    raise ModelLoadError(f"adapter {str(path)!r}: unexpected tensor {key!r}")
                continue
            module = key.removesuffix(".lora_A.weight")
            b_key = f"{module}.lora_B.weight"
            if not module.startswith(_PREFIX) or b_key not in tensors:
                raise ModelLoadError(f"adapter {str(path)!r}: {key!r} has no matching lora_B")
            a, b = tensors[key].float(), tensors[b_key].float()
            if a.shape[0] != rank or b.shape[1] != rank:
                raise ModelLoadError(f"adapter {str(path)!r}: {module!r} is not of rank {rank}")
            deltas[module.removeprefix(_PREFIX) + ".weight"] = (a, b, scale)
        if not deltas:
            raise ModelLoadError(f"adapter {str(path)!r} holds no LoRA tensors")
        return cls(folder, deltas)

    def merge(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """`weight` (the base tensor named `name`) with its update added, in float32."""
        a, b, scale = self.deltas[name]
        if tuple(weight.shape) != (b.shape[0], a.shape[1]):
            raise ModelLoadError(
                f"adapter {str(self.path)!r}: {name} is {tuple(weight.shape)} in the model, "
                f"{(b.shape[0], a.shape[1])} in the adapter (made for another model?)"
            )
        return weight.float() + scale * (b @ a)

    def check_covered(self, names: set[str]) -> None:
        """Every update must land on a weight of the model: a name that matches nothing means the
        adapter was trained on another architecture, and dropping it would serve a different model."""
        missing = sorted(set(self.deltas) - names)
        if missing:
            raise ModelLoadError(
                f"adapter {str(self.path)!r} updates weights this model does not have: {missing[:3]}"
            )
