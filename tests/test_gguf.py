"""GGUF checkpoints (chunkcache/model/gguf_file.py) written here with gguf's own writer.

Each test converts a tiny random transformers checkpoint to GGUF the way llama.cpp's
convert_hf_to_gguf does (its tensor names, its Q/K row permutation for Llama, 2-D weights
quantized, norms kept F32), and saves the same weights, dequantized by gguf, as safetensors next
to it. Loading both must give the same model, tensor for tensor, and the same outputs.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from chunkcache import LLM, SamplingParams
from chunkcache.errors import ModelLoadError
from chunkcache.model.llama import LlamaForCausalLM
from chunkcache.model.loader import load_model

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

Factory = Callable[..., Path]

# HF name pieces -> llama.cpp's (the inverse of gguf_file's table, written out independently).
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
PROMPT = "Alice lives in Paris and drinks tea every morning. Where does Alice live?"


def _gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rotate_half halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_quant(shape: tuple[int, int], qtype: Q, seed: int, d: float = 0.002) -> np.ndarray:
    """Valid K-quant bytes for a [rows, cols] tensor (gguf can read but not write K-quants):
    random quants and scales, with the f16 super-block scales set to small finite values (`d`)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(shape[0] * shape[1] // block, size), dtype=np.uint8)
    scale = np.full((blocks.shape[0],), d, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == Q.Q6_K:  # ... ql, qh, scales (int8), d (f16) last
        blocks[:, -2:] = scale
    else:  # Q4_K / Q5_K: d (f16), dmin (f16) first
        blocks[:, 0:2] = scale
        blocks[:, 2:4] = scale
    return blocks.reshape(shape[0], shape[1] // block * size)


def write_gguf(
    src: Path, out: Path, qtype: Q, arch_name: str | None = None, extra: Callable | None = None
) -> dict[str, torch.Tensor]:
    """Write the checkpoint `src` as the GGUF file `out`, 2-D weights in `qtype`; returns the
    weights as the file holds them after dequantization, under HF names and in HF layout."""
    hf = json.loads((src / "config.json").read_text())
    arch = (
        arch_name
        or {
            "LlamaForCausalLM": "llama",
            "MistralForCausalLM": "llama",
            "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3",
        }[hf["architectures"][0]]
    )
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("mistral-tiny" if hf["architectures"][0] == "MistralForCausalLM" else "tiny")
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_rope_dimension_count(hf["head_dim"])
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_vocab_size(hf["vocab_size"])
    writer.add_eos_token_id(hf["eos_token_id"])
    if extra is not None:
        extra(writer)
    expected: dict[str, torch.Tensor] = {}
    permute = arch == "llama"
    with safe_open(str(src / "model.safetensors"), framework="np") as f:
        for i, name in enumerate(sorted(f.keys())):
            w = f.get_tensor(name).astype(np.float32)
            if w.ndim == 1 or qtype == Q.F32:
                stored, kind = w, Q.F32
            elif qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
                stored, kind = _random_k_quant(w.shape, qtype, seed=i), qtype
            else:
                stored, kind = quantize(w, qtype), qtype
            # Rows are quantized on their own, so permuting quantized rows = quantizing permuted rows.
            expected[name] = torch.from_numpy(dequantize(stored, kind).reshape(w.shape).copy())
            to_write = stored
            if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
                to_write = _llama_cpp_permute(stored, heads)
            elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
                to_write = _llama_cpp_permute(stored, kv_heads)
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(to_write), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _as_safetensors(src: Path, out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """`src` with its weights replaced by `tensors` (config and tokenizer kept)."""
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / "model.safetensors"))
    return out


def _assert_same_model(a, b) -> None:
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys() and any(n.endswith("qkv_proj.weight") for n in pa)
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


CASES = [
    ("llama", Q.F32, {}),
    ("llama", Q.F16, {}),
    ("llama", Q.Q8_0, {}),
    ("llama", Q.Q4_0, {}),
    ("qwen2", Q.Q4_1, {}),
    ("qwen3", Q.BF16, {}),
    ("mistral", Q.Q8_0, {}),
    ("llama", Q.Q4_K, {"hidden_size": 256, "intermediate_size": 256}),
    ("llama", Q.Q5_K, {"hidden_size": 256, "intermediate_size": 256}),
    ("llama", Q.Q6_K, {"hidden_size": 256, "intermediate_size": 256}),
]


@pytest.mark.parametrize(("arch", "qtype", "overrides"), CASES, ids=[f"{a}-{q.name}" for a, q, _ in CASES])
def test_gguf_equals_the_same_weights_from_safetensors(
    checkpoint: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, qtype: Q, overrides: dict
) -> None:
    src = checkpoint(arch=arch, tie_word_embeddings=arch == "qwen2", **overrides)
    file = tmp_path / "model.gguf"
    expected = write_gguf(src, file, qtype)
    reference = _as_safetensors(src, tmp_path / "st", expected)
    with monkeypatch.context() as m:  # keep the dense weights (other layouts drop them) to compare them
        m.setattr(LlamaForCausalLM, "prepare", lambda self, narrow_weights=True: None)
        loaded = load_model(str(file), "cpu", "float32", tokenizer=str(src))
        _assert_same_model(loaded, load_model(str(reference), "cpu", "float32"))
    assert loaded.spec.architecture == json.loads((src / "config.json").read_text())["architectures"][0]
    assert loaded.spec.tie_word_embeddings == (arch == "qwen2")
    assert loaded.name == "model"
    if qtype in (Q.Q8_0, Q.Q4_1):  # end to end, once per file layout: same tokens, same logprobs
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
        a = LLM(str(tmp_path), tokenizer=str(src), dtype="float32", kv_cache_tokens=512).generate(
            PROMPT, params
        )[0]
        b = LLM(str(reference), dtype="float32", kv_cache_tokens=512).generate(PROMPT, params)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # Equal weights; dense GEMMs may round differently by the buffers' memory alignment.
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t] - step_b[t]) < 1e-5 for t in step_a)


def test_truncated_and_foreign_files_fail_at_load(checkpoint: Factory, tmp_path: Path) -> None:
    src = checkpoint(arch="llama")
    good = tmp_path / "good.gguf"
    write_gguf(src, good, Q.Q8_0)
    data = good.read_bytes()
    cut = tmp_path / "cut" / "cut.gguf"
    cut.parent.mkdir()
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        load_model(str(cut), "cpu", "float32", tokenizer=str(src))
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:100])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(str(header_only), "cpu", "float32", tokenizer=str(src))
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"this is not a GGUF file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(str(foreign), "cpu", "float32", tokenizer=str(src))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"nor a \.gguf file"):
        load_model(str(other), "cpu", "float32")


def test_unknown_architecture_and_quant_type_are_named(checkpoint: Factory, tmp_path: Path) -> None:
    src = checkpoint(arch="llama")
    gpt2 = tmp_path / "gpt2.gguf"
    write_gguf(src, gpt2, Q.F16, arch_name="gpt2")
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        load_model(str(gpt2), "cpu", "float32", tokenizer=str(src))

    def iq4(writer) -> None:  # one extra tensor in a type we do not dequantize
        block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
        writer.add_tensor(
            "blk.0.extra.weight", np.zeros((4, 64 // block * size), np.uint8), raw_dtype=Q.IQ4_NL
        )

    odd = tmp_path / "odd.gguf"
    write_gguf(src, odd, Q.Q8_0, extra=iq4)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.extra\.weight has quantization type IQ4_NL"):
        load_model(str(odd), "cpu", "float32", tokenizer=str(src))


def test_directory_with_several_gguf_files_is_ambiguous(checkpoint: Factory, tmp_path: Path) -> None:
    src = checkpoint(arch="llama")
    write_gguf(src, tmp_path / "a.gguf", Q.F16)
    shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
    with pytest.raises(ModelLoadError, match=r"several GGUF files \(a\.gguf, b\.gguf\)"):
        load_model(str(tmp_path), "cpu", "float32", tokenizer=str(src))


def test_unsupported_gguf_features_are_named(checkpoint: Factory, tmp_path: Path) -> None:
    src = checkpoint(arch="llama")
    window = tmp_path / "window.gguf"
    write_gguf(src, window, Q.F16, extra=lambda w: w.add_sliding_window(64))
    with pytest.raises(ModelLoadError, match="sliding window"):
        load_model(str(window), "cpu", "float32", tokenizer=str(src))
