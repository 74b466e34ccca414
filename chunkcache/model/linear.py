"""Linear layers with CPU fast paths: the weight held in the layouts its row counts run fastest in.

On CPU in float32 three layouts of a weight serve `y = x W^T` (benchmarks/history/
RESULTS-narrative.md, bench_engine's sections):
- dense [out, in], `F.linear` (MKL): the reference, and the best at 1 row when in > out;
- transposed [in, out] contiguous, `x @ W^T` (MKL): at 1-3 rows, 1.2-1.8x faster than dense when
  out >= in (q/k/v, gate/up, lm_head: 10 -> 6 ms per decode token for SmolLM2's lm_head), and
  within a few percent of dense at prefill sizes;
- oneDNN packed (`Linear.prepare(pack=True)`): reordered once into oneDNN's blocked layout, with
  SwiGLU and the residual add fused in; 1.3-2.4x faster at 4-16 rows on Qwen2.5-0.5B's shapes,
  but slower than either plain layout at 1-3 rows.

In bfloat16 the weight stays dense. Where torch has no oneDNN bf16 kernel for the CPU (no
AVX512 core, no ARM BF16: `upcast.bf16_gemm_emulated`), a bf16 matrix product falls to torch's
reference GEMM, ~10 GFLOP/s on one AMD EPYC (Zen 3, AVX2) core against MKL's ~80 in float32;
there steps of 4 rows and more take the "upcast" layout (`upcast.upcast_product`): the product
in float32, 256 weight rows at a time converted into a reused buffer, at float32 GEMM speed
(6-7x the bf16 reference at 512 rows, 1.5-3x at 4-64) with no float32 copy of the weights held.
1-3 rows keep bf16 GEMV, which streams the weight at ~9 GB/s there (the blocks measured
1.05-2.5x slower at 1-3 rows).

`prepare()` picks a layout for steps of 1-3 rows ("narrow": a batch-1 to batch-3 decode step), one
for 4-127 rows ("wide": batched decode) and one for 128 rows and more ("prefill"), and drops the
dense tensor when none needs it. Packed weights may keep a second, plain layout for narrow steps
(`narrow_copy`), which prefill steps then take too where it measured faster: the one memory trade
in here, an option of the engine (`narrow_weights`). Everywhere else (CUDA, half precision) `Linear`
is `F.linear` on the dense weight.

Inside a compiled graph (the engine's `compile_decode`) a fourth form may serve 1-3 rows: the
dense weight as a multiply-sum (`multiply_sum`), which inductor turns into one loop streaming the
weight; BLAS keeps the eager steps. `hold_fused_weight()` opts a Linear in (a second, [out, in]
copy where the narrow layout is transposed), where `time_one_row_products` measured it faster
for that projection kind.

Until it is prepared a `Linear` has `nn.Linear`'s parameter names and shapes, so the loader fills
it like one, and a merged projection (q/k/v, gate/up) stays one tensor in the checkpoint mapping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from chunkcache.model import upcast

if TYPE_CHECKING:
    from chunkcache.model.quant import QuantProduct

_ops = torch.ops.mkldnn

# oneDNN's kernel for 1-3 rows streams the weight more slowly than its 4-row kernel: a batch-1
# decode step of the benchmark model took ~145 ms CPU with 1 row and ~125 ms with the row padded
# to 4 (padding to 2, 3, 6 or 8 was no better). The extra zero rows cost nothing measurable
# because at these sizes the GEMM is bound by reading the weight.
_MIN_ROWS = 4
# Steps of this many rows and more are prefills (or blend recomputations) for layout choice.
PREFILL_ROWS = 128


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


# Per projection kind (shape, gated, bias) and row counts, once per process: every model of a
# shape then takes the same path (and gives the same numbers), however noisy a later load was.
_PACKING_PAYS: dict[tuple[tuple[int, int, bool, bool], tuple[int, ...]], bool] = {}


def packing_pays(linear: Linear, rows: tuple[int, ...]) -> bool:
    """Whether the oneDNN layout runs this projection's forward faster than the plain layout
    on this machine, summed over steps of `rows` rows. It depends on the shape and the rows:
    packing won 1.3-2.4x at 4-16 rows on Qwen2.5-0.5B's (896 wide) and lost ~20% of a batch-1
    decode on SmolLM2-135M's (576 wide) when it also served 1-row steps; SmolLM2's gate/up
    product with its SwiGLU ran 12% slower packed than plain at 2,000 rows. So it is measured
    per projection kind and row band at the first load, not assumed."""
    if linear.weight is None or not onednn_usable(linear.weight):
        return False
    key = (linear.kind, rows)
    if key not in _PACKING_PAYS:
        _PACKING_PAYS[key] = _measure_packing(linear, rows)
    return _PACKING_PAYS[key]


@torch.inference_mode()
def _measure_packing(linear: Linear, rows: tuple[int, ...], repeats: int = 9) -> bool:
    """Both layouts' whole forward (a gated product's SwiGLU included, a 1-3 row step padded as
    it would be), built from the weight itself (`prepare` only reads it): the sum over `rows` of
    each layout's fastest of `repeats` interleaved runs, in this thread's CPU time, so that a run
    preempted by another process on a shared machine costs no more."""
    import time

    assert linear.weight is not None
    candidates: dict[bool, Linear] = {}
    for pack in (False, True):
        m = Linear(linear.in_features, linear.out_features, linear.bias is not None, linear.gated)
        m.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        m.prepare(pack, narrow_copy=False)
        candidates[pack] = m
    best = dict.fromkeys(candidates, 0.0)
    for n in rows:
        x = torch.randn(n, linear.in_features)
        runs: dict[bool, list[float]] = {pack: [] for pack in candidates}
        for _ in range(repeats):
            for pack, m in candidates.items():
                start = time.thread_time()
                m(x)
                runs[pack].append(time.thread_time() - start)
        for pack, times in runs.items():
            best[pack] += min(times)
    return best[True] < best[False]


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    padded = x.new_zeros(_MIN_ROWS, x.shape[1])
    padded[: x.shape[0]] = x
    return padded


# Inductor sums a reduction longer than this in a cascade (`CascadeSumHelper`, for accuracy)
# whose bookkeeping on every vector step slowed the 8960-wide down projection's 1-row product
# from ~9 to ~6 GB/s on one AVX2 EPYC core (bf16).
_CASCADE_LENGTH = 4096


def _sum_blocks(n: int) -> int:
    """Into how many equal blocks a reduction of n is split: the fewest (up to 64) of at most
    `_CASCADE_LENGTH` each; 1 where n is short, or has no such divisor (a prime n)."""
    return next((k for k in range(1, 65) if n % k == 0 and n // k <= _CASCADE_LENGTH), 1)


def multiply_sum(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x W^T + b` for a few rows of x, written so that inductor makes it one loop that streams
    the [out, in] weight row by row, each row's dot product in vector registers. Eager, it would
    materialise [rows, out, in]: only compiled graphs call it (`Linear.hold_fused_weight`).

    A row longer than `_CASCADE_LENGTH` is summed in blocks (float32 partial sums, then their
    sum): each block a plain vector reduction, not inductor's cascade. On the 8960-wide down
    projection (bf16, 1 row) that streamed at 9.0-9.2 GB/s against 6.2 unsplit (BLAS: 9.4)."""
    rows, n = x.shape
    k = _sum_blocks(int(n))
    if k == 1:
        y = (x[:, None, :] * weight[None]).sum(-1)
    else:
        blocks = (x.view(rows, 1, k, -1).float() * weight.view(1, -1, k, n // k).float()).sum(-1)
        y = blocks.sum(-1).to(x.dtype)
    return y if bias is None else y + bias


ProjectionKind = tuple[int, int, bool, bool]  # out_features, in_features, gated, bias


@torch.inference_mode()
def time_one_row_products(
    linears: list[Linear], repeats: int = 5
) -> dict[ProjectionKind, tuple[float, float]]:
    """Per projection kind (`Linear.kind`), CPU seconds of its 1-row products in one pass over
    `linears` in their order, each weight read once in turn as a decode step reads them (hundreds
    of MB, so from memory, not from cache, for every kind): (compiled `multiply_sum` on the held
    fused weights, the BLAS product in each one's narrow layout). Each call is timed in this
    thread's CPU time; per kind, the fastest of `repeats` interleaved passes. Per kind, because
    the winner differs by shape: on Qwen2.5-0.5B's shapes, on one AMD EPYC core, the multiply-sum
    read the lm_head at 24-25 GB/s against MKL's 10-19 but the down projection (4864 wide) at
    9-10 against MKL's 18-19."""
    import time

    fused = torch.compile(multiply_sum, dynamic=True)
    passes: dict[str, Callable[[Linear, torch.Tensor], torch.Tensor]] = {
        "fused": lambda m, x: fused(x, *m.fused),
        "blas": lambda m, x: m.plain_product(x, m.narrow),
    }
    xs = {m.in_features: torch.randn(1, m.in_features, dtype=m.fused[0].dtype) for m in linears if m.fused}
    for run in passes.values():  # compile, and page in every weight once
        for m in linears:
            run(m, xs[m.in_features])
    best = {name: dict.fromkeys((m.kind for m in linears), float("inf")) for name in passes}
    for _ in range(repeats):
        for name, run in passes.items():
            spent = dict.fromkeys(best[name], 0.0)
            for m in linears:
                start = time.thread_time()
                run(m, xs[m.in_features])
                spent[m.kind] += time.thread_time() - start
            for kind, seconds in spent.items():
                best[name][kind] = min(best[name][kind], seconds)
    return {kind: (best["fused"][kind], best["blas"][kind]) for kind in best["fused"]}


def plain_cpu_fp32(weight: torch.Tensor) -> bool:
    """Whether the transposed layout applies: measured on CPU float32 only."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


class Linear(nn.Module):
    """`y = x W^T + b` with `nn.Linear`'s `weight` [out, in] and `bias` [out]; x is [T, in].

    `gated=True` is a SwiGLU gate/up projection: `weight` holds the gate rows then the up rows and
    the result is `silu(gate) * up` ([T, out / 2]). Packed, that is two GEMMs with silu and the
    product fused in as oneDNN post-ops, so neither the merged [T, out] output nor the strided
    halves of it are materialised (the MLP measured 16% faster at 2048 rows, 14% at 256).

    `narrow` is the layout of steps of 1-3 rows, `wide` that of 4 to PREFILL_ROWS - 1 rows,
    `prefill` that of more: "dense", "transposed", "packed" or "upcast" (see the module docstring); all
    "dense" until `prepare()`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, gated: bool = False) -> None:
        super().__init__()
        if gated and out_features % 2:
            raise ValueError(f"a gated projection needs an even out_features, got {out_features}")
        self.in_features, self.out_features, self.gated = in_features, out_features, gated
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias: nn.Parameter | None = nn.Parameter(torch.empty(out_features)) if bias else None
        # After prepare(): the oneDNN weights (one, or gate and up) and their biases, and the
        # [in, out] copy. Plain attributes, not buffers: an opaque oneDNN tensor has no storage
        # to save or move, and the transposed copy is derived from `weight`.
        self.packed: tuple[torch.Tensor, ...] = ()
        self.packed_bias: tuple[torch.Tensor | None, ...] = ()
        self.weight_t: torch.Tensor | None = None
        self.plain_bias: torch.Tensor | None = None
        self.narrow = self.wide = self.prefill = "dense"
        # `hold_fused_weight()`: the [out, in] weight (and bias) of 1-3 row products written as a
        # multiply-sum under torch.compile; a view of `weight` where that is held, else a copy.
        self.fused: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # `model/quant.py` (engine option `weights`): a weight-only quantized product that
        # serves every row count, the dense weight dropped.
        self.quant: QuantProduct | None = None

    @property
    def kind(self) -> ProjectionKind:
        """What a layout's speed depends on: the shape, SwiGLU, a bias."""
        has_bias = self.bias is not None or self.plain_bias is not None
        has_bias = has_bias or (self.quant is not None and self.quant.bias is not None)
        return (self.out_features, self.in_features, self.gated, has_bias)

    @property
    def is_packed(self) -> bool:
        return bool(self.packed)

    def plain_layout(self) -> str:
        """The faster plain layout at 1-3 rows: transposed when the output is at least as wide
        as the input (the product then streams contiguous rows of W^T), else dense."""
        return "transposed" if self.out_features >= self.in_features else "dense"

    def prepare(self, pack: bool, narrow_copy: bool, pack_prefill: bool = True) -> tuple[str, str, str]:
        """Choose and build the layouts, once, after the weights are loaded; returns (narrow,
        wide, prefill). `pack`: the wide layout is oneDNN's (where that path applies).
        `narrow_copy`: a packed weight also keeps its plain layout for narrow steps (a second
        copy of it), which prefill steps then take too unless `pack_prefill`.

        The dense tensor is dropped when no layout uses it; it is only freed if nothing else
        holds it (a tied embedding does). In bfloat16 where torch's bf16 GEMM is its reference
        one (`upcast.bf16_gemm_emulated`), steps of 4 rows and more take "upcast"; elsewhere outside CPU
        float32 nothing changes."""
        if self.weight is not None and self.wide == "dense" and upcast.bf16_gemm_emulated(self.weight):
            self.wide = self.prefill = "upcast"
        if self.weight is None or self.wide != "dense" or not plain_cpu_fp32(self.weight):
            return self.narrow, self.wide, self.prefill
        plain = self.plain_layout()
        if pack and onednn_usable(self.weight):
            self.wide, self.narrow = "packed", plain if narrow_copy else "packed"
            self.prefill = "packed" if pack_prefill or not narrow_copy else plain
        else:
            self.wide = self.narrow = self.prefill = plain
        held = (self.narrow, self.wide, self.prefill)
        w = self.weight.detach()
        b = None if self.bias is None else self.bias.detach()
        if "packed" in held:
            if self.gated:
                half = self.out_features // 2
                self.packed = (_pack(w[:half]), _pack(w[half:]))
                self.packed_bias = (
                    (None, None) if b is None else (b[:half].contiguous(), b[half:].contiguous())
                )
            else:
                self.packed, self.packed_bias = (_pack(w),), (b,)
        if "transposed" in held:
            self.weight_t = w.t().contiguous()
        self.plain_bias = b  # the bias of the plain layouts, also once the dense tensor is dropped
        if "dense" not in held:
            self.weight = None
            self.bias = None
        return held

    def dense_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight [out, in] and bias, read back exactly from whichever layout is held (a
        view where the dense or transposed tensor is held, a new tensor from oneDNN's layout)."""
        if self.weight is not None:
            return self.weight.detach(), None if self.bias is None else self.bias.detach()
        if self.quant is not None:
            return self.quant.dense(self.in_features, self.quant.dtype), self.quant.bias
        bias = self.plain_bias
        if self.weight_t is not None:
            return self.weight_t.t(), bias
        return torch.cat([p.to_dense() for p in self.packed]), bias

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The projection of x [T, in], plus `residual` [T, out] when given (fused into the GEMM
        when packed, so the sum costs no extra pass over the output)."""
        rows = x.shape[0]
        layout = self.narrow if rows < _MIN_ROWS else self.wide if rows < PREFILL_ROWS else self.prefill
        if self.quant is not None:
            if self.gated or residual is not None:
                fused = self.quant.with_epilogue(x, self.gated, residual)
                if fused is not None:
                    return fused
            y = self.quant(x)
        elif self.fused is not None and rows < _MIN_ROWS and torch.compiler.is_compiling():
            y = multiply_sum(x, *self.fused)
        elif layout == "packed":
            if rows >= _MIN_ROWS:
                return self._packed_forward(x, residual)
            res = None if residual is None else _pad_rows(residual)
            return self._packed_forward(_pad_rows(x), res)[:rows]
        else:
            y = self.plain_product(x, layout)
        if self.gated:
            gate, up = y.split(self.out_features // 2, dim=-1)
            y = F.silu(gate) * up
        return y if residual is None else y + residual

    def plain_product(self, x: torch.Tensor, layout: str) -> torch.Tensor:
        """`x W^T + b` through BLAS in a plain layout ("transposed", "dense" or "upcast")."""
        if layout == "transposed":
            assert self.weight_t is not None
            bias = self.plain_bias
            return torch.mm(x, self.weight_t) if bias is None else torch.addmm(bias, x, self.weight_t)
        assert self.weight is not None
        if layout == "upcast":
            return upcast.upcast_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def hold_fused_weight(self, shared: torch.Tensor | None = None) -> bool:
        """Hold the [out, in] weight for 1-3 row products under torch.compile (`multiply_sum`);
        returns whether it is held. CPU float32, where `prepare` chose the layouts, and bfloat16.
        A copy, unless the dense layout is held already (a transposed narrow layout drops it; in
        bfloat16 it is the only one) or `shared` is a contiguous tensor equal to the weight that is
        kept anyway (a tied embedding's)."""
        if self.narrow == "packed" or not self.is_prepared_cpu():
            return False
        weight, bias = self.dense_weight()
        if shared is not None and shared.is_contiguous() and torch.equal(shared, weight):
            weight = shared
        self.fused = (weight.contiguous(), bias)
        return True

    def is_prepared_cpu(self) -> bool:
        """Whether the weight is held in a plain CPU layout the fused form reads: float32 (after
        `prepare`), or bfloat16, whose dense weight is the [out, in] form itself (no copy)."""
        held = self.weight if self.weight is not None else self.weight_t
        if held is not None and held.device.type == "cpu" and held.dtype == torch.bfloat16:
            return True
        return held is not None and plain_cpu_fp32(held)

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
        has_bias = self.kind[3] or any(b is not None for b in self.packed_bias)
        held = (
            f"quant={self.quant.describe()}"
            if self.quant is not None
            else f"narrow={self.narrow}, wide={self.wide}, prefill={self.prefill}"
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={has_bias}, "
            f"gated={self.gated}, {held}"
        )
