"""The Llama family (Llama, Qwen2, Qwen3, Mistral) as one module with three switches:
qkv bias (Qwen2, Llama's attention_bias), per-head q/k RMSNorm (Qwen3), tied embeddings.

Tokens of every sequence in a step are flattened into one [T] batch; q/k/v and gate/up are
merged projections, so a layer runs four matmuls. On CPU float32 the projections are laid out
after loading for the row counts they run (`model.linear`: MKL's plain layouts, or oneDNN's
packed one with the residual adds and SwiGLU fused into it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from chunkcache.model.attention import AttentionMetadata, attend, compiled_decode_meta
from chunkcache.model.kernels import qkernel
from chunkcache.model.linear import Linear, packing_pays, time_one_row_products
from chunkcache.model.rope import RopeTable, RotaryEmbedding
from chunkcache.model.spec import ModelSpec

logger = logging.getLogger(__name__)

# Per layer, the K and V cache tensors [slots, kv_heads, head_dim].
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype == self.weight.dtype
            and x.dtype in qkernel.ROW_TYPES
            and x.dim() == 2
            and x.shape[0] <= qkernel.MAX_ROWS
            and x.device.type == "cpu"
            and qkernel.rows_served()
        ):  # A decode step's rows: one C call, not 1-10 operators (~40 us in the engine), whose sum
            # of squares runs in another order: bfloat16 one unit off on 0-4 elements in a million.
            return qkernel.rms_norm_rows(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One kernel instead of five (a decode step runs 61 norms); the same numbers.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32, as transformers does, so half-precision checkpoints agree: its
        # x * rsqrt(mean(x^2) + eps) in float32 is F.rms_norm's without a weight, bit for bit
        # (2,000 random rows, 64-1,536 wide), in one call instead of five (a SmolLM2 decode step
        # runs 61 norms), then the weight in x's dtype after the rounding, as transformers.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.rotary = rotary
        self.scale = self.head_dim**-0.5

    def project(self, x: torch.Tensor, rope: RopeTable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hk, D] of hidden states x, RoPE of `rope`'s positions applied."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        heads = (self.num_heads, self.num_kv_heads)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, sum(heads), self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split(heads, dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # q and k sit side by side in the merged projection: rotated in one pass.
        q, k = RotaryEmbedding.apply(rope, qk).split(heads, dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTable,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """residual + attention output of the (normalised) hidden states x."""
        if self.one_row_in_c(x, kv_cache, meta):
            assert meta.decode is not None
            heads = (self.num_heads, self.num_kv_heads)
            o = qkernel.attend_row(self.qkv_proj(x), rope, kv_cache, meta.decode.slots[0], heads, self.scale)
            return self.o_proj(o, residual)
        q, k, v = self.project(x, rope)
        o = attend(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(x.shape[0], self.q_size), residual)

    def one_row_in_c(
        self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> bool:
        """Whether this step is one sequence's decode token on CPU, whose RoPE, KV write and
        attention one C call does (`qkernel.attend_row`: ~15 operators a layer fewer), where its KV
        list is short enough for that call to be the faster (`qkernel.ROW_ATTENTION_MACS`, measured
        on one thread; the C call runs on one, torch's SDPA splits the heads over all)."""
        d = meta.decode
        return (
            x.shape[0] == 1
            and d is not None
            and not meta.prefills
            and not d.calibrated
            and x.dtype == kv_cache[0].dtype
            and x.dtype in qkernel.ROW_TYPES
            and x.device.type == "cpu"
            and self.q_norm is None
            and self.head_dim % 8 == 0
            and self.num_heads * d.slots.shape[1] * self.head_dim * torch.get_num_threads()
            <= qkernel.ROW_ATTENTION_MACS[x.dtype]
            and qkernel.rows_served()
        )


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, spec.mlp_bias, gated=True)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate) * up) of x, plus `residual` when given."""
        return self.down_proj(self.gate_up_proj(x), residual)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, rotary)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTable,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


def prepare_projection(m: Linear, narrow_weights: bool, lm_head: bool) -> None:
    """Lay out one loaded projection as `LlamaForCausalLM.prepare` does (also `weights auto`'s
    dense candidate, `model/weight_forms.py`, so that it times the layouts serving would hold)."""
    pack = packing_pays(m, (4, 64) if narrow_weights else (1, 64))
    # The lm_head's prefill rows are few (the last token of each prompt): no band.
    pack_prefill = lm_head or not (pack and narrow_weights) or packing_pays(m, (256,))
    m.prepare(pack, narrow_weights, pack_prefill)


def _keep_faster_products(linears: list[Linear]) -> None:
    """Time both forms of each projection kind's 1-row product over these weights (one pass
    each), log them, and drop the fused form (`fused = None`) where BLAS is as fast or faster."""
    timings = time_one_row_products(linears)
    for (out_features, in_features, _, _), (fused, blas) in timings.items():
        logger.info(
            "compile_decode: %dx%d 1-row products as %s (a pass over their weights: %.1f ms "
            "fused, %.1f ms BLAS)",
            in_features,
            out_features,
            "fused multiply-sums" if fused < blas else "BLAS calls",
            fused * 1e3,
            blas * 1e3,
        )
    for m in linears:
        fused, blas = timings[m.kind]
        if fused >= blas:
            m.fused = None


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope, spec.max_position_embeddings)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, self.rotary) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # `compile_decode()`: the compiled forward of one-sequence decode steps, and how many
        # steps it served (tests check that it did).
        self._compiled_decode: Callable[..., torch.Tensor] | None = None
        self._compiled_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.compiled_steps = 0
        # Whether any of the compiled step's 1-row products are inductor's fused loops.
        self.fused_products = False
        # The form the projections hold their weights in, as the loader resolved the option
        # `weights` ("dense", "native", "int8", or native with the projections `auto` kept dense
        # named): KV computed through other forms differs, so the tiers' identity binds it.
        self.weights_form = "dense"
        # Whether the quantized products of one row round x to int8 (engine option
        # `int8_activations`): decode's KV differs with it, so the identity binds it too.
        self.int8_activations = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of this step's tokens; the KV of each layer lands in kv_caches."""
        if self._compiled_decode is not None:
            compiled = compiled_decode_meta(input_ids, meta)
            if compiled is not None:
                self.compiled_steps += 1
                return self._compiled_decode(input_ids, positions, kv_caches, compiled)
        return self._forward(input_ids, positions, kv_caches, meta)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv, meta)
        return self.norm(x)

    def prepare(self, narrow_weights: bool = True) -> None:
        """Lay out every projection for the row counts it will run (`Linear.prepare`). Call once,
        after the weights are loaded.

        Per projection shape, oneDNN's layout serves batched decode steps where packing
        measured faster than the plain layout at 4-64 rows on this machine (`linear.packing_pays`;
        1-64 rows without narrow copies), and prefills too where it also measured faster at 256
        rows; the plain layout serves the rest. `narrow_weights`: packed projections keep a plain
        copy for steps of 1-3 rows and prefills (up to twice the weights' memory; the batch-1
        decode then runs at MKL's 1-row speed instead of oneDNN's slower padded one).

        A tied lm_head holds its own layout beside the embedding's dense weight, which row lookups
        need (+vocab x hidden x 4 bytes: 113 MB for SmolLM2-135M, 544 MB for Qwen2.5-0.5B; twice
        that with a narrow copy): its 1-row product is the largest of a decode step.
        """
        for m in self.modules():
            if isinstance(m, Linear) and m.weight is not None:
                prepare_projection(m, narrow_weights, m is self.lm_head)

    def compile_decode(self) -> None:
        """Serve one-sequence decode steps through `torch.compile` (inductor), engine option
        `compile_decode`.

        A batch-1 decode step on CPU runs ~1,000 small operators around its 121 matrix-vector
        products; in eager mode their dispatch costs ~10 ms per token on SmolLM2-135M (one
        thread), a fifth of the step. Compiled, the 30 layers are one graph whose elementwise
        work (norms, RoPE, SwiGLU, residuals) is fused into a few C++ loops; the products stay
        MKL's. The graph takes the KV-list length as a symbolic size, so one compilation serves
        every step of every sequence; it is made when the engine starts (tens of seconds on a
        CPU, less with inductor's on-disk cache), not at the first request.

        Needs the plain 1-row layouts: inductor cannot lower oneDNN's packed product, which
        serves 1-row steps when `narrow_weights` is off.

        On CPU float32 the step's 1-row products may leave BLAS too: written as a multiply-sum
        over the [out, in] weight (`linear.multiply_sum`), inductor streams each weight in one
        loop, 17-19 GB/s from one core of an AMD EPYC against MKL's 12-15 GB/s there. Which is
        faster depends on the CPU, its BLAS and the shape, so both are timed over the model's own
        weights here, per projection kind (`linear.time_one_row_products`), once, and each kind
        is compiled in its faster form, into the layers' graph and, where the lm_head's is the
        fused one, into a second graph for 1-row logits (the lm_head is the largest product).
        The multiply-sum needs the [out, in] weight of every projection whose 1-row layout is
        the transposed one: a second copy of those weights (+318 MB on SmolLM2-135M; a tied
        lm_head reads the embedding's)."""
        self._check_compilable()
        linears = [m for m in self.layers.modules() if isinstance(m, Linear)]
        self._choose_product_forms(linears)
        self.fused_products = any(m.fused is not None for m in [*linears, self.lm_head])
        self._compiled_decode = torch.compile(self._forward, dynamic=True)
        if self.lm_head.fused is not None:
            # A decode step's logits (one row) stream the lm_head's weight the same way: compiled
            # for one row only, and now, so that no request's step waits for the compiler.
            self._compiled_logits = torch.compile(self._logits, dynamic=False)
            with torch.inference_mode():
                self._compiled_logits(self.norm.weight.new_zeros(1, self.spec.hidden_size))

    def _check_compilable(self) -> None:
        """Refuse, before any time is spent, what `compile_decode` cannot serve, naming the first
        projection in the way: oneDNN's packed 1-row layout (inductor cannot lower it), and
        qkernel's C products under torch's AVX512 kernels (compiled graphs around them aborted)."""
        packed = [n for n, m in self.named_modules() if isinstance(m, Linear) and m.narrow == "packed"]
        if packed:
            raise ValueError(
                f"compile_decode needs narrow_weights: {packed[0]} serves 1-row steps with oneDNN's "
                "packed layout, which torch.compile cannot lower"
            )
        served = [
            n for n, m in self.named_modules() if isinstance(m, Linear) and m.quant and m.quant.qkernel_ops()
        ]
        if served and torch.backends.cpu.get_cpu_capability() == "AVX512":
            raise ValueError(
                f"compile_decode: {served[0]} is served by qkernel's C products, and with torch's AVX512 "
                "kernels graphs compiled around them aborted in glibc's heap checks (a known bug: "
                "docs/operations.md); serve without compile_decode here"
            )

    def _choose_product_forms(self, linears: list[Linear]) -> None:
        """Per projection kind, the faster form of its 1-row product (`Linear.fused` kept for a
        fused multiply-sum, None for BLAS). Timed only where every projection, the lm_head
        included, can hold the [out, in] weight the multiply-sum reads; otherwise all are BLAS."""
        # A tied lm_head's [out, in] weight is the embedding's, held anyway for row lookups.
        # (Native weights' quantized embedding holds no dense weight: its tied lm_head is int4.)
        tied = self.spec.tie_word_embeddings and isinstance(self.embed_tokens, nn.Embedding)
        shared = self.embed_tokens.weight.detach() if tied else None
        if all(m.hold_fused_weight() for m in linears) and self.lm_head.hold_fused_weight(shared):
            _keep_faster_products([*linears, self.lm_head])
        else:
            for m in [*linears, self.lm_head]:
                m.fused = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._compiled_logits is not None and hidden.shape[0] == 1:
            return self._compiled_logits(hidden)
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
