"""The model identity bound into every lower-tier entry: KV is only ever loaded by the same model.

Pool keys already hold the served model name and the token ids, but two checkpoints can share a
name (a fine-tune served as "default") and two tokenizers can map text to the same ids. The
identity hashes what decides the KV: every weight's name, shape and dtype plus a sample of its
values (the first and last 64 elements: enough to tell checkpoints apart without reading
gigabytes), the form the projections hold their weights in (`LlamaForCausalLM.weights_form`:
quantized products are not in the state dict) and whether `qkernel` serves them, and the tokenizer's whole vocabulary.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from chunkcache.model import dequant
from chunkcache.model.kernels import qkernel

_SAMPLE = 64


def model_identity(model: torch.nn.Module, tokenizer: Any, model_name: str) -> str:
    h = hashlib.sha256()
    h.update(f"chunkcache-model-v1\0{model_name}\0".encode())
    # Native (quantized) and dense weights give slightly different KV: a tier shared by replicas
    # whose `weights auto` chose differently must not mix them. Dense adds nothing, so the
    # identities of dense models stay what they were.
    form = getattr(model, "weights_form", "dense")
    if form != "dense":
        h.update(f"weights\0{form}\0".encode())
        # Which kernel serves them changes the KV too (`qkernel`: float32 int4 scales, also in
        # prefill's blocks; torch's: bfloat16), so a replica without AVX2 or a compiler never
        # shares KV with one that has them.
        h.update(f"qkernel\0{qkernel.available()}\0".encode())
        if qkernel.blocks_available():  # and what its forms are (the file's blocks, not int8)
            h.update(f"forms\0{qkernel.FORMS_VERSION}\0".encode())
        if not qkernel.available() and dequant.bf16_gemm():  # a bfloat16 prefill's blocks in bfloat16
            h.update(f"bf16_blocks\0{qkernel.bf16_blocks()}\0".encode())
        if getattr(model, "int8_activations", False):  # the kernel's products on int8 x
            h.update(b"int8_activations\0")
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = torch.cat((flat[:_SAMPLE], flat[-_SAMPLE:])).to("cpu", copy=True).contiguous()
        h.update(f"{name}\0{tuple(tensor.shape)}\0{tensor.dtype}\0".encode())
        h.update(sample.view(torch.uint8).numpy())
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    return h.hexdigest()
