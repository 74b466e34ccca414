"""A chunk entry's sensitivity: how far each token's KV moves when its chunk follows other text.

Blend recomputes the chunk tokens whose reused KV is furthest from what a full prefill would give
them. The usual selectors estimate that at the request, from the fresh K of one check layer, which
every chunk token must first run to. The probes with transformers (benchmarks/fidelity_probes.py;
benchmarks/history/RESULTS-narrative.md "Where the answers are lost") found the deviation to be
mostly a property of the token itself: measured once, after the entry's S and one fixed passage of
another domain, it ranked the tokens as well as the true all-layer deviation in the prompt (41 and
42 of 48 of full prefill's answers kept at 15%, against 36 for the K deviation at layer 1). So an
entry measures it once, the first time a request ranks by it (`blend_selector="stored_deviation"`),
and keeps it; the choice is then known before layer 0, and the tokens not chosen never run.

score(token i) = sum over layers l of
    (|K_l(i | S, P) - K_l(i | S)|^2 + |V_l(i | S, P) - V_l(i | S)|^2) / mean_j(|K_l(j)|^2 + |V_l(j)|^2)
where K_l(i | S) is the entry's cached KV, K_l(i | S, P) the token's KV computed after S and the
passage P (K rotated back to the cached position), and the mean runs over the rows of that pass:
each layer weighs by its own scale, as the probes did.
"""

from __future__ import annotations

import pydoc_data.topics

import torch

from chunkcache.model.attention import AttentionMetadata, PrefillSegment
from chunkcache.model.llama import LlamaForCausalLM

# The passage P: text of another domain than any user's documents, the same for every entry and
# on every machine (CPython's own help text ships with the interpreter). 120 words, as probed.
_PASSAGE_WORDS = 120


def neutral_passage() -> str:
    topics = pydoc_data.topics.topics
    return " ".join(topics[min(topics)].split()[:_PASSAGE_WORDS])


@torch.inference_mode()
def measure(
    model: LlamaForCausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    sys_ids: tuple[int, ...],
    context_ids: tuple[int, ...],
    chunks: list[tuple[torch.Tensor, tuple[int, ...]]],
) -> list[torch.Tensor]:
    """The scores [len(chunk)] (float32, CPU) of entries computed after the same S `sys_ids`:
    per entry (slots of its cached KV, computed from position len(S); its chunk's token ids).
    `context_ids` is the passage P. One forward: S and P once, then every chunk after them (each
    sees S, P and itself), so measuring a request's new documents costs about what filling them
    did, plus S and P once."""
    longest = max(len(c) for _, c in chunks)
    # A chunk near the model's longest context gets the end of the passage that fits (none at
    # all: every score 0, and blend's choice among them is arbitrary).
    room = max(0, model.rotary.cos.shape[0] - len(sys_ids) - longest)
    context_ids = context_ids[len(context_ids) - min(room, len(context_ids)) :]
    head = len(sys_ids) + len(context_ids)
    sizes = [len(c) for _, c in chunks]
    total = head + sum(sizes)
    device = chunks[0][0].device
    spec = model.spec
    dtype = kv_caches[0][0].dtype
    # The pass runs in its own scratch KV: the engine's tensors are left as they were.
    scratch = [
        (
            torch.empty((total, spec.num_kv_heads, spec.head_dim), dtype=dtype, device=device),
            torch.empty((total, spec.num_kv_heads, spec.head_dim), dtype=dtype, device=device),
        )
        for _ in kv_caches
    ]
    past = torch.arange(head, device=device)
    segments, positions, at = [PrefillSegment.make(0, head, None)], [past], head
    for n in sizes:
        segments.append(PrefillSegment.make(at, at + n, past))
        positions.append(torch.arange(head, head + n, device=device))
        at += n
    meta = AttentionMetadata(slot_mapping=torch.arange(total, device=device), prefills=segments, decode=None)
    ids = [*sys_ids, *context_ids, *(t for _, c in chunks for t in c)]
    model(torch.tensor(ids, device=device), torch.cat(positions), scratch, meta)
    # Every chunk row moves back by the passage's length, to where its cached KV was computed:
    # one rotation R(-p) for all rows and layers.
    back = model.rotary.rerotation(
        torch.full((total - head,), -len(context_ids), device=device), torch.float32
    )
    slots = torch.cat([s for s, _ in chunks])  # the cached KV of every chunk row, in pass order
    lengths = torch.tensor(sizes, device=device)
    score = torch.zeros(total - head, dtype=torch.float32, device=device)
    for (k_fresh, v_fresh), (k_cache, v_cache) in zip(scratch, kv_caches, strict=True):
        kf, vf = k_fresh.float(), v_fresh.float()
        norms = kf.pow(2).sum(dim=(1, 2)) + vf.pow(2).sum(dim=(1, 2))
        # Each layer weighs a chunk by the mean norm over the rows of S, P and that chunk.
        chunk_norms = torch.stack([part.sum() for part in norms[head:].split(sizes)])
        scale = ((norms[:head].sum() + chunk_norms) / (head + lengths)).clamp_min(1e-12)
        k_moved = model.rotary.rerotate_(kf[head:].clone(), *back)
        k_dev = (k_moved - k_cache.index_select(0, slots).float()).pow(2).sum(dim=(1, 2))
        v_dev = (vf[head:] - v_cache.index_select(0, slots).float()).pow(2).sum(dim=(1, 2))
        score += (k_dev + v_dev) / scale.repeat_interleave(lengths)
    return list(score.cpu().split(sizes))
