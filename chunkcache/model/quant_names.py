"""Which checkpoint tensors (transformers names) a Linear of the model is made of, and back:
what `weights native` reads from a GGUF for each projection (`model/quant.py`)."""

from __future__ import annotations

EMBEDDING = "model.embed_tokens.weight"  # the token embedding's checkpoint name

# A merged projection's GGUF tensors (transformers names), in the order its rows are merged.
_MERGED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def source_names(module: str, tied: bool) -> list[str]:
    """The checkpoint tensors (transformers names) the Linear `module` of the model was made of."""
    if module == "lm_head":
        return [EMBEDDING if tied else "lm_head.weight"]
    layer, rest = module.split(".", 2)[:2], module.split(".", 2)[2]
    prefix = "model." + ".".join(layer) + "."
    return [f"{prefix}{part}.weight" for part in _MERGED.get(rest, (rest,))]


def module_of(name: str) -> str | None:
    """The Linear of the model the checkpoint tensor `name` is (part of) the weight of, or None
    (the inverse of `source_names`, the tied embedding aside)."""
    if name == "lm_head.weight":
        return "lm_head"
    if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
        return None
    module = name.removeprefix("model.").removesuffix(".weight")
    layer, group, projection = module.rsplit(".", 2)
    rest = f"{group}.{projection}"
    merged = next((m for m, parts in _MERGED.items() if rest in parts), rest)
    return f"{layer}.{merged}"
