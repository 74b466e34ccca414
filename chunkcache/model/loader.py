"""Loading a checkpoint: HF config, safetensors weights (single or sharded), tokenizer; or a GGUF
file, which `gguf_file` turns into the same config dict and HF-named tensors.

A model id that is not a local directory or file is fetched with huggingface_hub. Weight names follow
transformers; q/k/v and gate/up are concatenated into the merged projections here. A missing or
unexpected tensor is an error that names it, never a silently random weight.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from chunkcache.errors import ModelLoadError
from chunkcache.model import catalog, weight_forms
from chunkcache.model.adapter import LoraAdapter
from chunkcache.model.gguf_blocks import RawTensor
from chunkcache.model.gguf_file import GGUFCheckpoint, load_gguf_tokenizer
from chunkcache.model.linear import Linear
from chunkcache.model.llama import LlamaForCausalLM
from chunkcache.model.quant import WEIGHTS, apply_weights, dense_at_load
from chunkcache.model.quant_embedding import QuantEmbedding
from chunkcache.model.rope import RotaryEmbedding
from chunkcache.model.source import find_gguf, resolve_model_path
from chunkcache.model.spec import ModelSpec
from chunkcache.model.upcast import native_bf16_matmul

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    spec: ModelSpec
    tokenizer: Any
    path: Path  # the checkpoint directory, or the GGUF file
    name: str  # what the engine calls the model by default (directory name, GGUF file stem)
    eos_token_ids: frozenset[int]
    dtype: torch.dtype
    device: torch.device
    weights: str = "dense"  # the projections' form as resolved (`LlamaForCausalLM.weights_form`)


def model_path(name: str) -> str:
    """The verified file of the known model `name` (`chunkcache models`); an error says how to install it."""
    known = catalog.known(name)
    if known is None:
        raise ModelLoadError(f"unknown model {name!r}; known: {', '.join(catalog.KNOWN_MODELS)}")
    return str(catalog.locate(known))


def default_model() -> str:
    """The file of the model used when none is named (`catalog.DEFAULT_MODEL`), verified."""
    return model_path(catalog.DEFAULT_MODEL)


def resolve_device(device: str) -> torch.device:
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    try:
        import torch_npu  # noqa: F401

        return torch.device("npu")
    except ImportError:
        return torch.device("cpu")


def cpu_auto_dtype() -> tuple[torch.dtype, str]:
    """What `--dtype auto` serves on this CPU and why (`resolve_dtype`; `chunkcache env` reports it)."""
    native = native_bf16_matmul()
    if native is not None:
        return torch.bfloat16, f"auto: the CPU has native bf16 matrix instructions ({native})"
    return torch.float32, "auto: the CPU has no native bf16 matrix instructions (AMX, AVX512-BF16)"


def resolve_dtype(dtype: str, spec: ModelSpec, device: torch.device) -> tuple[torch.dtype, str]:
    """The serving dtype and why it was chosen (logged at load).

    `auto` on CPU: bfloat16 where the CPU multiplies bf16 matrices natively (3.5-5x the float32
    prefill of a 1.5B model on AVX512-BF16, a third of its memory), float32 elsewhere; on other
    devices the checkpoint's own dtype."""
    if dtype != "auto":
        return _DTYPES[dtype], "given"
    if device.type == "cpu":
        return cpu_auto_dtype()
    chosen = _DTYPES.get(spec.torch_dtype.replace("torch.", ""), torch.float32)
    return chosen, f"auto: the checkpoint's dtype on {device.type}"


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ModelLoadError(f"weight shards listed in the index are missing: {missing}")
    return files


def _read_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in tqdm(_weight_files(path), desc="loading weights", unit="shard", leave=False):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return tensors.pop(name)
    except KeyError:
        raise ModelLoadError(f"checkpoint is missing the tensor {name!r}") from None


def _fill_state(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    spec = model.spec
    state: dict[str, torch.Tensor] = {"embed_tokens.weight": _take(tensors, "model.embed_tokens.weight")}
    state["norm.weight"] = _take(tensors, "model.norm.weight")
    if spec.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    else:
        state["lm_head.weight"] = _take(tensors, "lm_head.weight")
    for i in range(spec.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        state[ours + "input_layernorm.weight"] = _take(tensors, hf + "input_layernorm.weight")
        state[ours + "post_attention_layernorm.weight"] = _take(
            tensors, hf + "post_attention_layernorm.weight"
        )
        state[ours + "self_attn.qkv_proj.weight"] = torch.cat(
            [_take(tensors, f"{attn}{p}_proj.weight") for p in "qkv"]
        )
        if spec.qkv_bias:
            state[ours + "self_attn.qkv_proj.bias"] = torch.cat(
                [_take(tensors, f"{attn}{p}_proj.bias") for p in "qkv"]
            )
        state[ours + "self_attn.o_proj.weight"] = _take(tensors, attn + "o_proj.weight")
        if spec.o_bias:
            state[ours + "self_attn.o_proj.bias"] = _take(tensors, attn + "o_proj.bias")
        if spec.qk_norm:
            state[ours + "self_attn.q_norm.weight"] = _take(tensors, attn + "q_norm.weight")
            state[ours + "self_attn.k_norm.weight"] = _take(tensors, attn + "k_norm.weight")
        state[ours + "mlp.gate_up_proj.weight"] = torch.cat(
            [_take(tensors, mlp + "gate_proj.weight"), _take(tensors, mlp + "up_proj.weight")]
        )
        state[ours + "mlp.down_proj.weight"] = _take(tensors, mlp + "down_proj.weight")
        if spec.mlp_bias:
            state[ours + "mlp.gate_up_proj.bias"] = torch.cat(
                [_take(tensors, mlp + "gate_proj.bias"), _take(tensors, mlp + "up_proj.bias")]
            )
            state[ours + "mlp.down_proj.bias"] = _take(tensors, mlp + "down_proj.bias")
    leftover = sorted(n for n in tensors if not n.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise ModelLoadError(f"checkpoint has tensors this model does not use: {leftover[:8]}")
    expected = {n for n, _ in model.named_parameters(remove_duplicate=True)}
    if set(state) != expected:
        raise ModelLoadError(f"weights do not cover the model: missing {sorted(expected - set(state))[:8]}")
    for name, param in model.named_parameters():
        if state[name].shape != param.shape:
            raise ModelLoadError(
                f"tensor {name} has shape {tuple(state[name].shape)}, expected {tuple(param.shape)}"
            )
    model.load_state_dict(state, strict=False, assign=True)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def read_hf_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path} has no config.json")
    return json.loads(config_file.read_text())


def _eos_ids(gen: Path | None, tokenizer: Any, hf: dict[str, Any]) -> frozenset[int]:
    """Token ids that end generation: from generation_config.json `gen` where given, the config,
    and the tokenizer."""
    ids: set[int] = set()
    for source in (json.loads(gen.read_text()) if gen is not None and gen.is_file() else {}, hf):
        # eot/eom: end-of-turn ids a GGUF's metadata lists beside its eos.
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            eos = source.get(key)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise ModelLoadError(f"could not load the tokenizer from {path}: {e}") from e


def load_model(
    model: str,
    device: str = "auto",
    dtype: str = "auto",
    tokenizer: str | None = None,
    adapter: str | None = None,
    narrow_weights: bool = True,
    weights: str = "dense",
    int8_activations: bool = False,
) -> LoadedModel:
    """The model at `model` (directory, .gguf file or hub id) on `device`, with its tokenizer, or
    with the one in the directory `tokenizer` where given; a LoRA `adapter` (peft's format) is
    merged into the weights. `narrow_weights`: see `LlamaForCausalLM.prepare`. `weights`: how
    the projections hold their weights (`model/quant.py`): dense, native (a GGUF's own
    quantization), int8 (per output channel), auto (per projection kind, dense or native,
    whichever measures faster here: `model/weight_forms.py`). `int8_activations`: quantized
    weights' 1-row products round x to int8 per block of 32 (`qkernel`)."""
    start = time.perf_counter()
    path = resolve_model_path(model)
    lora = LoraAdapter.open(adapter) if adapter is not None else None
    gguf = find_gguf(path)
    _check_weights(weights, gguf, adapter)
    if gguf is not None:
        checkpoint = GGUFCheckpoint.open(gguf)
        hf, read, name = checkpoint.config, checkpoint.tensors, gguf.stem
    else:
        hf, name = read_hf_config(path), path.name
        read = functools.partial(_read_tensors, path)
    spec = ModelSpec.from_hf(hf)
    # The tokenizer before the weights: building one from a GGUF's metadata (151k tokens and
    # merges for Qwen2.5) takes ~0.5 GB for a moment, which then does not stack on the weights.
    tok = _tokenizer_of(tokenizer, gguf, path)
    dev = resolve_device(device)
    torch_dtype, reason = resolve_dtype(dtype, spec, dev)
    # Timed before the weights are read: its candidates do not stack on them.
    forms = None
    if weights == "auto":
        forms = _auto_forms(
            dev,
            checkpoint if gguf is not None else None,
            adapter,
            spec,
            torch_dtype,
            narrow_weights,
            int8_activations,
        )
    served = weights if forms is None else forms.served
    dense_modules = frozenset() if forms is None else forms.dense_modules
    if gguf is not None and served == "native":
        # Native weights are built from the file's blocks: the tensors they replace are never
        # dequantized (no dense float32 model exists during the load), nor those of the
        # projections `auto` serves dense.
        read = functools.partial(
            checkpoint.tensors,
            functools.partial(dense_at_load, tied=spec.tie_word_embeddings, dense_modules=dense_modules),
        )
    net = _build_net(spec, read, lora, dev, torch_dtype)
    if served != "dense":
        _quantize(
            net,
            weights,
            served,
            checkpoint if gguf is not None else None,
            dev,
            spec.tie_word_embeddings,
            dense_modules,
            int8_activations,
        )
    size = _held_bytes(net)  # the weights as loaded (quantized ones included), a tied one once
    # After every weight is in place: the layouts are built from the final (merged, tied) tensors.
    net.prepare(narrow_weights)
    # A GGUF's metadata is its whole config: a generation_config.json beside it belongs to something else.
    gen = path / "generation_config.json" if gguf is None else None
    net.weights_form = served if forms is None else forms.form
    net.int8_activations = int8_activations and served != "dense"
    why = _why_served(torch_dtype, dev, reason, weights, forms, net.int8_activations)
    _log_loaded(net, name, size, why, time.perf_counter() - start)
    eos = _eos_ids(gen, tok, hf)
    return LoadedModel(net, spec, tok, path, name, eos, torch_dtype, dev, net.weights_form)


def _quantize(
    net: LlamaForCausalLM,
    weights: str,
    served: str,
    checkpoint: GGUFCheckpoint | None,
    dev: torch.device,
    tied: bool,
    dense_modules: frozenset[str],
    int8_activations: bool,
) -> None:
    """Give `net`'s projections their quantized products (`apply_weights`, the `served` form;
    `weights` is the option as given, for the errors): CPU only, and every tensor the load left
    on the meta device must have been replaced by one."""
    if dev.type != "cpu":
        raise ModelLoadError(f"weights {weights!r} are CPU kernels; on {dev.type} use weights 'dense'")
    raw = _raw_reader(checkpoint) if checkpoint is not None else None
    apply_weights(net, served, raw, tied, dense_modules, int8_activations)
    unbuilt = [n for n, p in net.named_parameters() if p.is_meta]
    if unbuilt:  # a tensor dense_at_load skipped that no quantized form replaced: a bug here
        raise ModelLoadError(f"weights {weights!r} left {unbuilt[:4]} without values")


def _why_served(
    dtype: torch.dtype,
    dev: torch.device,
    reason: str,
    weights: str,
    forms: weight_forms.Forms | None,
    int8_activations: bool,
) -> str:
    """The load line's account of how the model is served: dtype and device (and why), the
    weights' form where not dense (auto's choices summed up), int8 activations where on."""
    why = f"{str(dtype).removeprefix('torch.')} on {dev} ({reason})"
    if weights != "dense":
        why += f", weights {weights if forms is None else forms.summary()}"
    if int8_activations:
        why += ", int8 activations in decode's products"
    return why


def _auto_forms(
    dev: torch.device,
    checkpoint: GGUFCheckpoint | None,
    adapter: str | None,
    spec: ModelSpec,
    dtype: torch.dtype,
    narrow_weights: bool,
    int8_x: bool,
) -> weight_forms.Forms:
    """`weights auto`'s choice per projection group (timed on the file's blocks), or why it is
    dense untimed (`weight_forms.fallback`)."""
    why_dense = weight_forms.fallback(dev, checkpoint is not None, adapter is not None)
    if why_dense is not None or checkpoint is None:
        forms = weight_forms.Forms((), why_dense)
    else:
        forms = weight_forms.resolve(
            checkpoint.qtype, _raw_reader(checkpoint), spec, dtype, narrow_weights, int8_x
        )
    logger.info("weights %s", forms.summary())
    return forms


def _build_net(
    spec: ModelSpec,
    read: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    lora: LoraAdapter | None,
    dev: torch.device,
    dtype: torch.dtype,
) -> LlamaForCausalLM:
    """The model with the tensors `read` gives (the adapter merged), on `dev` in `dtype`; meta
    stand-ins where native weights replace a tensor (`dense_at_load`)."""
    with torch.device("meta"):
        net = LlamaForCausalLM(spec)

    # One tensor at a time: a dequantized GGUF tensor is float32 until it is cast here.
    # Contiguous: a permuted or strided view would send F.linear down another kernel.
    # The adapter's update is added in float32, before the cast, as peft merges it.
    def placed(n: str, t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:  # native weights' stand-in: its shape, in the model's dtype
            return t.to(dtype=dtype)
        if lora is not None and n in lora.deltas:
            t = lora.merge(n, t)
        return t.to(device=dev, dtype=dtype).contiguous()

    tensors = {n: placed(n, t) for n, t in read()}
    if lora is not None:
        lora.check_covered(set(tensors))
    _fill_state(net, tensors)
    # The rotary tables are buffers made on the meta device: rebuild them for real.
    rotary = RotaryEmbedding(spec.head_dim, spec.rope, spec.max_position_embeddings).to(dev)
    net.rotary = rotary
    for layer in net.layers:
        layer.self_attn.rotary = rotary
    net.eval()
    return net


def _tokenizer_of(tokenizer: str | None, gguf: Path | None, path: Path) -> Any:
    """The tokenizer in the directory `tokenizer` where given, else the GGUF's own, else the
    checkpoint directory's."""
    if tokenizer is not None:
        return load_tokenizer(Path(tokenizer).expanduser())
    if gguf is not None:
        return load_gguf_tokenizer(gguf)
    return load_tokenizer(path)


def _raw_reader(checkpoint: GGUFCheckpoint) -> Callable[[str], RawTensor]:
    """`checkpoint.raw`, releasing the file pages read for earlier tensors first: a native load
    then holds at most the current projection's pages mapped, not the whole file's."""

    def raw(name: str) -> RawTensor:
        checkpoint.release_pages()
        return checkpoint.raw(name)

    return raw


def _check_weights(weights: str, gguf: Path | None, adapter: str | None) -> None:
    if weights not in WEIGHTS:
        raise ModelLoadError(f"weights {weights!r} is not one of {', '.join(WEIGHTS)}")
    if weights == "native" and gguf is None:
        raise ModelLoadError(
            "weights 'native' keeps a GGUF file's quantization; this checkpoint is not GGUF "
            "(use weights 'int8' to quantize it, or 'dense')"
        )
    if weights == "native" and adapter is not None:
        raise ModelLoadError(
            "weights 'native' serves the file's quantized weights, into which a LoRA adapter cannot be "
            "merged; use weights 'dense' or 'int8' with an adapter"
        )


def _held_bytes(net: LlamaForCausalLM) -> int:
    """Bytes of every weight layout the model holds: parameters and the layouts `Linear.prepare`
    adds (transposed, oneDNN-packed, fused), each storage counted once."""
    seen: dict[int, int] = {}
    tensors: list[torch.Tensor] = [p.detach() for p in net.parameters()]
    for m in net.modules():
        if isinstance(m, Linear):
            tensors += [t for t in (m.weight_t, *m.packed, *(m.fused or ())) if t is not None]
            tensors += m.quant.tensors() if m.quant is not None else []
        elif isinstance(m, QuantEmbedding):
            tensors += m.tensors()
    for t in tensors:
        if t.layout == torch.strided:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        else:  # an opaque oneDNN tensor: no storage to share
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _log_loaded(net: LlamaForCausalLM, name: str, weights: int, why: str, seconds: float) -> None:
    """One line: the dtype and why, and what the weights hold in memory beyond their own bytes
    (the extra layouts `prepare` keeps: transposed, packed copies)."""
    held = _held_bytes(net)
    logger.info(
        "loaded %s in %.1f s: %s; weights %.2f GB, held %.2f GB (extra layouts %+.2f GB)",
        name, seconds, why, weights / 1e9, held / 1e9, (held - weights) / 1e9,
    )  # fmt: skip
