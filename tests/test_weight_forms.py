"""`weights auto` (chunkcache/model/weight_forms.py): per projection kind, dense or native.

No timing is asserted: the rule is tested on given timings, and loads inject the measurement
(`weight_forms.time_forms`) to force a choice. Oracle of a mixed load: a native load whose
dense-chosen projections are replaced by those of a dense load of the same file, module by
module (built independently of `auto`); the mixed load must serve the same tokens and log-probs
bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch

from chunkcache import config
from chunkcache.chunk.tiers.identity import model_identity
from chunkcache.errors import ModelLoadError
from chunkcache.model import gguf_file, quant, quant_embedding, upcast, weight_forms
from chunkcache.model.linear import Linear
from chunkcache.model.loader import load_model
from chunkcache.model.weight_forms import Forms, Timing, choose

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from tests.test_quant import INT8_TOL, Q4_FORM, _random_k_quant, _raw, _reference, _relative  # noqa: E402

CASES = [
    ("llama", Q.Q4_K, {"hidden_size": 256, "intermediate_size": 256}),  # untied Q4_K lm_head: a kind
    ("qwen2", Q.Q4_1, {}),  # tied int4 lm_head (the embedding's blocks), qkv bias
]


def test_dense_only_where_faster_by_the_margin_at_every_size() -> None:
    assert choose((1.0, 1.0), (1.2, 1.2)) == "dense"
    assert choose((1.0,), (1.2,)) == "dense"  # the lm_head: one size
    assert choose((1.0, 1.0), (1.05, 2.0)) == "native"  # within the margin at one size
    assert choose((1.0, 1.0), (1.0, 1.0)) == "native"  # a tie goes native
    assert choose((1.0, 2.0), (2.0, 1.0)) == "native"  # dense slower at one size
    assert choose((1.0, 1.0), (1.5, 1.5), margin=2.0) == "native"


def test_forms_name_the_served_load() -> None:
    def timing(kind: str, choice: str, *modules: str) -> Timing:
        return Timing(kind, ("Q4_K",), modules, (1.0,), (2.0 if choice == "dense" else 1.0,))

    mixed = Forms((timing("qkv", "dense", "layers.0.self_attn.qkv_proj"), timing("o", "native", "x")))
    assert mixed.served == "native" and mixed.dense_modules == {"layers.0.self_attn.qkv_proj"}
    assert mixed.form == "native; dense qkv [Q4_K]"
    assert "qkv [Q4_K] dense; o [Q4_K] native" in mixed.summary()
    assert Forms((timing("o", "native", "x"),)).form == "native"
    everything_dense = Forms((timing("qkv", "dense", "a"), timing("o", "dense", "b")))
    assert everything_dense.served == everything_dense.form == "dense"
    untimed = Forms((), "not a GGUF file")
    assert untimed.served == "dense" and "not a GGUF file" in untimed.summary()


def test_auto_is_dense_off_cpu_off_gguf_and_with_an_adapter() -> None:
    assert "cuda" in weight_forms.fallback(torch.device("cuda"), gguf=True, adapter=False)
    assert "mps" in weight_forms.fallback(torch.device("mps"), gguf=True, adapter=False)
    assert "GGUF" in weight_forms.fallback(torch.device("cpu"), gguf=False, adapter=False)
    assert "adapter" in weight_forms.fallback(torch.device("cpu"), gguf=True, adapter=True)
    assert weight_forms.fallback(torch.device("cpu"), gguf=True, adapter=False) is None


def test_weights_option_takes_auto_and_still_rejects_unknown_values(checkpoint) -> None:
    assert config.WEIGHTS == quant.WEIGHTS and "auto" in config.WEIGHTS
    config.EngineConfig.from_options("m", use_env=False, weights="auto").validate()
    with pytest.raises(ValueError, match="weights 'int3' is not one of dense, native, int8, auto"):
        config.EngineConfig.from_options("m", use_env=False, weights="int3")
    loaded = load_model(str(checkpoint(arch="llama")), "cpu", "float32", weights="auto")
    assert loaded.weights == loaded.model.weights_form == "dense"  # safetensors: nothing to keep
    assert all(m.quant is None for m in loaded.model.modules() if isinstance(m, Linear))
    with pytest.raises(ModelLoadError, match="weights 'int3'"):
        load_model(str(checkpoint(arch="llama")), "cpu", "float32", weights="int3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_candidates_are_the_served_forms_and_each_size_is_timed(dtype: torch.dtype) -> None:
    """The dense candidate holds the file's values in the model's dtype, laid out as `prepare`
    lays a served projection out; the native one is the native load's product. The timer is
    injected: one tick per reading, so each product takes exactly 1."""
    raws = [_raw(Q.Q4_0, seed=3), _raw(Q.Q5_0, seed=4)]  # a merged projection: int4 then int8
    dense, native = weight_forms.candidates(raws, "qkv", dtype, narrow_weights=True)
    reference = torch.cat([_reference(r) for r in raws]).to(dtype)
    assert torch.equal(dense.dense_weight()[0], reference)
    emulated = upcast.bf16_gemm_emulated(reference)  # bf16 without a bf16 GEMM: the upcast layout
    assert dense.prefill == "upcast" if emulated else dense.prefill in ("dense", "transposed", "packed")
    assert [type(p) for p in native.quant.parts] == [Q4_FORM, quant.Int8Part]
    x = torch.randn(3, raws[0].shape[1]).to(dtype)
    assert torch.allclose(dense(x).float(), x.float() @ reference.float().t(), rtol=2e-2, atol=2e-2)
    assert _relative(native(x), x.float() @ reference.float().t()) < INT8_TOL
    ticks = iter(range(10**6))
    timed = weight_forms.time_forms(raws, "qkv", dtype, True, timer=lambda: float(next(ticks)))
    assert timed == ([1.0, 1.0], [1.0, 1.0])  # 1 row and PREFILL_ROWS rows, each form
    lm_head = weight_forms.time_forms(raws, "lm_head", dtype, True, timer=lambda: float(next(ticks)))
    assert lm_head == ([1.0], [1.0])  # the lm_head at one row only


def test_dense_at_load_reads_only_the_projections_kept_dense() -> None:
    dense = frozenset({"layers.1.mlp.down_proj", "lm_head"})
    at_load = functools.partial(quant.dense_at_load, qtype="Q4_K", tied=False, dense_modules=dense)
    assert at_load("model.layers.1.mlp.down_proj.weight") and at_load("lm_head.weight")
    assert not at_load("model.layers.0.mlp.down_proj.weight")
    assert not at_load("model.layers.1.mlp.gate_proj.weight") and not at_load(
        "model.layers.1.self_attn.k_proj.weight"
    )
    assert at_load("model.layers.1.input_layernorm.weight") and at_load(
        "model.layers.1.self_attn.q_proj.bias"
    )
    assert not at_load(quant.EMBEDDING)  # rows from the file's blocks: exact either way
    # A tied lm_head kept dense reads the embedding's dense weight.
    assert quant.dense_at_load(quant.EMBEDDING, "Q4_K", tied=True, dense_modules=dense)
    assert not quant.dense_at_load(quant.EMBEDDING, "Q4_K", tied=True)


def _gguf(checkpoint, tmp_path, monkeypatch, arch, qtype, overrides):
    from tests import test_gguf

    src = checkpoint(arch=arch, tie_word_embeddings=arch == "qwen2", **overrides)
    monkeypatch.setattr(test_gguf, "_random_k_quant", functools.partial(_random_k_quant, d=1e-4))
    test_gguf.write_gguf(src, tmp_path / "model.gguf", qtype)
    return src


def _force(monkeypatch, dense_kinds: set[str]) -> None:
    """Make every group of a kind in `dense_kinds` time dense 2x faster, the others equal."""

    def measure(raws, kind, dtype, narrow_weights, int8_x=False):
        return (1.0,), (2.0 if kind in dense_kinds else 1.0,)

    monkeypatch.setattr(weight_forms, "time_forms", measure)


def _generate(llm):
    from chunkcache import SamplingParams
    from tests import test_gguf

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    out = llm.generate(test_gguf.PROMPT, params)[0].outputs[0]
    llm.check_integrity()
    return out.token_ids, out.logprobs


def _swapped_reference(path: str, kw: dict, dense_modules: frozenset[str]):
    """A native load whose `dense_modules` are a dense load's modules: the mixed model, built
    without `auto`."""
    from chunkcache import LLM

    reference = LLM(path, **{**kw, "weights": "native"})
    dense = LLM(path, **{**kw, "weights": "dense"}).engine.runner.model
    net = reference.engine.runner.model
    for name in dense_modules:
        parent, _, child = name.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, child, dense.get_submodule(name))
    if "lm_head" in dense_modules and net.spec.tie_word_embeddings:
        net.embed_tokens = dense.embed_tokens  # the tied lm_head's dense table (rows equal anyway)
    return reference


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "qtype", "overrides"), CASES, ids=[f"{a}-{q.name}" for a, q, _ in CASES])
def test_auto_chooses_per_kind_and_serves_what_those_forms_serve(
    checkpoint, tmp_path, monkeypatch, caplog, arch, qtype, overrides
) -> None:
    """The real timer: each kind (the lm_head too, quantized here) is timed and logged; the
    load serves each projection in its kind's choice, with the tokens and log-probs of the
    same choices made by hand."""
    from chunkcache import LLM

    src = _gguf(checkpoint, tmp_path, monkeypatch, arch, qtype, overrides)
    kw = dict(tokenizer=str(src), dtype="float32", kv_cache_tokens=512)
    with caplog.at_level("INFO", logger="chunkcache.model.weight_forms"):
        auto = LLM(str(tmp_path), **kw, weights="auto")
    logged = [r.getMessage() for r in caplog.records if r.name == "chunkcache.model.weight_forms"]
    assert sorted(line.split(" [")[0].removeprefix("weights auto: ") for line in logged) == sorted(
        ["qkv", "o", "gate_up", "down", "lm_head"]
    )
    net = auto.engine.runner.model
    dense_modules = frozenset(n for n, m in net.named_modules() if isinstance(m, Linear) and m.quant is None)
    assert all(line.endswith(("-> dense", "-> native")) for line in logged)
    for line in logged:
        kind = line.split(" [")[0].removeprefix("weights auto: ")
        modules = [n for n in weight_forms.projections(net.spec) if weight_forms.kind_of(n) == kind]
        assert {m in dense_modules for m in modules} == {line.endswith("-> dense")}, line
    reference = _swapped_reference(str(tmp_path), kw, dense_modules)
    assert _generate(auto) == _generate(reference)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "qtype", "overrides"), CASES, ids=[f"{a}-{q.name}" for a, q, _ in CASES])
def test_a_mixed_choice_loads_no_dense_copy_of_its_native_projections_and_matches(
    checkpoint, tmp_path, monkeypatch, arch, qtype, overrides
) -> None:
    from chunkcache import LLM

    src = _gguf(checkpoint, tmp_path, monkeypatch, arch, qtype, overrides)
    _force(monkeypatch, {"qkv", "down", "lm_head"})
    dequantized: list[str] = []
    tensors = gguf_file.GGUFCheckpoint.tensors

    def spy(self, dense=None):
        for name, t in tensors(self, dense):
            dequantized.extend([] if t.is_meta else [name])
            yield name, t

    monkeypatch.setattr(gguf_file.GGUFCheckpoint, "tensors", spy)
    kw = dict(tokenizer=str(src), dtype="float32", kv_cache_tokens=512)
    mixed = LLM(str(tmp_path), **kw, weights="auto")
    net = mixed.engine.runner.model
    dense_modules = frozenset(
        n for n in weight_forms.projections(net.spec) if weight_forms.kind_of(n) in ("qkv", "down", "lm_head")
    )
    for name in weight_forms.projections(net.spec):
        assert (net.get_submodule(name).quant is None) == (name in dense_modules), name
    read = {quant.module_of(n) for n in dequantized} - {None}
    tied = arch == "qwen2"
    assert read == dense_modules - ({"lm_head"} if tied else set())  # no native one dequantized
    assert (quant.EMBEDDING in dequantized) == tied  # the tied dense lm_head's own table
    assert net.weights_form.startswith("native; dense ")
    assert isinstance(net.embed_tokens, quant_embedding.QuantEmbedding) == (
        arch != "qwen2"
    )  # tied: dense lm_head
    reference = _swapped_reference(str(tmp_path), kw, dense_modules)
    assert _generate(mixed) == _generate(reference)


@pytest.mark.parametrize("arch, qtype", [("qwen2", Q.Q8_0), ("qwen2", Q.Q4_1)], ids=["Q8_0", "Q4_1"])
def test_the_tiers_identity_binds_the_weights_form(checkpoint, tmp_path, monkeypatch, arch, qtype) -> None:
    """Native and dense weights give different KV: a shared tier must not mix them. In float32
    a projection served dense holds its weight transposed or packed, outside the state dict,
    so a mixed load whose dense ones are q/k/v and o hashed as the native load did before the
    form was bound (checked on both files here: equal identities without it)."""
    src = _gguf(checkpoint, tmp_path, monkeypatch, arch, qtype, {})
    path = str(tmp_path / "model.gguf")

    def identity(weights: str, int8_activations: bool = False) -> str:
        loaded = load_model(
            path, "cpu", "float32", tokenizer=str(src), weights=weights, int8_activations=int8_activations
        )
        return model_identity(loaded.model, loaded.tokenizer, "m")

    _force(monkeypatch, {"qkv", "o"})
    dense, native, mixed = identity("dense"), identity("native"), identity("auto")
    assert dense == identity("dense")
    assert len({dense, native, mixed}) == 3
    # Decode's int8 activations change the KV of the tokens it generates; dense weights ignore it.
    assert identity("native", int8_activations=True) not in (dense, native, mixed)
    assert identity("dense", int8_activations=True) == dense
    _force(monkeypatch, {"qkv", "o", "gate_up", "down", "lm_head"})
    assert identity("auto") == dense  # everything dense: a dense load exactly
    # The kernel that serves native weights changes their KV too (float32 against bfloat16 int4
    # factors): a replica where qkernel cannot serve never shares KV with one where it does.
    from chunkcache.model.kernels import qkernel

    served_by_qkernel = qkernel.available()
    monkeypatch.setattr(qkernel, "available", lambda: False)
    assert (identity("native") != native) == served_by_qkernel
    assert identity("dense") == dense
