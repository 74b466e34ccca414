"""Linear layers with a CPU fast path: the weight prepacked once for oneDNN.

On CPU in float32, `F.linear` runs MKL's sgemm, which is slow at the row counts an engine runs
most (a decode step of 1-64 sequences). oneDNN with the weight reordered once into its blocked
layout measured 1.3-2.4x faster at 4-16 rows and 1.05-1.2x at prefill sizes on this project's
Qwen2.5-0.5B shapes (benchmarks/RESULTS.md, bench_engine). `Linear.prepack()` does the reorder
after the checkpoint is loaded and drops the dense weight, so each weight is held once (except
a tied lm_head: see `LlamaForCausalLM.prepack`).
Everywhere else (CUDA, half precision, a torch without oneDNN) `Linear` is `F.linear` on the
dense weight.

Until it is packed a `Linear` has `nn.Linear`'s parameter names and shapes, so the loader fills it
like one, and a merged projection (q/k/v, gate/up) stays one tensor in the checkpoint mapping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ops = torch.ops.mkldnn

# oneDNN's kernel for 1-3 rows streams the weight more slowly than its 4-row kernel: a batch-1
# decode step of the benchmark model took ~145 ms CPU with 1 row and ~125 ms with the row padded
# to 4 (padding to 2, 3, 6 or 8 was no better). The extra zero rows cost nothing measurable
# because at these sizes the GEMM is bound by reading the weight.
_MIN_ROWS = 4


def onednn_usable(weight: torch.Tensor) -> bool:
    """Whether a weight can take the oneDNN path: a float32 CPU tensor in a torch built with it.

    Only float32: it is the CPU dtype the engine picks by default and the only one measured here;
    on other devices torch's own GEMMs are the fast ones.
    """
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
    )


def _pack(weight: torch.Tensor) -> torch.Tensor:
    # No batch-size hint: one layout then serves every row count (1 to a 2048-token prefill)
    # without a reorder per call; a hint of 1, 4 or 16 measured no faster at those sizes.
    return _ops._reorder_linear_weight(weight.contiguous(), None)


# Per weight shape, once per process: every model of a shape then takes the same path (and
# gives the same numbers), however noisy the machine was at a later load.
_PACKING_PAYS: dict[tuple[int, ...], bool] = {}


def packing_pays(weight: torch.Tensor) -> bool:
    """Whether the oneDNN path beats `F.linear` for this weight's shape on this machine. It
    depends on the shape: packing won 1.3-2.4x at decode sizes on Qwen2.5-0.5B's (896 wide), yet
    lost ~20% of decode speed on SmolLM2-135M's (576 wide) on the same CPU, so it is measured at
    the first load, not assumed."""
    if not onednn_usable(weight):
        return False
    shape = tuple(weight.shape)
    if shape not in _PACKING_PAYS:
        _PACKING_PAYS[shape] = _measure_packing(weight)
    return _PACKING_PAYS[shape]


@torch.inference_mode()
def _measure_packing(weight: torch.Tensor, rows: tuple[int, ...] = (1, 64), repeats: int = 15) -> bool:
    """The sum over `rows` of each path's fastest of `repeats` interleaved runs."""
    import time

    w = weight.detach().contiguous()
    packed = _pack(w)
    best = {"dense": 0.0, "packed": 0.0}
    for n in rows:
        x = torch.randn(max(n, _MIN_ROWS), w.shape[1])
        runs: dict[str, list[float]] = {"dense": [], "packed": []}
        for _ in range(repeats):
            start = time.perf_counter()
            F.linear(x[:n], w)
            runs["dense"].append(time.perf_counter() - start)
            start = time.perf_counter()
            _ops._linear_pointwise(x, packed, None, "none", [], "")
            runs["packed"].append(time.perf_counter() - start)
        for name, times in runs.items():
            best[name] += min(times)
    return best["packed"] < best["dense"]


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    padded = x.new_zeros(_MIN_ROWS, x.shape[1])
    padded[: x.shape[0]] = x
    return padded


class Linear(nn.Module):
    """`y = x W^T + b` with `nn.Linear`'s `weight` [out, in] and `bias` [out]; x is [T, in].

    `gated=True` is a SwiGLU gate/up projection: `weight` holds the gate rows then the up rows and
    the result is `silu(gate) * up` ([T, out / 2]). Packed, that is two GEMMs with silu and the
    product fused in as oneDNN post-ops, so neither the merged [T, out] output nor the strided
    halves of it are materialised (the MLP measured 16% faster at 2048 rows, 14% at 256).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, gated: bool = False) -> None:
        super().__init__()
        if gated and out_features % 2:
            raise ValueError(f"a gated projection needs an even out_features, got {out_features}")
        self.in_features, self.out_features, self.gated = in_features, out_features, gated
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias: nn.Parameter | None = nn.Parameter(torch.empty(out_features)) if bias else None
        # After prepack(): the oneDNN weights (one, or gate and up) and their biases. Plain
        # attributes, not buffers: an opaque oneDNN tensor has no storage to save or move.
        self.packed: tuple[torch.Tensor, ...] = ()
        self.packed_bias: tuple[torch.Tensor | None, ...] = ()

    @property
    def is_packed(self) -> bool:
        return bool(self.packed)

    def prepack(self) -> bool:
        """Reorder the weight for oneDNN and drop this module's dense copy; False (and nothing
        changed) where the oneDNN path does not apply. Call once, after the weights are loaded.

        The dense tensor is freed unless something else holds it (a tied embedding does)."""
        if self.is_packed:
            return True
        if self.weight is None or not onednn_usable(self.weight):
            return False
        w = self.weight.detach()
        b = None if self.bias is None else self.bias.detach()
        if self.gated:
            half = self.out_features // 2
            self.packed = (_pack(w[:half]), _pack(w[half:]))
            self.packed_bias = (None, None) if b is None else (b[:half].contiguous(), b[half:].contiguous())
        else:
            self.packed, self.packed_bias = (_pack(w),), (b,)
        self.weight = None
        self.bias = None
        return True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The projection of x [T, in], plus `residual` [T, out] when given (fused into the GEMM
        when packed, so the sum costs no extra pass over the output)."""
        if not self.packed:
            assert self.weight is not None
            y = F.linear(x, self.weight, self.bias)
            if self.gated:
                gate, up = y.split(self.out_features // 2, dim=-1)
                y = F.silu(gate) * up
            return y if residual is None else y + residual
        rows = x.shape[0]
        if rows >= _MIN_ROWS:
            return self._packed_forward(x, residual)
        res = None if residual is None else _pad_rows(residual)
        return self._packed_forward(_pad_rows(x), res)[:rows]

    def _packed_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        weights, biases = self.packed, self.packed_bias
        if self.gated:
            gate = _ops._linear_pointwise(x, weights[0], biases[0], "swish", [], "")  # swish = silu
            y = _ops._linear_pointwise.binary(x, gate, weights[1], biases[1], "mul")
            return y if residual is None else y + residual
        if residual is not None:
            return _ops._linear_pointwise.binary(x, residual, weights[0], biases[0], "add")
        return _ops._linear_pointwise(x, weights[0], biases[0], "none", [], "")

    def extra_repr(self) -> str:
        has_bias = self.bias is not None or any(b is not None for b in self.packed_bias)
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={has_bias}, "
            f"gated={self.gated}, packed={self.is_packed}"
        )
