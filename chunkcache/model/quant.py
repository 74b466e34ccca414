"""Weight-only quantized products on CPU: a GGUF's own quantized weights served as they come
(engine option `weights`: `native`), or a float checkpoint's quantized to int8 per output channel
(`int8`), instead of dequantizing every weight to the model's dtype at load (`dense`).

A batch-1 decode step reads every weight once, so the bytes held per weight bound it; a
dequantized 4-bit file holds 8x (float32) or 4x (bfloat16) the bytes it came with. Decode's few-row
products run in `qkernel` (an AVX2 + FMA C kernel, float32 activations, float32 int4 scales and
minimums: the file's values exactly) where it is available, and otherwise in torch's two CPU
kernels for weight-only products, which both take bfloat16 activations (their float32 path
measured 10-70x slower on an AVX2 EPYC, their float16 one ~15x; benchmarks/history/
RESULTS-narrative.md "Quantized weights: a GGUF's own codes served"). Both read the same held codes:

- `_weight_int4pack_mm_for_cpu`: 4-bit codes q in [0, 16) with a scale s and a zero z per group
  of 32 inputs and output channel, w = (q - 8) * s + z (found by a probe against a
  dequantize-then-matmul: neither q * s + z nor q * s - z). Q4_0 (w = d (q - 8)), Q4_1
  (w = d q + m) and Q4_K (w = d sc q - dmin m per sub-block of 32) are all w = scale * q + min
  per group of 32 with the file's own codes, so they go in *with their codes unchanged*:
  s = scale, z = min + 8 scale. For torch's kernel s and z are rounded to bfloat16 (its dtype);
  `qkernel` reads the same packed codes with float32 scale and minimum, unrounded.
- `_weight_int8pack_mm` (and `qkernel`'s int8 product): int8 codes with one scale per output
  channel. Q8_0's scale is per block of 32 and Q5_x's per 16-32, so no GGUF type fits it exactly:
  those are re-quantized per channel from the file's dequantized values, and the error that adds
  is measured and logged. Where `qkernel` serves, Q8_0 and (with `int8_activations`) Q6_K are the
  file's own blocks instead, exactly (`quant_blocks`).

Other types (F32/F16/BF16, Q2_K, Q3_K) stay dense (today's path), the quantized ones with a
warning naming the type. A merged projection (q/k/v, gate/up) whose parts differ in type (the
1.5B's Q4_K q/k beside a Q6_K v) is one `QuantProduct` of several parts, each in its own form,
outputs concatenated.

Both kernels are GEMV-shaped and lose to a dense float32 GEMM from a few dozen rows, so products
of many rows (prefill) multiply float32 blocks dequantized from the same codes instead
(`model/dequant.py`): no dense copy of a weight is held.

The token embedding is held as the file's own blocks (`quant_embedding.QuantEmbedding`), each step dequantizing
only the rows it looks up with gguf's function, so its values are the dense table's bit for bit;
and a native load never dequantizes the tensors these forms replace (`dense_at_load`), so no
dense float32 model exists while loading.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from chunkcache.malloc import huge_page_copy, huge_page_empty
from chunkcache.model import dequant, upcast
from chunkcache.model.gguf_blocks import GROUP, INT4_TYPES, RawTensor, affine_int4, q4k_superblocks
from chunkcache.model.kernels import qkernel, quant_blocks
from chunkcache.model.kernels.quant_blocks import BlocksPart
from chunkcache.model.quant_names import EMBEDDING, module_of, source_names

logger = logging.getLogger(__name__)

# The engine option `weights` (config.WEIGHTS is this tuple); `auto`: model/weight_forms.py.
WEIGHTS = ("dense", "native", "int8", "auto")
INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K")  # re-quantized per channel
# Every type a quantized form takes: Q6_K and Q8_0 their own blocks (`quant_blocks.own_blocks`),
# or int8.
QUANTIZED_TYPES = (*INT4_TYPES, *INT8_TYPES, "Q6_K")
_FLOAT_TYPES = ("F32", "F16", "BF16")
# Weight rows sampled per tensor to measure a conversion's error (the log line at load).
_ERROR_ROWS = 64
# Rows of a GGUF tensor dequantized at once while it is re-quantized (`Int8Part.of_raw`).
CONVERT_ROWS = 1024


class Int4Part:
    """Output rows whose weight is 4-bit codes (torch's int4 packing, the one copy held) with a
    scale and a minimum per group of 32: where `qkernel` serves the few-row products (`native`),
    float32, or a Q4_K file's own factors (`superblocks`: 3 bytes per 32 weights instead of 8,
    the same values); else the bfloat16 scale and zero torch's kernel takes."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor,
        native: bool | None = None,
        int8_x: bool = False,
        superblocks: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        """`qkernel` serves where it is available and the rows are whole tiles of the packing it
        reads (never otherwise, whatever `native` says); `native=False` keeps torch's kernel.
        `int8_x`: the kernel's 1-row products and a decode step's round x to int8 per block of 32
        (engine option `int8_activations`, `qkernel.decode_step`); the default keeps float32 x.
        `superblocks`: (d, dmin, sc, m) per row (`q4k_superblocks`) of the same weight, held
        instead of float32 factors."""
        self.rows, self.int8_x = q.shape[0], int8_x
        self.packed = huge_page_copy(  # streamed by decode: malloc.huge_page_copy
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
        )
        self.native = native is not False and qkernel.available() and dequant.int4_blocks_apply(self.rows)
        self.multipliers: torch.Tensor | None = None
        if self.native and superblocks is not None and q.shape[1] % 256 == 0:
            self.factors, self.multipliers = qkernel.pack_superblocks(*(t.t() for t in superblocks))
        elif self.native:  # [tiles, groups, 2, 32]: qkernel.pack_factors
            self.factors = qkernel.pack_factors(scale.t(), minimum.t())
        else:
            zero = minimum + 8 * scale  # the kernel's w = (q - 8) s + z
            self.scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()

    def affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, minimum) float32 [groups, rows] of the weight served: w = scale q + minimum
        (copies: ~1 ms for the 1.5B's gate/up, against the ~0.3 s GEMM of a 256-row prefill)."""
        if self.native:
            return qkernel.unpack_factors(self.factors, self.multipliers)
        s = self.scale_zeros[..., 0].float()
        return s, self.scale_zeros[..., 1].float() - 8 * s

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] times the weight, in x's dtype: the kernel below `dequant.INT4_MIN_ROWS`
        rows (`NATIVE_INT4_MIN_ROWS` where qkernel serves or the blocks are bfloat16), GEMMs over
        dequantized blocks from it (where the packing is known): float32, or bfloat16 for a
        bfloat16 x on a CPU with a native bfloat16 GEMM (`qkernel.bf16_blocks`)."""
        if x.shape[0] < dequant.NATIVE_INT4_MIN_ROWS:  # the kernel at any threshold: decode's path
            return self.kernel(x).to(x.dtype)
        bf16 = not self.native and x.dtype == torch.bfloat16 and qkernel.bf16_blocks()
        threshold = dequant.NATIVE_INT4_MIN_ROWS if self.native or bf16 else dequant.INT4_MIN_ROWS
        if x.shape[0] >= threshold and dequant.int4_blocks_apply(self.rows):
            if self.native:  # qkernel's dequantization over the factors it holds
                return dequant.blockwise_product(x.float(), self.rows, self._block()).to(x.dtype)
            if bf16:  # bfloat16 blocks for the CPU's bfloat16 GEMM
                return dequant.blockwise_product(x, self.rows, self._block(torch.bfloat16))
            return dequant.int4_product(x.float(), self.packed, *self.affine()).to(x.dtype)
        return self.kernel(x).to(x.dtype)

    def _block(self, dtype: torch.dtype = torch.float32) -> Callable[[int, int], torch.Tensor]:
        """`dequant.blockwise_product`'s blocks in one buffer: float32 from
        `qkernel.int4_dequantize` (the kernel's factors), bfloat16 from `int4_dequantize_bf16`
        (torch's packing and scales)."""
        cols = self.packed.shape[1] * 2
        buffer = torch.empty(cols * dequant.block_rows(self.rows, cols, dtype), dtype=dtype)
        if dtype == torch.bfloat16:
            return lambda start, rows: qkernel.int4_dequantize_bf16(
                self.packed, self.scale_zeros, start, buffer[: cols * rows].view(cols, rows)
            )
        return lambda start, rows: qkernel.int4_dequantize(
            self.packed, self.factors, self.multipliers, start, buffer[: cols * rows].view(cols, rows)
        )

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel alone: `qkernel`'s (float32 x and y, `qkernel.MAX_ROWS` rows a call), or
        torch's (bfloat16 x and y)."""
        if self.native:
            return qkernel.int4(x, self.packed, self.factors, self.multipliers, self.int8_x)
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP, self.scale_zeros)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        if not self.native:
            return (self.packed, self.scale_zeros)
        return (
            (self.packed, self.factors)
            if self.multipliers is None
            else (self.packed, self.factors, self.multipliers)
        )


class Int8Part:
    """Output rows quantized to int8 with one bfloat16 scale per row (symmetric, absmax / 127)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, int8_x: bool = False) -> None:
        self.rows, self.codes, self.scales = codes.shape[0], huge_page_copy(codes.contiguous()), scales
        self.native = qkernel.available()  # whether `qkernel` serves the few-row products
        self.int8_x = int8_x  # as Int4Part's

    @classmethod
    def quantize(cls, weight: torch.Tensor, int8_x: bool = False) -> Int8Part:
        """`weight` per output channel; row by row, so a tensor converted in row blocks and
        concatenated is bit for bit the tensor converted whole."""
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16)
        return cls(torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8), scale, int8_x)

    @classmethod
    def of_raw(cls, raw: RawTensor, int8_x: bool = False) -> Int8Part:
        """A GGUF tensor re-quantized per channel from its dequantized values, `CONVERT_ROWS` rows
        at a time: a whole float32 copy of a large tensor (the 1.5B's Q6_K lm_head: 0.93 GB,
        and ~3x that in the conversion's temporaries) would set the load's peak. Each block is
        written into the whole tensor's codes (no list of blocks concatenated: twice the codes)."""
        rows, cols = raw.shape
        codes, scales = torch.empty(rows, cols, dtype=torch.int8), torch.empty(rows, dtype=torch.bfloat16)
        for start in range(0, rows, CONVERT_ROWS):
            block = cls.quantize(torch.from_numpy(raw.dequantize(slice(start, start + CONVERT_ROWS))))
            codes[start : start + block.rows], scales[start : start + block.rows] = block.codes, block.scales
        return cls(codes, scales, int8_x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] times the weight, in x's dtype: the kernel below `dequant.INT8_MIN_ROWS`
        rows, GEMMs over blocks of converted codes from it (bfloat16 for a bfloat16 x where
        `dequant.bf16_gemm()`, else float32)."""
        if x.shape[0] >= dequant.INT8_MIN_ROWS:
            if x.dtype == torch.bfloat16 and dequant.bf16_gemm():
                return dequant.int8_product(x, self.codes, self.scales)
            return dequant.int8_product(x.float(), self.codes, self.scales).to(x.dtype)
        return self.kernel(x).to(x.dtype)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel alone: `qkernel`'s (float32 x and y) or torch's (bfloat16 x and y)."""
        if self.native:
            return qkernel.int8(x, self.codes, self.scales, self.int8_x)
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scales)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes, self.scales)


class DensePart:
    """Output rows kept as a float weight (a type no kernel takes): the model's dtype, F.linear."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.rows, self.weight = weight.shape[0], weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x in the weight's dtype; a bfloat16 weight on AMX tiles where they serve (`qkernel_amx.c`:
        SmolLM2's tied lm_head, 56 MB, read in 2.2 against torch's 4.5-4.8 ms a decode step),
        else of many rows in float32 blocks where the CPU has no bfloat16 GEMM
        (`upcast.dense_product`)."""
        if x.dtype == torch.bfloat16 and self.on_tiles():
            return qkernel.amx_matmul(x, self.weight)
        return upcast.dense_product(x, self.weight, None)

    def on_tiles(self) -> bool:
        """Whether a bfloat16 x is multiplied on AMX tiles (`qkernel.amx_takes`)."""
        return qkernel.amx_takes(self.weight)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)


Part = Int4Part | Int8Part | BlocksPart | DensePart


class QuantProduct:
    """`x W^T + b` of a Linear whose weight is held in quantized parts of output rows (in order).
    Each part takes x in the model's dtype and gives y in it: a few rows (decode) through the
    weight-only kernels (`qkernel`'s float32 one, else torch's with bfloat16 x and y), many
    (prefill) through float32 GEMMs over dequantized blocks of its weight (`model/dequant.py`),
    rounded once to x's dtype."""

    def __init__(self, parts: list[Part], bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.parts, self.bias, self.dtype = parts, bias, dtype  # dtype: the model's (dense_weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ys = [p(x) for p in self.parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y if self.bias is None else y + self.bias

    def with_epilogue(
        self, x: torch.Tensor, gated: bool, residual: torch.Tensor | None
    ) -> torch.Tensor | None:
        """`Linear.forward`'s product and its SwiGLU (`gated`) or residual add in one C call (the
        two or three operators after it are ~15-40 us in a decode step): an x of a few rows
        (bfloat16 or float32) and one part of the file's blocks (`qkernel.blocks_rows`); None where
        that does not serve."""
        part = self.parts[0]
        if len(self.parts) > 1 or self.bias is not None or not isinstance(part, BlocksPart):
            return None
        if x.dtype not in qkernel.ROW_TYPES or not part.short(x):
            return None
        return qkernel.blocks_rows(x, part.qtype, part.blocks, part.int8_x, residual, gated)

    def dense(self, in_features: int, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] the parts multiply by, read back through them (the identity's
        product, in row blocks), in `dtype`: blocks of up to 1,024 rows, which take the
        dequantized blocks (exact in float32) from each form's threshold and the kernels (their
        bfloat16 rounding) below it or where the int4 packing is not read. For the code that
        needs a dense weight (blend's K rows), not for serving."""
        cols = []
        for start in range(0, in_features, 1024):
            eye = torch.zeros(min(1024, in_features - start), in_features, dtype=dtype)
            eye[:, start : start + eye.shape[0]].fill_diagonal_(1)
            cols.append(torch.cat([p(eye) for p in self.parts], -1))
        return torch.cat(cols).t().contiguous()

    def qkernel_ops(self) -> bool:
        """Whether a compiled graph would call `qkernel`'s ops for these parts' products: the
        native parts' few-row ones, a dense bfloat16 part's on AMX tiles."""
        return any(p.on_tiles() if isinstance(p, DensePart) else p.native for p in self.parts)

    def tensors(self) -> list[torch.Tensor]:
        held = [t for p in self.parts for t in p.tensors()]
        return held if self.bias is None else [*held, self.bias]

    def describe(self) -> str:
        return "+".join(
            p.qtype.lower() if isinstance(p, BlocksPart) else type(p).__name__.removesuffix("Part").lower()
            for p in self.parts
        )


@dataclass
class Conversion:
    """What one type became, and the error that added (relative Frobenius norm of the weight,
    over up to `_ERROR_ROWS` sampled rows per tensor), for the log line at load."""

    form: str
    error_sq: float = 0.0
    norm_sq: float = 0.0
    tensors: int = 0

    @property
    def error(self) -> float:
        return (self.error_sq / self.norm_sq) ** 0.5 if self.norm_sq else 0.0


@dataclass
class _Form:
    """One GGUF tensor in the form a part holds it: the part class, the tensors that class is
    built from (stacked with the next tensors' of the same form), the sampled rows' values as
    that form serves them (to measure its error against the file's) and the form's name in the
    log line."""

    kind: type
    args: list[torch.Tensor]
    served: np.ndarray
    name: str


def native_parts(
    raws: list[RawTensor], dtype: torch.dtype, report: dict[str, Conversion], int8_x: bool = False
) -> list[Part]:
    """The parts of a (merged) projection made of the GGUF tensors `raws`, in order; consecutive
    tensors of the same form share one part (one kernel call). `report` gathers per type the form
    it took and the error measured against gguf's dequantization. `int8_x`: the quantized parts'
    1-row and decode-step products round x to int8 (`Int4Part`)."""
    # ((part class, blocks' type), its arguments per tensor, rows to stack)
    pieces: list[tuple[tuple[type, str | None], list[list[torch.Tensor]]]] = []
    for raw in raws:
        rows = slice(0, min(_ERROR_ROWS, raw.shape[0]))
        reference = raw.dequantize(rows)
        form = _native_form(raw, rows, dtype, report, int8_x)
        entry = report.setdefault(raw.qtype, Conversion(form.name))
        entry.error_sq += float(np.square(form.served - reference).sum())
        entry.norm_sq += float(np.square(reference).sum())
        entry.tensors += 1
        key = (form.kind, raw.qtype if form.kind is BlocksPart else None)  # blocks of one type share a part
        if pieces and pieces[-1][0] == key:
            pieces[-1][1].append(form.args)
        else:
            pieces.append((key, [form.args]))
    return [_stacked_part(kind, blocks_type, group, int8_x) for (kind, blocks_type), group in pieces]


def _native_form(
    raw: RawTensor, rows: slice, dtype: torch.dtype, report: dict[str, Conversion], int8_x: bool
) -> _Form:
    """The form `raw` takes, the most exact one this machine serves first: the file's own blocks
    (where `qkernel` holds that type), its own 4-bit codes, int8 per channel (re-quantized), or
    dense in `dtype`. `report` only says whether the type was seen already (warned about once)."""
    if quant_blocks.own_blocks(raw.qtype, int8_x) and qkernel.holds(raw.qtype, raw.shape[0]):
        part = BlocksPart.of_raw(raw, int8_x)
        return _Form(
            BlocksPart, [part.blocks], part.dequantize(rows).numpy(), f"{raw.qtype}'s own blocks (exact)"
        )
    if raw.qtype in INT4_TYPES and raw.shape[1] % GROUP == 0:
        return _int4_form(raw, rows)
    if raw.qtype in QUANTIZED_TYPES:  # INT8_TYPES and Q6_K, not held as their blocks
        part = Int8Part.of_raw(raw, int8_x)
        served = (part.codes[rows].float() * part.scales[rows].float()[:, None]).numpy()
        return _Form(Int8Part, [part.codes, part.scales], served, "int8 per channel (re-quantized)")
    if raw.qtype not in _FLOAT_TYPES and raw.qtype not in report:
        logger.warning(
            "weights native: %s (%s) has no quantized kernel here; served dequantized",
            raw.qtype,
            raw.name,
        )
    weight = torch.from_numpy(raw.dequantize()).to(dtype)
    return _Form(
        DensePart, [weight], weight[rows].float().numpy(), f"dense {str(dtype).removeprefix('torch.')}"
    )


def _int4_form(raw: RawTensor, rows: slice) -> _Form:
    """A 4-bit type's own codes with its scale and minimum per group (and Q4_K's superblocks).
    The values served are those of the kernel that will run: `qkernel`'s float32 factors where it
    serves this shape, else torch's kernel's, whose scale and zero are rounded to bfloat16."""
    q, scale, minimum = (torch.from_numpy(a) for a in affine_int4(raw))
    args = [q, scale, minimum]
    if raw.qtype == "Q4_K":
        args += [torch.from_numpy(a) for a in q4k_superblocks(raw)]
    if qkernel.available() and raw.shape[0] % qkernel.TILE == 0:  # float32 factors
        s, m = (a[rows].repeat_interleave(GROUP, 1) for a in (scale, minimum))
        served = (q[rows].float() * s + m).numpy()
        return _Form(Int4Part, args, served, "int4 (own codes, float32 scales and minimums)")
    s = scale[rows].to(torch.bfloat16).float().repeat_interleave(GROUP, 1)
    z = (minimum[rows] + 8 * scale[rows]).to(torch.bfloat16).float().repeat_interleave(GROUP, 1)
    served = ((q[rows].float() - 8) * s + z).numpy()
    return _Form(Int4Part, args, served, "int4 (own codes, bfloat16 scales and zeros)")


def _stacked_part(kind: type, blocks_type: str | None, group: list[list[torch.Tensor]], int8_x: bool) -> Part:
    """One part of class `kind` from consecutive tensors' arguments `group`, each argument stacked
    along the outputs (file blocks into huge pages, `_joined`)."""
    if kind is Int4Part and len({len(a) for a in group}) > 1:  # Q4_K beside another 4-bit type
        group = [a[:3] for a in group]
    join = _joined if kind is BlocksPart else torch.cat
    args = [join(column) for column in zip(*group, strict=True)]
    if kind is DensePart:
        return DensePart(*args)
    if kind is Int4Part:
        return Int4Part(*args[:3], int8_x=int8_x, superblocks=tuple(args[3:]) or None)
    if kind is BlocksPart:
        return BlocksPart(*args, blocks_type, int8_x=int8_x)
    return Int8Part(*args, int8_x=int8_x)


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Consecutive tensors' file blocks as one (a merged projection's part), held in huge pages:
    a decode step streams them (`malloc.huge_page_empty`)."""
    if len(tensors) == 1:
        return huge_page_copy(tensors[0])
    out = huge_page_empty((sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), torch.uint8)
    return torch.cat(tensors, out=out)


def log_conversions(report: dict[str, Conversion]) -> None:
    for qtype, c in sorted(report.items()):
        logger.info(
            "weights native: %d %s tensor(s) -> %s; weight error %.2e relative to the file's values",
            c.tensors, qtype, c.form, c.error,
        )  # fmt: skip


def embedding_quantized(qtype: str, tied: bool, dense_modules: frozenset[str] = frozenset()) -> bool:
    """Whether `native` weights serve the token embedding from its file blocks
    (`QuantEmbedding`): always, except where it is tied to an lm_head that reads its dense
    weight (a type without an exact kernel here: see `apply_weights`; or an lm_head `weights
    auto` keeps dense, `dense_modules`). A tied Q8_0 table (SmolLM2's) is one copy of the file's
    blocks for both (`quant_blocks`)."""
    exact = qtype in INT4_TYPES or quant_blocks.own_blocks(qtype, int8_x=False)
    return not tied or (exact and "lm_head" not in dense_modules)


def dense_at_load(name: str, qtype: str, tied: bool, dense_modules: frozenset[str] = frozenset()) -> bool:
    """Whether a `native` load needs the checkpoint tensor `name` (transformers name, GGUF type
    `qtype`) dequantized to a dense tensor. The projections' weights are built from the file's
    blocks (`apply_weights`), and a quantized embedding too, so those are never dequantized
    whole (a shape on the meta device stands in for them): the load's peak is then the
    quantized model's, not a dense float32 one's (8.19 GB for the 1.5B before this). The
    projections in `dense_modules` (`weights auto`'s dense choices) are loaded dense, and only
    those: a mixed load holds no dense copy of its native projections."""
    if name == EMBEDDING:
        return not embedding_quantized(qtype, tied, dense_modules)
    module = module_of(name)
    return module is None or module in dense_modules


def apply_weights(
    net: torch.nn.Module,
    weights: str,
    raw: Callable[[str], RawTensor] | None,
    tied: bool,
    dense_modules: frozenset[str] = frozenset(),
    int8_x: bool = False,
) -> None:
    """Give every Linear of `net` a quantized product and drop its dense weight: `native`, the
    GGUF tensors `raw(name)` in their own forms, and the token embedding its file blocks where
    `embedding_quantized`; `int8`, the loaded weight per output channel. The dense weights are
    read here, so they must be the final ones (tied, merged); under `native` the ones
    `dense_at_load` skips are meta tensors, of which only the dtype is read. The Linears named
    in `dense_modules` keep their dense weight (`weights auto`). `int8_x`: the kernel's 1-row
    products and a decode step's round x to int8 per block of 32 (engine option
    `int8_activations`)."""
    from chunkcache.model.linear import Linear
    from chunkcache.model.quant_embedding import QuantEmbedding

    report: dict[str, Conversion] = {}
    lm_head_parts: list[Part] = []
    for name, m in net.named_modules():
        if not isinstance(m, Linear) or m.weight is None or name in dense_modules:
            continue
        weight, bias = m.weight.detach(), None if m.bias is None else m.bias.detach()
        sources = [] if raw is None else [raw(n) for n in source_names(name, tied)]
        if weights == "int8":
            parts: list[Part] = [Int8Part.quantize(weight, int8_x)]
        elif name == "lm_head" and not embedding_quantized(sources[0].qtype, tied, dense_modules):
            # The embedding's dense weight is held anyway for row lookups: the tied lm_head reads
            # it exactly at no memory cost, where int8 per channel measured worse on SmolLM2 (its
            # Q8_0 embedding, before `qkernel` held Q8_0 as its blocks: top-5 log-probs within
            # 0.29 of transformers' over 4 prompts x 16 greedy tokens with it, 0.54 and one token
            # changed with an int8 copy).
            parts = [DensePart(weight)]
            report.setdefault(
                f"{sources[0].qtype} (tied lm_head)", Conversion("the embedding's dense weight")
            )
        else:
            parts = native_parts(sources, weight.dtype, report, int8_x)
        m.quant = QuantProduct(parts, bias, weight.dtype)
        if name == "lm_head":
            lm_head_parts = parts
        m.weight = None
        m.bias = None
    if weights == "native" and raw is not None:
        embedding = raw(EMBEDDING)
        if embedding_quantized(embedding.qtype, tied, dense_modules):
            # A tied lm_head held as the same blocks: its bytes serve the lookups too (not when
            # regrouped in tiles: the lookups read the file's order).
            shared = [
                p.blocks
                for p in lm_head_parts
                if tied and isinstance(p, BlocksPart) and p.qtype not in qkernel.TILED
            ]
            net.embed_tokens = QuantEmbedding(embedding, net.embed_tokens.weight.dtype, *shared)
            held = "the tied lm_head's blocks" if shared else "the file's blocks"
            report.setdefault(
                f"{embedding.qtype} (embedding)", Conversion(f"{held}, rows dequantized per lookup")
            )
    log_conversions(report)
