"""`weights auto`: each kind of projection served in the form of its weights that measured
fastest at load, dense or native (`model/quant.py`).

Which is faster depends on the CPU, the dtype, the GGUF type and the shape: on the 1.5B
(Q4_K_M, AVX2 EPYC, bfloat16) native weights decode ~1.5x faster than dense and prefill alike;
on SmolLM2 in float32 they decode faster but prefill ~20% slower (benchmarks/history/
RESULTS-narrative.md, "Quantized weights: a GGUF's own codes served" and after). So
`auto` times both forms of one projection per group (a kind: qkv, o, gate_up, down, lm_head,
and the GGUF types of its tensors: the 1.5B's down projection is Q6_K in half its layers and
Q4_K in the others: the file's Q6_K blocks and int4 once native), on the group's first layer, and serves the
whole group in the form it chose. The dense candidate is built by the code that builds the
served one (`llama.prepare_projection`: transposed or oneDNN-packed layouts in float32, the
"upcast" blocks in bfloat16 where the CPU has no bf16 GEMM), from the values a dense load holds.

The rule (`choose`): native, unless dense is faster by more than `MARGIN` at every size timed.
Native holds 2-8x fewer bytes per weight (less resident memory, fewer bytes read per decode
step), so dense must win speed outright to be worth its memory; and the margin keeps the choice
stable under timing noise (a shared machine moves a product's time by several percent between
runs): forms within 10% of each other go native on every restart. A group timed near the margin
can still flip between restarts, and with it the served numbers (the forms' logits differ
slightly); the model identity the KV tiers key entries by binds the resolved forms
(`LlamaForCausalLM.weights_form`), so replicas that chose differently never share KV.

Sizes: one row (a batch-1 decode step), and `linear.PREFILL_ROWS` = 128 rows, the smallest
product the model treats as prefill. There native's per-product cost (dequantizing its blocks
once, whatever the rows) weighs most against the GEMM both forms then run in float32, so a
native win or tie at 128 rows holds at longer prefills. The lm_head is timed at one row only:
its prefill rows are the last token of each prompt. Every timed product starts with its weight
out of the caches (`_EVICT_FLOATS` written first), as a decode step reads every weight from
memory. Timing runs before the weights are read: ~1-3 s of a load (benchmarks/RESULTS.md
"`weights auto`").
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from chunkcache.model.gguf_blocks import RawTensor
from chunkcache.model.linear import PREFILL_ROWS, Linear
from chunkcache.model.llama import prepare_projection
from chunkcache.model.quant import (
    CONVERT_ROWS,
    QUANTIZED_TYPES,
    QuantProduct,
    embedding_quantized,
    native_parts,
)
from chunkcache.model.quant_names import source_names
from chunkcache.model.spec import ModelSpec

logger = logging.getLogger(__name__)

MARGIN = 1.10  # dense must be this much faster at every size to be chosen
REPEATS = 7  # timed products per form and size (the fastest counts), after one warm-up
# Rows of the lm_head timed (its vocabulary is 49k-152k rows): 32,768 x 1,536 is 50-200 MB in
# either form, read from memory as the whole one is; converting the 1.5B's whole Q6_K lm_head
# twice (dense, int8) made `auto` ~27 s of its load, this ~1/5 of that (benchmarks/history/
# RESULTS-narrative.md "`weights auto`: the faster form per projection kind, measured at load").
LM_HEAD_ROWS = 32768
_EVICT_FLOATS = 16 * 2**20  # 64 MB written before each timed product: beyond a 32 MB L3
_KINDS = {
    "self_attn.qkv_proj": "qkv",
    "self_attn.o_proj": "o",
    "mlp.gate_up_proj": "gate_up",
    "mlp.down_proj": "down",
}


def fallback(device: torch.device, gguf: bool, adapter: bool) -> str | None:
    """Why `auto` serves dense weights without timing anything, or None: the quantized kernels
    are CPU kernels, only a GGUF has quantized weights to keep, and an adapter merges into
    dense weights."""
    if device.type != "cpu":
        return f"the quantized kernels are CPU kernels, the device is {device.type}"
    if not gguf:
        return "not a GGUF file: no quantized weights to keep"
    if adapter:
        return "a LoRA adapter is merged into dense weights"
    return None


def kind_of(module: str) -> str:
    """qkv, o, gate_up, down or lm_head: the projection kind of the Linear named `module`."""
    return "lm_head" if module == "lm_head" else _KINDS[module.split(".", 2)[2]]


def choose(dense: Sequence[float], native: Sequence[float], margin: float = MARGIN) -> str:
    """ "dense" where dense took less than 1 / `margin` of native's time at every size, else
    "native" (the module docstring argues the rule)."""
    faster = all(d * margin < n for d, n in zip(dense, native, strict=True))
    return "dense" if faster else "native"


@dataclass(frozen=True)
class Timing:
    """One group's measurement: CPU seconds of a product per size (1 row, then PREFILL_ROWS
    where timed), in each form; and the projections the choice applies to."""

    kind: str
    types: tuple[str, ...]
    modules: tuple[str, ...]
    dense: tuple[float, ...]
    native: tuple[float, ...]

    @property
    def choice(self) -> str:
        return choose(self.dense, self.native)

    @property
    def label(self) -> str:
        return f"{self.kind} [{', '.join(self.types)}]"

    def line(self) -> str:
        sizes = ", ".join(
            f"{rows} row{'s' if rows > 1 else ''}: dense {d * 1e3:.2f} ms, native {n * 1e3:.2f} ms"
            for rows, d, n in zip((1, PREFILL_ROWS), self.dense, self.native, strict=False)
        )
        return f"{self.label}, {len(self.modules)} projection(s): {sizes} -> {self.choice}"


@dataclass(frozen=True)
class Forms:
    """What `auto` resolved to: the timings per group, or why everything is dense untimed."""

    timings: tuple[Timing, ...]
    why_dense: str | None = None

    @property
    def dense_modules(self) -> frozenset[str]:
        """The projections served dense; every other one in its native form."""
        return frozenset(m for t in self.timings if t.choice == "dense" for m in t.modules)

    @property
    def served(self) -> str:
        """The load this is: "dense" (nothing native: a dense load's model exactly) or "native"
        (with `dense_modules` dense)."""
        if self.why_dense is not None or all(t.choice == "dense" for t in self.timings):
            return "dense"
        return "native"

    @property
    def form(self) -> str:
        """`LlamaForCausalLM.weights_form`: the served form, naming the groups a mixed load
        serves dense (which, with the file, decide the KV)."""
        dense = [t.label for t in self.timings if t.choice == "dense"]
        if self.served == "dense" or not dense:
            return self.served
        return f"native; dense {'; '.join(dense)}"

    def summary(self) -> str:
        """For the load's log line."""
        if self.why_dense is not None:
            return f"auto -> dense ({self.why_dense})"
        return f"auto -> {self.served} ({'; '.join(f'{t.label} {t.choice}' for t in self.timings)})"


def projections(spec: ModelSpec) -> list[str]:
    """Every projection of the model by its Linear's name, layer by layer, then the lm_head."""
    return [f"layers.{i}.{rest}" for i in range(spec.num_layers) for rest in _KINDS] + ["lm_head"]


def resolve(
    qtype: Callable[[str], str],
    raw: Callable[[str], RawTensor],
    spec: ModelSpec,
    dtype: torch.dtype,
    narrow_weights: bool,
    int8_x: bool = False,
) -> Forms:
    """Time each group of projections (kind and GGUF types; `qtype(name)` gives a checkpoint
    tensor's type, `raw(name)` its blocks) in both forms (`time_forms`), on its
    first layer, and choose per group; one log line per group. Groups native would hold dense
    anyway (float types; a tied lm_head that reads a dense embedding) are not timed: they are
    the same either way."""
    tied = spec.tie_word_embeddings
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for module in projections(spec):
        types = tuple(qtype(n) for n in source_names(module, tied))
        if not any(t in QUANTIZED_TYPES for t in types):
            continue
        if module == "lm_head" and not embedding_quantized(types[0], tied):
            continue
        groups.setdefault((kind_of(module), types), []).append(module)
    if not groups:
        return Forms((), "no projection of a type the quantized kernels take")
    timings = []
    for (kind, types), modules in groups.items():
        raws = [raw(n) for n in source_names(modules[0], tied)]
        if kind == "lm_head":  # its first rows: per row, a 1-row product costs what the whole's does
            raws = [
                RawTensor(r.name, r.qtype, r.data[:LM_HEAD_ROWS], (min(LM_HEAD_ROWS, r.shape[0]), r.shape[1]))
                for r in raws
            ]
        dense, native = time_forms(raws, kind, dtype, narrow_weights, int8_x=int8_x)
        timings.append(Timing(kind, types, tuple(modules), tuple(dense), tuple(native)))
        logger.info("weights auto: %s", timings[-1].line())
    return Forms(tuple(timings))


def dense_weight(raws: list[RawTensor], dtype: torch.dtype) -> torch.Tensor:
    """The merged weight of `raws` as a dense load holds it (gguf's float32 values cast to
    `dtype`), dequantized `CONVERT_ROWS` rows at a time (no whole float32 copy)."""
    out = torch.empty(sum(r.shape[0] for r in raws), raws[0].shape[1], dtype=dtype)
    offset = 0
    for raw in raws:
        for start in range(0, raw.shape[0], CONVERT_ROWS):
            block = torch.from_numpy(raw.dequantize(slice(start, start + CONVERT_ROWS)))
            out[offset + start : offset + start + block.shape[0]] = block
        offset += raw.shape[0]
    return out


def candidates(
    raws: list[RawTensor], kind: str, dtype: torch.dtype, narrow_weights: bool, int8_x: bool = False
) -> tuple[Linear, Linear]:
    """The projection made of `raws` in both forms: dense, laid out as the model lays it out,
    and native (`quant.native_parts`, with the activations the load serves: `int8_x`)."""
    rows, cols = sum(r.shape[0] for r in raws), raws[0].shape[1]
    with torch.device("meta"):  # no float32 placeholder weight (0.93 GB for the 1.5B's lm_head)
        dense, native = (Linear(cols, rows, bias=False, gated=kind == "gate_up") for _ in range(2))
    dense.weight = nn.Parameter(dense_weight(raws, dtype), requires_grad=False)
    prepare_projection(dense, narrow_weights, kind == "lm_head")
    native.weight = None
    native.quant = QuantProduct(native_parts(raws, dtype, {}, int8_x), None, dtype)
    return dense, native


@torch.inference_mode()
def time_forms(
    raws: list[RawTensor],
    kind: str,
    dtype: torch.dtype,
    narrow_weights: bool,
    timer: Callable[[], float] = time.process_time,
    int8_x: bool = False,
) -> tuple[list[float], list[float]]:
    """CPU seconds (`timer`: the process's, so intra-op threads count) of the projection's
    product in each form, per size (1 row; and PREFILL_ROWS rows but for the lm_head): the
    fastest of `REPEATS` after a warm-up, the forms interleaved, each product after
    `_EVICT_FLOATS` written; native with `int8_x` as the load would serve it."""
    forms = candidates(raws, kind, dtype, narrow_weights, int8_x)
    evict = torch.empty(_EVICT_FLOATS)
    generator = torch.Generator().manual_seed(0)
    best: list[list[float]] = [[], []]
    for rows in (1,) if kind == "lm_head" else (1, PREFILL_ROWS):
        x = torch.randn(rows, raws[0].shape[1], generator=generator).to(dtype)
        fastest = [math.inf, math.inf]
        for repeat in range(REPEATS + 1):
            for i, form in enumerate(forms):
                evict.fill_(repeat)
                start = timer()
                form(x)
                spent = timer() - start
                fastest[i] = min(fastest[i], spent) if repeat else fastest[i]
        for i in range(2):
            best[i].append(fastest[i])
    return best[0], best[1]
