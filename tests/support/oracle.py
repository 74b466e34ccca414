"""transformers itself as the reference implementation ("oracle") for engine tests.

Every helper runs the Hugging Face model in float32 on CPU, in eval mode, so the numbers are
those of the upstream implementation, not of anything in `chunkcache`.

Custom attention masks (transformers 5.x): a 4D `attention_mask` of shape [B, 1, T, T] is
passed through to the attention kernel untouched (`masking_utils._preprocess_mask_arguments`
returns early for any 4D tensor). The eager kernel *adds* it to the attention scores, so it
must be an additive float mask (0 = attend, large negative = blocked); a boolean mask would be
silently added as 0/1 there. SDPA accepts either. The helpers here therefore always convert the
boolean mask to an additive float mask, which both implementations honour identically.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "additive_mask",
    "causal_mask",
    "chunk_isolated_mask",
    "hf_first_token_logprobs",
    "hf_generate",
    "hf_greedy",
    "hf_greedy_with_mask",
    "hf_logits_with_mask",
    "hf_logprobs_with_mask",
    "hf_model",
    "hf_teacher_forced_logprobs",
    "register_ape_attention",
]


@functools.lru_cache(maxsize=16)
def _load(path: str, attn_implementation: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if path.endswith(".gguf"):  # transformers' own GGUF reader (gguf's dequantize + its renaming)
        path, kwargs["gguf_file"] = str(Path(path).parent), Path(path).name
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, **kwargs
    )
    return model.eval()


def hf_model(
    path: str | Path, attn_implementation: str = "eager", dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The checkpoint at `path` (a directory, or a .gguf file) loaded by transformers: float32
    unless `dtype` says otherwise, eval mode, cached per path.

    "eager" is the default because it is plain PyTorch math (the most literal reference);
    "sdpa" gives the same numbers to ~1e-6.
    """
    return _load(str(Path(path).resolve()), attn_implementation, dtype)


def _ids(token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Token ids as a [1, T] long tensor (transformers wants a batch dimension)."""
    if isinstance(token_ids, torch.Tensor):
        return token_ids.to(torch.long).view(1, -1)
    return torch.tensor(list(token_ids), dtype=torch.long).view(1, -1)


@torch.inference_mode()
def hf_first_token_logprobs(
    path: str | Path,
    token_ids: Sequence[int],
    attn_implementation: str = "eager",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """log_softmax of the logits at the last prompt position (ordinary causal prompt), [vocab]."""
    logits = hf_model(path, attn_implementation, dtype)(input_ids=_ids(token_ids)).logits
    return torch.log_softmax(logits[0, -1].float(), dim=-1)


@torch.inference_mode()
def hf_generate(
    path: str | Path,
    token_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    attn_implementation: str = "eager",
    **generate_kwargs: Any,
) -> list[int]:
    """Greedy new tokens by `model.generate` (extra arguments: its logits processors' options).
    `eos_token_id` None disables EOS: an explicit None overrides generation_config.json's eos list,
    so generation never stops early (a GenerationConfig with eos None merged in does *not*)."""
    model = hf_model(path, attn_implementation)
    ids = _ids(token_ids)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=model.config.pad_token_id,
        **generate_kwargs,
    )
    return out[0, ids.shape[1] :].tolist()


@torch.inference_mode()
def hf_teacher_forced_logprobs(
    path: str | Path, prompt: Sequence[int], generated: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """log_softmax at every step that produced `generated` after `prompt` (one forward over
    both), [len(generated), vocab]: a decode compared step by step without its greedy path."""
    logits = hf_model(path, "eager", dtype)(input_ids=_ids([*prompt, *generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def hf_greedy(
    path: str | Path, token_ids: Sequence[int], max_new_tokens: int, attn_implementation: str = "eager"
) -> list[int]:
    """Greedy continuation by `model.generate`, EOS disabled: always `max_new_tokens` tokens."""
    new = hf_generate(path, token_ids, max_new_tokens, attn_implementation=attn_implementation)
    assert len(new) == max_new_tokens, f"generate stopped early: {len(new)} < {max_new_tokens}"
    return new


def chunk_isolated_mask(
    sys_len: int, chunk_lens: Sequence[int], q_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and positions of docs/design.md §2 layout "isolated" for `S C1 ... Cn Q`.

    Returns (mask bool [T, T], True = may attend; position_ids long [T]). S is causal at
    positions 0..s-1; chunk i sits at [s, s + len_i) and sees S plus the earlier tokens of its
    own chunk; Q starts at s + max(len_i) and sees everything before it, causally within Q.
    """
    s = sys_len
    total = s + sum(chunk_lens) + q_len
    mask = torch.zeros(total, total, dtype=torch.bool)
    positions = torch.empty(total, dtype=torch.long)
    mask[:s, :s] = torch.ones(s, s, dtype=torch.bool).tril()
    positions[:s] = torch.arange(s)
    start = s
    for n in chunk_lens:
        end = start + n
        mask[start:end, :s] = True
        mask[start:end, start:end] = torch.ones(n, n, dtype=torch.bool).tril()
        positions[start:end] = torch.arange(s, s + n)
        start = end
    q_pos = s + max(chunk_lens, default=0)
    mask[start:, :start] = True
    mask[start:, start:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    positions[start:] = torch.arange(q_pos, q_pos + q_len)
    return mask, positions


def register_ape_attention(start: int, end: int, temperature: float, scale: float) -> str:
    """Register with transformers an attention function that applies APE's calibration (Yang et
    al. 2025) and return its name, for `attn_implementation`.

    Written as APE's authors compute it: the rows at or after `end` attend to three key groups
    (before `start`, the chunks [start, end), from `end` on) by three softmaxes, the chunks' at
    temperature T, combined by the groups' log-sum-exps, the chunks' being T * lse(z / T) + log s.
    Rows before `end` attend as eager attention does. The additive mask applies to every group.
    """
    from transformers import AttentionInterface

    name = f"ape-{start}-{end}-{temperature}-{scale}"

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = module.num_key_value_groups
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scores = query @ key.transpose(2, 3) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask[..., : key.shape[-2]]
        out = torch.softmax(scores, dim=-1) @ value
        rows = scores[:, :, end:]
        parts = [rows[..., :start], rows[..., start:end] / temperature, rows[..., end:]]
        values = [value[:, :, :start], value[:, :, start:end], value[:, :, end:]]
        lse = torch.stack([torch.logsumexp(p, dim=-1) for p in parts], dim=-1)
        lse[..., 1] = lse[..., 1] * temperature + math.log(scale)
        weights = torch.softmax(lse, dim=-1)
        mixed = sum(
            weights[..., i : i + 1] * (torch.softmax(p, dim=-1) @ v)
            for i, (p, v) in enumerate(zip(parts, values, strict=True))
        )
        out[:, :, end:] = mixed
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention)
    return name


def causal_mask(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain causal mask and positions 0..T-1 (the ordinary prompt, in the mask helpers' form)."""
    return torch.ones(length, length, dtype=torch.bool).tril(), torch.arange(length)


def additive_mask(mask_bool: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[T, T] boolean (True = attend) -> [1, 1, T, T] additive float mask, as transformers wants.

    Blocked entries get finfo.min rather than -inf, like transformers' own masks: no NaN even
    for a fully masked row.
    """
    zero = torch.zeros((), dtype=dtype)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype)
    return torch.where(mask_bool, zero, blocked)[None, None]


@torch.inference_mode()
def hf_logits_with_mask(
    path: str | Path,
    token_ids: Sequence[int],
    mask_bool: torch.Tensor,
    position_ids: Sequence[int] | torch.Tensor,
    attn_implementation: str = "eager",
) -> torch.Tensor:
    """Logits [T, vocab] of the whole sequence run with a custom mask and explicit positions."""
    ids = _ids(token_ids)
    length = ids.shape[1]
    if tuple(mask_bool.shape) != (length, length):
        raise ValueError(f"mask shape {tuple(mask_bool.shape)} != ({length}, {length})")
    pos = torch.as_tensor(position_ids, dtype=torch.long).view(1, -1)
    if pos.shape[1] != length:
        raise ValueError(f"{pos.shape[1]} position ids for {length} tokens")
    model = hf_model(path, attn_implementation)
    # use_cache=False: nothing is reused between calls, and a cache would only cost memory.
    out = model(input_ids=ids, attention_mask=additive_mask(mask_bool), position_ids=pos, use_cache=False)
    return out.logits[0].float()


def hf_logprobs_with_mask(
    path: str | Path,
    token_ids: Sequence[int],
    mask_bool: torch.Tensor,
    position_ids: Sequence[int] | torch.Tensor,
    attn_implementation: str = "eager",
) -> torch.Tensor:
    """log_softmax at the last position [vocab], under a custom mask and explicit positions."""
    logits = hf_logits_with_mask(path, token_ids, mask_bool, position_ids, attn_implementation)
    return torch.log_softmax(logits[-1], dim=-1)


def hf_greedy_with_mask(
    path: str | Path,
    token_ids: Sequence[int],
    mask_bool: torch.Tensor,
    position_ids: Sequence[int] | torch.Tensor,
    n: int,
    attn_implementation: str = "eager",
) -> list[int]:
    """Greedy continuation of `n` tokens (EOS ignored) after a prompt with a custom mask.

    Generated token k sits at position max(prompt positions) + 1 + k (= last prompt position
    + 1 + k whenever the prompt ends with Q, whose positions are the largest) and sees every
    token before it. The full forward is re-run each step with the extended mask: O(n T^2),
    fine for test sizes, and free of any KV-cache logic that could mask a bug.
    """
    tokens = list(token_ids)
    mask = mask_bool.clone()
    pos = torch.as_tensor(position_ids, dtype=torch.long).clone()
    next_pos = int(pos.max()) + 1
    generated: list[int] = []
    for step in range(n):
        logits = hf_logits_with_mask(path, tokens, mask, pos, attn_implementation)
        token = int(torch.argmax(logits[-1]))
        generated.append(token)
        if step == n - 1:
            break
        tokens.append(token)
        length = mask.shape[0]
        grown = torch.zeros(length + 1, length + 1, dtype=torch.bool)
        grown[:length, :length] = mask
        grown[length, :] = True  # the new token sees everything, itself included
        mask = grown
        pos = torch.cat([pos, torch.tensor([next_pos + step])])
    return generated


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.inference_mode()
def hf_layer_kv(path: str | Path, token_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) [Hk, T, D] of a plain causal run at positions 0..T-1 (K after RoPE)."""
    model = hf_model(path)
    out = model(input_ids=_ids(token_ids), use_cache=True)
    cache = out.past_key_values
    return [(cache.layers[i].keys[0], cache.layers[i].values[0]) for i in range(len(cache.layers))]


def hf_rerotate(path: str | Path, k: torch.Tensor, delta: int) -> torch.Tensor:
    """K [Hk, T, D] moved by `delta` positions with transformers' own rotary inverse frequencies."""
    model = hf_model(path)
    inv_freq = model.model.rotary_emb.inv_freq.float()
    freqs = torch.full((k.shape[1], 1), float(delta)) * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return k * emb.cos() + _rotate_half(k) * emb.sin()


@torch.inference_mode()
def hf_offset_reuse_logprobs(
    path: str | Path, sys_ids: Sequence[int], chunks: Sequence[Sequence[int]], q_ids: Sequence[int]
) -> torch.Tensor:
    """First-token log-probs of layout "offset" with pure reuse, computed by transformers.

    Each chunk's KV is what transformers computes for S + Ci (the chunk at [s, s + len)); its K is
    re-rotated to the chunk's natural offset; Q runs over the assembled cache at natural positions.
    """
    s = len(sys_ids)
    pieces = [(list(sys_ids), 0, s)] + [(list(sys_ids) + list(c), s, len(c)) for c in chunks]
    return hf_slices_reuse_logprobs(path, pieces, q_ids)


@torch.inference_mode()
def hf_slices_reuse_logprobs(
    path: str | Path, pieces: Sequence[tuple[Sequence[int], int, int]], q_ids: Sequence[int]
) -> torch.Tensor:
    """First-token log-probs of Q over a cache assembled from slices of other runs' KV.

    Piece (context, start, length): transformers' KV of the causal run of `context`, tokens
    [start, start + length), K re-rotated from `start` to where the piece sits in the assembled
    cache (pieces follow one another from position 0); Q runs after them at natural positions.
    """
    from transformers import DynamicCache

    model = hf_model(path)
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    offset = 0
    for context, start, length in pieces:
        layers = hf_layer_kv(path, context)
        end = start + length
        parts.append(
            [(hf_rerotate(path, k[:, start:end], offset - start), v[:, start:end]) for k, v in layers]
        )
        offset += length
    cache = DynamicCache(config=model.config)
    for layer in range(len(parts[0])):
        k = torch.cat([p[layer][0] for p in parts], dim=1)[None]
        v = torch.cat([p[layer][1] for p in parts], dim=1)[None]
        cache.update(k, v, layer)
    positions = torch.arange(offset, offset + len(q_ids)).view(1, -1)
    out = model(input_ids=_ids(q_ids), position_ids=positions, past_key_values=cache, use_cache=True)
    return torch.log_softmax(out.logits[0, -1].float(), dim=-1)


@torch.inference_mode()
def hf_continue_over_cache(
    path: str | Path,
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    token_ids: Sequence[int],
    n: int,
) -> tuple[torch.Tensor, list[int]]:
    """First-token log-probs and `n` greedy tokens (EOS ignored) of transformers running
    `token_ids` after a given cache: per layer (K, V) [Hk, P, D] of the first P positions (K
    after RoPE, as transformers caches it), whatever computed them."""
    from transformers import DynamicCache

    model = hf_model(path)
    cache = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(kv):
        cache.update(k[None].float(), v[None].float(), layer)
    start = kv[0][0].shape[1]
    positions = torch.arange(start, start + len(token_ids)).view(1, -1)
    out = model(input_ids=_ids(token_ids), position_ids=positions, past_key_values=cache, use_cache=True)
    first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
    tokens = [int(first.argmax())]
    position = start + len(token_ids)
    while len(tokens) < n:
        out = model(
            input_ids=_ids(tokens[-1:]),
            position_ids=torch.tensor([[position]]),
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        tokens.append(int(out.logits[0, -1].argmax()))
        position += 1
    return first, tokens


@torch.inference_mode()
def _projections(path: str | Path, token_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the k_proj and v_proj outputs [T, Hk * D] (K before norm and RoPE) of a plain
    causal run of `token_ids`."""
    model = hf_model(path)
    out: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    hooks = [
        proj.register_forward_hook(lambda _m, _i, y, i=i: out[i].append(y[0]))
        for i, layer in enumerate(model.model.layers)
        for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj)
    ]
    try:
        model(input_ids=_ids(token_ids))
    finally:
        for hook in hooks:
            hook.remove()
    return [(k, v) for k, v in out]


@torch.inference_mode()
def hf_sensitivity(
    path: str | Path, sys_ids: Sequence[int], context_ids: Sequence[int], chunk_ids: Sequence[int]
) -> torch.Tensor:
    """A chunk's sensitivity (chunkcache/engine/sensitivity.py) from transformers' projections: per
    token, the K and V deviation between the runs of S + P + C and S + C, summed over layers,
    each layer divided by the mean squared K and V norm over the rows of the S + P + C run. The
    projections are taken before RoPE, so no rotation is involved (the model has no k-norm)."""
    n = len(chunk_ids)
    within = _projections(path, [*sys_ids, *context_ids, *chunk_ids])
    alone = _projections(path, [*sys_ids, *chunk_ids])
    score = torch.zeros(n)
    for (kw, vw), (ka, va) in zip(within, alone, strict=True):
        scale = (kw.pow(2).sum(-1) + vw.pow(2).sum(-1)).mean()
        score += ((kw[-n:] - ka[-n:]).pow(2).sum(-1) + (vw[-n:] - va[-n:]).pow(2).sum(-1)) / scale
    return score


@torch.inference_mode()
def hf_partial_reuse_logprobs(
    path: str | Path,
    sys_ids: Sequence[int],
    chunks: Sequence[Sequence[int]],
    q_ids: Sequence[int],
    reused: torch.Tensor,
) -> torch.Tensor:
    """First-token log-probs of a blend whose recomputed tokens are chosen before layer 0: the
    whole prompt runs in transformers at natural positions, but at every layer the K and V
    projections of the chunk tokens marked in `reused` [sum len Ci] are replaced by those of the
    run of S + their chunk alone (as computed at [s, s + len): RoPE at the natural position then
    re-rotates it, as the engine does). Every other token is computed fresh, seeing them."""
    model = hf_model(path)
    ids = [*sys_ids, *(t for c in chunks for t in c), *q_ids]
    s = len(sys_ids)
    cached = [_projections(path, [*sys_ids, *c]) for c in chunks]
    # Per layer, the isolated projections of every chunk token in prompt order.
    iso = [
        (torch.cat([c[i][0][s:] for c in cached]), torch.cat([c[i][1][s:] for c in cached]))
        for i in range(len(model.model.layers))
    ]
    rows = reused.nonzero().squeeze(1) + s

    def replace(i: int, which: int) -> Any:
        def hook(_m: Any, _i: Any, y: torch.Tensor) -> torch.Tensor:
            y = y.clone()
            y[0, rows] = iso[i][which][rows - s]
            return y

        return hook

    hooks = [
        proj.register_forward_hook(replace(i, which))
        for i, layer in enumerate(model.model.layers)
        for which, proj in enumerate((layer.self_attn.k_proj, layer.self_attn.v_proj))
    ]
    try:
        out = model(input_ids=_ids(ids))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.log_softmax(out.logits[0, -1].float(), dim=-1)


def linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """What chunkcache's `Linear` computes, from F.linear: SwiGLU over the gate and up halves
    when gated, then the residual added."""
    out = torch.nn.functional.linear(x, weight, bias)
    if gated:
        half = weight.shape[0] // 2
        out = torch.nn.functional.silu(out[:, :half]) * out[:, half:]
    return out if residual is None else out + residual
