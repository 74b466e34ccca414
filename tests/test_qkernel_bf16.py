"""Prefill's int4 blocks in bfloat16 for CPUs with a native bfloat16 GEMM (qkernel_bf16.c): the
block is `dequant.int4_block`'s in torch's AVX512 packing, rounded to bfloat16, bit for bit;
where the machine serves it (AMX / AVX512-BF16, torch's tiles of 64), a prefill's products take
it and the model's answers stay those of the same file served dense in bfloat16."""

from __future__ import annotations

import functools

import pytest
import torch

from chunkcache.model import dequant
from chunkcache.model.kernels import build, qkernel
from chunkcache.model.linear import Linear
from chunkcache.model.quant import Int4Part

pytestmark = pytest.mark.skipif(build.loaded()[0] is None, reason="the kernel library does not build here")
serves = pytest.mark.skipif(
    not qkernel.bf16_blocks(), reason="no native bfloat16 GEMM or not torch's AVX512 packing"
)
TILE64 = dequant.Int4Layout(qkernel.TILE_BF16, True)


@pytest.mark.parametrize(("out", "inputs"), [(128, 64), (2048, 1536), (320, 8960)])
def test_block_is_torchs_unpacking_in_bfloat16(out: int, inputs: int) -> None:
    """Random codes in torch's AVX512 packing (bytes: the C reads them as they lie, so this runs
    on any CPU the library builds on) and random bfloat16 scales and zeros."""
    g = torch.Generator().manual_seed(out)
    packed = torch.randint(0, 256, (out, inputs // 2), dtype=torch.uint8, generator=g)
    scale_zeros = (torch.randn(inputs // 32, out, 2, generator=g) * 0.02).to(torch.bfloat16)
    s = scale_zeros[..., 0].float()
    m = scale_zeros[..., 1].float() - 8 * s
    for start, rows in ((0, 64), (out - 64, 64), (0, out)):
        reference = dequant.int4_block(packed, s, m, start, rows, TILE64).to(torch.bfloat16)
        block = torch.full((inputs, rows), float("nan"), dtype=torch.bfloat16)
        qkernel.int4_dequantize_bf16(packed, scale_zeros, start, block)
        assert torch.equal(block.view(torch.int16), reference.view(torch.int16)), (start, rows)


@serves
def test_prefill_products_take_the_bfloat16_blocks(monkeypatch) -> None:
    """An int4 part's product of prefill rows in bfloat16 is the bfloat16 GEMM over the blocks:
    within bfloat16's rounding of the float32 product over torch's unpacking (measured 2e-3 of
    its norm); decode rows stay on torch's kernel."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (256, 512), dtype=torch.uint8, generator=g)
    scale = torch.rand(256, 512 // 32, generator=g) * 0.01
    minimum = -8 * scale + torch.randn(256, 512 // 32, generator=g) * 1e-3
    part = Int4Part(q, scale, minimum)
    blocks = []
    dequantize = qkernel.int4_dequantize_bf16
    monkeypatch.setattr(qkernel, "int4_dequantize_bf16", lambda *a: blocks.append(1) or dequantize(*a))
    x = torch.randn(dequant.INT4_MIN_ROWS, 512, generator=g)
    y = part(x.to(torch.bfloat16))
    assert blocks and y.dtype == torch.bfloat16
    reference = dequant.int4_product(x, part.packed, *part.affine())
    assert ((y.float() - reference).norm() / reference.norm()).item() < 5e-3
    blocks.clear()
    part(x[:1].to(torch.bfloat16))
    assert not blocks


@serves
@pytest.mark.slow
@pytest.mark.parametrize("qtype_name", ["Q4_K", "Q6_K"])
def test_native_bfloat16_prefill_on_the_blocks_keeps_the_answers(
    checkpoint, tmp_path, monkeypatch, qtype_name
) -> None:
    """End to end on a tiny GGUF served native in bfloat16, the prompt's products on the bfloat16
    blocks (Q4_K: int4 parts in C's blocks; Q6_K, int8 per channel where qkernel does not serve
    decode: the codes converted to bfloat16; thresholds lowered to 2 rows), against the same file
    served dense in float32: no farther than the float32 blocks they replace, and for int4 as
    close as the file served dense in bfloat16 (the noise floor). Measured: Q4_K 0.054 (float32
    blocks 0.054 too; dense bfloat16 0.056), Q6_K 1.12 (float32 blocks 1.39; dense bfloat16 0.67:
    int8 per channel's re-quantization, which the float32 blocks carry as well)."""
    from gguf import GGMLQuantizationType as Q

    from tests import test_gguf
    from tests.test_quant import _deviation, _generate_in_forms, _random_k_quant

    for name in ("INT4_MIN_ROWS", "NATIVE_INT4_MIN_ROWS", "INT8_MIN_ROWS"):
        monkeypatch.setattr(dequant, name, 2)
    blocks = []
    for module, name in ((qkernel, "int4_dequantize_bf16"), (dequant, "int8_product")):
        product = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, product=product: blocks.append(a[0].dtype) or product(*a)
        )
    src = checkpoint(arch="llama", hidden_size=256, intermediate_size=256)
    monkeypatch.setattr(test_gguf, "_random_k_quant", functools.partial(_random_k_quant, d=1e-4))
    test_gguf.write_gguf(src, tmp_path / "model.gguf", getattr(Q, qtype_name))
    forms = [("dense", "float32", False), ("dense", "bfloat16", False), ("native", "bfloat16", False)]
    outs, model = _generate_in_forms(tmp_path, src, forms)
    assert any(isinstance(m, Linear) and m.quant is not None for m in model.modules())
    assert blocks, "no product took the bfloat16 blocks"
    monkeypatch.setattr(qkernel, "bf16_blocks", lambda: False)
    monkeypatch.setattr(dequant, "bf16_gemm", lambda: False)
    float32_blocks = _generate_in_forms(tmp_path, src, forms[-1:])[0]["native", "bfloat16", False]
    reference = outs["dense", "float32", False]
    native = _deviation(outs["native", "bfloat16", False], reference)
    assert native <= 1.25 * _deviation(float32_blocks, reference)
    if qtype_name == "Q4_K":
        assert native <= 1.25 * _deviation(outs["dense", "bfloat16", False], reference)
