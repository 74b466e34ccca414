"""The engine against transformers on tiny random checkpoints (docs/design.md §1)."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from chunkcache import LLM, SamplingParams
from chunkcache.errors import InvalidRequestError, ModelLoadError, PromptTooLongError
from chunkcache.hashing import block_hashes
from chunkcache.model import loader, upcast
from tests.support.oracle import hf_first_token_logprobs, hf_greedy, linear_reference

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog near the river bank",
    "Alice",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24",
]

CASES = [
    ("llama", "default", {}),
    ("llama", "linear", {}),
    ("llama", "llama3", {}),
    ("llama", "yarn", {}),
    ("qwen2", "default", {}),
    ("qwen3", "default", {}),
    ("qwen3", "yarn", {}),
    ("mistral", "default", {}),
    ("llama", "default", {"tie_word_embeddings": True}),
    ("qwen2", "default", {"sharded": True}),
    ("llama", "default", {"dtype": "bfloat16"}),
]


def _small_llm(path: Path, **options) -> LLM:
    options.setdefault("kv_cache_tokens", 4096)
    options.setdefault("chunk_cache_size_gb", 0.01)
    options.setdefault("dtype", "float32")  # the oracles' 1e-4; auto is bfloat16 on bf16 CPUs
    return LLM(str(path), device="cpu", **options)


@pytest.mark.parametrize(("arch", "rope", "kw"), CASES, ids=lambda c: str(c))
def test_matches_transformers(checkpoint, arch: str, rope: str, kw: dict) -> None:
    path = checkpoint(arch=arch, rope=rope, **kw)
    llm = _small_llm(path)
    outs = llm.generate(PROMPTS, GREEDY)
    for out in outs:
        ids = out.prompt_token_ids
        ref = hf_first_token_logprobs(path, ids)
        first = out.outputs[0].logprobs[0]
        assert len(first) >= 5
        for token, lp in first.items():
            assert abs(ref[token].item() - lp) < 1e-4, (token, ref[token].item(), lp)
        assert out.outputs[0].token_ids == hf_greedy(path, ids, 32)
        assert out.outputs[0].finish_reason == "length"
    llm.check_integrity()


def test_mixed_batch_with_chunked_prefill(checkpoint) -> None:
    path = checkpoint(arch="qwen3")
    # A tiny token budget splits prompts across steps and mixes prefill with decode.
    llm = _small_llm(path, max_num_batched_tokens=7, max_num_seqs=3)
    prompts = [*PROMPTS, "one two three four five six seven", "z"]
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(p) for p in prompts]
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, 32)
    llm.check_integrity()


def test_prefix_cache_hit_gives_identical_output(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _small_llm(path)
    base = list(range(10, 74))  # 64 tokens = 4 full blocks
    first = llm.generate([base + [5, 6, 7]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    second_ids = base + [8, 9]
    second = llm.generate([second_ids], GREEDY)[0]
    assert second.num_cached_tokens == 64
    assert second.num_prefix_cached_tokens == 64
    assert second.outputs[0].token_ids == hf_greedy(path, second_ids, 32)
    # The whole prompt cached: its last token is still computed to get logits.
    again = llm.generate([base], GREEDY)[0]
    assert again.num_cached_tokens == 48
    assert again.outputs[0].token_ids == hf_greedy(path, base, 32)
    llm.check_integrity()


def test_block_hashes_are_vllm_compatible(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _small_llm(path, hash_seed="0")
    ids = list(range(3, 40))
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))

    # vLLM's default (`sha256`): sha256(pickle.dumps((parent, tuple(tokens), extra), HIGHEST_PROTOCOL)),
    # first parent = sha256(pickle.dumps(PYTHONHASHSEED)).
    def vllm_sha256(obj) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent = vllm_sha256("0")
    expected = []
    for start in (0, 16):
        parent = vllm_sha256((parent, tuple(ids[start : start + 16]), None))
        expected.append(parent)
    assert block_hashes("0", ids, 16) == expected
    # Registered under exactly the chained vLLM hashes: a lookup by them finds the blocks.
    blocks, hashes = llm.engine.blocks.match_prefix(ids, max_blocks=2)
    assert hashes == expected and len(blocks) == 2
    llm.engine.blocks.free(blocks)
    llm.check_integrity()


def test_preemption_keeps_outputs_and_frees_everything(checkpoint) -> None:
    path = checkpoint(arch="qwen2")
    # 7 blocks of 16 tokens; each request needs 3 blocks by its end: they cannot all run.
    llm = _small_llm(path, kv_cache_tokens=112, enable_prefix_caching=False)
    prompts = [[7 + i, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 3 + i] for i in range(5)]
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, p, 32)
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.check_integrity()


def test_stop_strings_tokens_and_eos(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _small_llm(path)
    prompt = PROMPTS[0]
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert len(full.text) > 4
    stop = full.text[2:5]
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[
        0
    ]
    assert cut.outputs[0].text == full.text[: full.text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    token = full.token_ids[3]
    by_id = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[token]))[0]
    assert by_id.outputs[0].token_ids == full.token_ids[: full.token_ids.index(token) + 1]
    assert by_id.outputs[0].stop_reason == token
    # Forcing EOS as the likeliest token: generation stops there unless ignore_eos.
    eos = next(iter(llm.engine.detokenizer.eos_token_ids))
    llm.engine.detokenizer.eos_token_ids = frozenset({full.token_ids[0]})
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert stopped.token_ids == full.token_ids[:1] and stopped.finish_reason == "stop"
    llm.engine.detokenizer.eos_token_ids = frozenset({eos})


def test_sampling_seed_top_k_top_p(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _small_llm(path)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    a, b = llm.generate([PROMPTS[0], PROMPTS[0]], [p, p])
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    other = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    c = llm.generate([PROMPTS[0]], other)[0]
    assert c.outputs[0].token_ids != a.outputs[0].token_ids
    greedy = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    top1 = llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0.7, top_k=1, max_tokens=16, ignore_eos=True)
    )[0]
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_chat_renders_template(checkpoint) -> None:
    path = checkpoint(arch="qwen3")
    llm = _small_llm(path)
    messages = [{"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    rendered = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, 8)


def test_bad_input_is_rejected_and_engine_keeps_serving(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _small_llm(path, max_model_len=64)
    engine = llm.engine
    vocab = engine.spec.vocab_size
    cases = [
        ("", SamplingParams(), InvalidRequestError, "empty"),
        ([], SamplingParams(), InvalidRequestError, "empty"),
        (list(range(1, 80)), SamplingParams(), PromptTooLongError, "max_model_len 64"),
        ([1, 2, vocab + 5], SamplingParams(), InvalidRequestError, str(vocab + 5)),
        ([1, 2, -1], SamplingParams(), InvalidRequestError, "-1"),
        ([1, 2, 3], SamplingParams(max_tokens=62), InvalidRequestError, "max_tokens (62)"),
        (42, SamplingParams(), InvalidRequestError, "int"),
    ]
    for prompt, params, error, needle in cases:
        with pytest.raises(error, match=None) as info:
            engine.add_request("bad", prompt, params)
        assert needle in str(info.value), (needle, str(info.value))
    for kwargs, needle in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature")]:
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**kwargs)
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, 8)
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.check_integrity()


def test_abort_frees_blocks(checkpoint) -> None:
    path = checkpoint(arch="llama")
    llm = _small_llm(path)
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats()["kv_blocks_free"] < engine.stats()["kv_blocks_total"]
    engine.abort_request("a")
    outs = engine.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "a"] == ["abort"]
    assert not engine.has_unfinished_requests()
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]
    llm.check_integrity()


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_load_errors_name_the_problem(checkpoint, tmp_path: Path) -> None:
    src = checkpoint(arch="llama")
    unknown = _copy_checkpoint(src, tmp_path / "unknown")
    cfg = json.loads((unknown / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (unknown / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPTNeoXForCausalLM"):
        LLM(str(unknown))

    missing = _copy_checkpoint(src, tmp_path / "missing")
    weights = load_file(str(missing / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(missing / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        LLM(str(missing))

    with pytest.raises(ModelLoadError, match="sliding window"):
        LLM(str(checkpoint(arch="mistral", sliding_window=32)))
    with pytest.raises(ModelLoadError, match="dynamic"):
        LLM(str(checkpoint(arch="llama", rope="dynamic")))
    with pytest.raises(ModelLoadError, match="not a directory"):
        LLM(str(tmp_path / "nowhere" / "deeper" / "model"))
    with pytest.raises(TypeError, match="unknown engine option 'no_such_option'"):
        LLM(str(src), no_such_option=1)


@pytest.mark.parametrize(("native", "expected"), [("AVX512-BF16", torch.bfloat16), (None, torch.float32)])
def test_device_and_dtype_auto(
    checkpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, native, expected
) -> None:
    """auto on CPU: bfloat16 where the CPU has native bf16 matrix instructions, else float32;
    the choice and its reason in the load log line; an explicit dtype wins."""
    monkeypatch.setattr(loader, "native_bf16_matmul", lambda: native)
    with caplog.at_level(logging.INFO, logger="chunkcache.model.loader"):
        llm = LLM(str(checkpoint(arch="llama", dtype="float16")), kv_cache_tokens=256)
    assert llm.engine.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if llm.engine.device.type != "cpu":
        return
    assert llm.engine.runner.dtype == expected
    name = str(expected).removeprefix("torch.")
    reason = "has native bf16 matrix instructions (AVX512-BF16)" if native else "has no native bf16"
    assert any(f"{name} on cpu (auto: the CPU {reason}" in r.getMessage() for r in caplog.records)
    pinned = LLM(str(checkpoint(arch="llama")), device="cpu", dtype="float32", kv_cache_tokens=256)
    assert pinned.engine.runner.dtype == torch.float32


def test_native_bf16_detection_follows_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upcast.platform, "machine", lambda: "x86_64")
    for amx, avx in ((True, True), (False, True), (True, False), (False, False)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda a=amx: a)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx: v)
        names = [n for n, on in (("AMX", amx), ("AVX512-BF16", avx)) if on]
        assert upcast.native_bf16_matmul() == (" and ".join(names) or None)


# (pack, narrow_copy, pack_prefill, in, out) -> expected (narrow, wide, prefill) layouts
LAYOUTS = [
    (True, False, True, 96, 160, ("packed", "packed", "packed")),
    (True, False, False, 96, 160, ("packed", "packed", "packed")),  # no plain copy to take
    (True, True, True, 96, 160, ("transposed", "packed", "packed")),
    (True, True, False, 96, 160, ("transposed", "packed", "transposed")),
    (True, True, False, 160, 96, ("dense", "packed", "dense")),
    (False, True, True, 96, 160, ("transposed", "transposed", "transposed")),
    (False, False, True, 160, 96, ("dense", "dense", "dense")),
]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 3, 4, 37, 130])
@pytest.mark.parametrize(
    ("gated", "bias", "with_residual"), [(False, False, False), (False, True, True), (True, True, False)]
)
@pytest.mark.parametrize(("pack", "narrow_copy", "pack_prefill", "n_in", "n_out", "layouts"), LAYOUTS)
def test_every_linear_layout_matches_f_linear(
    rows: int,
    gated: bool,
    bias: bool,
    with_residual: bool,
    pack: bool,
    narrow_copy: bool,
    pack_prefill: bool,
    n_in: int,
    n_out: int,
    layouts: tuple[str, str],
) -> None:
    """Every layout a Linear can be prepared in (oneDNN with row padding below 4 rows, fused
    SwiGLU and residual; transposed; dense), for narrow, wide and prefill steps, against F.linear."""
    from chunkcache.model.linear import Linear

    gen = torch.Generator().manual_seed(rows)
    lin = Linear(n_in, n_out, bias=bias, gated=gated)
    weight = torch.randn(n_out, n_in, generator=gen) * 0.1
    b = torch.randn(n_out, generator=gen) if bias else None
    with torch.no_grad():
        lin.weight.copy_(weight)
        if lin.bias is not None:
            lin.bias.copy_(b)
    x = torch.randn(rows, n_in, generator=gen)
    out_size = n_out // 2 if gated else n_out
    residual = torch.randn(rows, out_size, generator=gen) if with_residual else None
    ref = linear_reference(x, weight, b, gated, residual)
    assert lin.prepare(pack, narrow_copy, pack_prefill) == layouts
    assert lin.is_packed == (pack is True)
    assert (lin.weight is None) == ("dense" not in layouts)
    assert (lin.weight_t is None) == ("transposed" not in layouts)
    with torch.inference_mode():
        out = lin(x, residual)
    assert out.shape == (rows, out_size)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize(("tied", "narrow_weights"), [(False, True), (True, True), (True, False)])
def test_cpu_fp32_model_layouts_match_dense(
    checkpoint, monkeypatch, tied: bool, narrow_weights: bool
) -> None:
    """On CPU float32 every projection (lm_head included) is laid out at load (packed for wide
    steps here, with or without plain copies for narrow ones), and the logits of a prefill (many
    rows) and a decode step (one row) equal those of the dense F.linear model."""
    from chunkcache.model import llama as llama_module
    from chunkcache.model.attention import AttentionMetadata, DecodeBatch, PrefillSegment
    from chunkcache.model.linear import Linear
    from chunkcache.model.llama import LlamaForCausalLM
    from chunkcache.model.loader import load_model

    path = checkpoint(arch="qwen2", tie_word_embeddings=tied)
    # Whether packing pays is measured at load; here it is forced, to check the packed path.
    # Packing is forced for decode steps, and for prefills only without narrow copies.
    monkeypatch.setattr(llama_module, "packing_pays", lambda linear, rows: rows != (256,))
    packed = load_model(str(path), "cpu", "float32", narrow_weights=narrow_weights)
    linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.is_packed and m.wide == "packed" for m in linears)
    assert all((m.narrow != "packed") == narrow_weights for m in linears)
    lm_head = packed.model.lm_head
    assert all((m.prefill != "packed") == narrow_weights for m in linears if m is not lm_head)
    monkeypatch.setattr(LlamaForCausalLM, "prepare", lambda self, narrow_weights=True: None)
    dense = load_model(str(path), "cpu", "float32")
    assert all(
        m.narrow == m.wide == m.prefill == "dense" for m in dense.model.modules() if isinstance(m, Linear)
    )

    spec = packed.spec
    n = 140  # a prefill of 139 rows: past PREFILL_ROWS, so the prefill layouts run
    ids = torch.randint(3, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(0))

    @torch.inference_mode()
    def logits(model: LlamaForCausalLM) -> torch.Tensor:
        shape = (n, spec.num_kv_heads, spec.head_dim)
        kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
        pre = AttentionMetadata(torch.arange(n - 1), [PrefillSegment.make(0, n - 1, None)], None)
        prefill = model.compute_logits(model(ids[:-1], torch.arange(n - 1), kv, pre))
        dec = DecodeBatch(torch.tensor([0]), torch.arange(n)[None], torch.ones(1, 1, 1, n, dtype=torch.bool))
        step = AttentionMetadata(torch.tensor([n - 1]), [], dec)
        decode = model.compute_logits(model(ids[-1:], torch.tensor([n - 1]), kv, step))
        return torch.cat((prefill, decode))

    torch.testing.assert_close(logits(packed.model), logits(dense.model), atol=1e-5, rtol=1e-5)


def test_decode_of_one_run_of_slots_reads_the_cache_in_place() -> None:
    """A one-sequence decode whose KV list is one run of slots (`DecodeBatch.span`) attends the
    cache in place; it equals the gathered, masked path, and a wrong span would not."""
    from chunkcache.model.attention import AttentionMetadata, DecodeBatch, attend

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, first, length = 6, 2, 16, 32, 21
    k_cache, v_cache = (
        torch.randn(96, kv_heads, dim, generator=gen),
        torch.randn(96, kv_heads, dim, generator=gen),
    )
    q, k, v = torch.randn(1, heads, dim, generator=gen), *torch.randn(2, 1, kv_heads, dim, generator=gen)
    slots = torch.arange(first, first + length)[None]
    mask = torch.ones(1, 1, 1, length, dtype=torch.bool)

    def run(span: tuple[int, int] | None) -> torch.Tensor:
        kc, vc = k_cache.clone(), v_cache.clone()
        meta = AttentionMetadata(slots[0, -1:], [], DecodeBatch(torch.tensor([0]), slots, mask, span=span))
        return attend(q, k, v, kc, vc, meta, dim**-0.5)

    gathered = run(None)
    torch.testing.assert_close(run((first, length)), gathered, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(run((first + 1, length)), gathered, atol=1e-3)
