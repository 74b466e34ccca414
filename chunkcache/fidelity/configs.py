"""Reuse configurations by name: the chunk options a calibration measures and a profile records.

The names are bench_fidelity's mode names (benchmarks/bench_fidelity.py builds its modes with the
same helpers; only blend@0.3/L4 is calibrate's alone), so a profile's row and a RESULTS.md row mean
the same options.
"""

from __future__ import annotations

from typing import Any

ChunkOptions = dict[str, Any]
FULL = "full"  # the reference: a plain prefill of the same tokens, no reuse


def offset(layers: list[int], ratios: list[float], **extra: Any) -> ChunkOptions:
    """Layout offset with blend: at check layer j recompute the share ratios[j] of chunk tokens."""
    return {"chunk_layout": "offset", "blend_check_layers": layers, "blend_recompute_ratios": ratios, **extra}


def fusion(rule: str, **extra: Any) -> ChunkOptions:
    """Layout fusion with `rule`; no pair stream and whole documents in a joint stream unless
    `extra` asks otherwise, spelt out so that a model's own default (catalog.py: the 1.5B's is pair
    `lead`) never slips into a named mode."""
    return {
        "chunk_layout": "fusion",
        "fusion_rule": rule,
        "fusion_pair": "none",
        "fusion_joint_excerpt": 0,
        **extra,
    }


_JOINT3_S1 = fusion(
    "contrastive",
    fusion_amateur=True,
    fusion_pair="lead",
    fusion_pair_margin=0.6,
    fusion_max_joint=3,
    fusion_max_streams=1,
)

# What `chunkcache calibrate` measures by default: the exact layouts (isolated, fusion, fusion with
# its pair stream always or only where the two most relevant documents are close), offset with
# nothing recomputed, and blend at growing recompute shares and at a deeper check layer.
CANDIDATES: dict[str, ChunkOptions] = {
    "fusion/contrastive": fusion("contrastive", fusion_amateur=True),
    "fusion/contrastive/pairlead": fusion("contrastive", fusion_amateur=True, fusion_pair="lead"),
    # The conditional joint stream: up to three documents within 0.6 of the most relevant one's
    # relevance lead (bench_fidelity's name); with only the most relevant document stream decoding
    # where none joins (s1: Qwen2.5-Coder-1.5B's catalog default, model/catalog.py); and that joint
    # stream reading at most 48 tokens of each later document, the spans sharing the question's words.
    "fusion/contrastive/joint3/m0.6": fusion(
        "contrastive", fusion_amateur=True, fusion_pair="lead", fusion_pair_margin=0.6, fusion_max_joint=3
    ),
    "fusion/contrastive/joint3/m0.6/s1": _JOINT3_S1,
    "fusion/contrastive/joint3/m0.6/s1/x48": {**_JOINT3_S1, "fusion_joint_excerpt": 48},
    "isolated": {"chunk_layout": "isolated"},
    "offset": offset([0], [0.0]),
    "blend@0.15": offset([1], [0.15]),
    "blend@0.3": offset([1], [0.3]),
    "blend@0.5": offset([1], [0.5]),
    "blend@0.3/L4": offset([4], [0.3]),
}


def fits(options: ChunkOptions, num_layers: int) -> bool:
    """Whether a configuration can run on a model this deep (its check layers exist)."""
    if options.get("chunk_layout") != "offset":
        return True
    return max(options.get("blend_check_layers", [0])) < num_layers
