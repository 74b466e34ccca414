"""The model runner: owns the model and the KV tensors; turns a scheduled batch into one forward.

The KV tensors hold `num_slots` token slots per layer: the paged blocks first, then the chunk
pool's pages, so that a sequence can read pool entries in place (no copy on a chunk hit).
"""

from __future__ import annotations

import logging
import time

import torch

from chunkcache.chunk.manager import ChunkManager
from chunkcache.config import ChunkConfig
from chunkcache.core.kv_slots import block_slots, consecutive
from chunkcache.core.plan import Entry
from chunkcache.core.sequence import Sequence
from chunkcache.engine.blend import BlendInput, BlendRun, needs_stored_scores
from chunkcache.engine.fusion import record_question_logprobs
from chunkcache.engine.prompt_logprobs import record_prompt_logprobs
from chunkcache.engine.scheduler import ScheduledBatch
from chunkcache.engine.sensitivity import measure
from chunkcache.model.attention import AttentionMetadata, DecodeBatch, PrefillSegment
from chunkcache.model.calibration import ContextCalibration, calibration_for
from chunkcache.model.kernels import qkernel
from chunkcache.model.loader import LoadedModel

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_slots: int,
        block_size: int,
        neutral_ids: tuple[int, ...] = (),
        compile_decode: bool = False,
        committed_slots: int = 0,
    ) -> None:
        self.model = loaded.model
        # The passage P after which a chunk entry measures its sensitivity (engine/sensitivity.py),
        # and the chunk manager, told of each entry that measured it (for its tiers); set by build.py.
        self.neutral_ids = neutral_ids
        self.chunks: ChunkManager | None = None
        self.spec = loaded.spec
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.block_size = block_size
        self.blend_fallbacks = 0
        self.blend_failure_causes: set[str] = set()
        self.blend_reused_tokens = 0
        self.blend_recomputed_tokens = 0
        shape = (num_slots, self.spec.num_kv_heads, self.spec.head_dim)
        # The first `committed_slots` (the paged blocks every request writes its own KV to) are
        # written once now, so that on CPU their pages are mapped before the first request
        # instead of being faulted in by it: a fresh 2,000-token prompt faulted ~22k pages in its
        # KV writes. The rest (the chunk pool) stays unwritten: untouched pages cost no memory on
        # CPU, and the pool's pages are mapped as entries arrive and then reused.
        self.kv_caches = [
            (
                torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.spec.num_layers)
        ]
        for k_layer, v_layer in self.kv_caches:
            k_layer[:committed_slots].zero_()
            v_layer[:committed_slots].zero_()
        if compile_decode:
            self.model.compile_decode()
            logger.info("compile_decode: compiling the one-sequence decode step (tens of seconds on a CPU)")
            start = time.monotonic()
            self._compile_now(min(block_size, num_slots - 1))
            logger.info("compile_decode: compiled in %.1f s", time.monotonic() - start)

    @torch.inference_mode()
    def _compile_now(self, past: int) -> None:
        """One decode step of token 0 after `past` entries, so that the compiled graph is built
        at start-up rather than in some request's step. It writes slot `past` only; before any
        request no slot holds anything."""
        dev = self.device
        slots = torch.arange(past + 1, device=dev)[None, :]
        decode = DecodeBatch(
            torch.zeros(1, dtype=torch.long, device=dev),
            slots,
            torch.ones(1, 1, 1, past + 1, dtype=torch.bool, device=dev),
        )
        # Fresh tensors, as `prepare` makes them: the graph guards on their storage offsets.
        meta = AttentionMetadata(torch.tensor([past], device=dev), [], decode)
        ids = torch.zeros(1, dtype=torch.long, device=dev)
        self.model(ids, torch.tensor([past], device=dev), self.kv_caches, meta)

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Token ids, positions, attention metadata and, per sequence, the index of the token
        whose logits are sampled (-1 when the sequence samples nothing this step)."""
        dev = self.device
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        prefills: list[PrefillSegment] = []
        decode_index: list[int] = []
        decode_slots: list[torch.Tensor] = []
        span: tuple[int, int] | None = None
        calibrated: list[tuple[int, int, int, ContextCalibration]] = []
        sample_index: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            c, kv = seq.num_computed, seq.kv_list
            start = len(ids)
            ids.extend(seq.token_ids[c : c + n])
            positions.append(torch.arange(kv.position_base + c, kv.position_base + c + n, device=dev))
            own = block_slots(seq.block_table, self.block_size, c + n, dev)
            slot_mapping.append(own[c:])
            past = own[:c] if kv.borrowed_slots is None else torch.cat((kv.borrowed_slots, own[:c]))
            if n == 1 and past.numel() > 0:
                if kv.calibration is not None:
                    calibrated.append((len(decode_index), start, past.numel() + 1, kv.calibration))
                # Only a batch of one decode reads its KV in place (`DecodeBatch.span`).
                first_decode = not decode_slots
                if (
                    first_decode
                    and kv.borrowed_slots is None
                    and consecutive(seq.block_table, c + n, self.block_size)
                ):
                    span = (seq.block_table[0] * self.block_size, c + n)
                decode_index.append(start)
                decode_slots.append(torch.cat((past, own[c:])))
            else:
                prefills.append(PrefillSegment.make(start, start + n, past, kv.calibration))
            done = c + n == seq.num_tokens
            sample_index.append(start + n - 1 if done and not seq.kind.is_fill else -1)
        decode = None
        if decode_index:
            max_len = max(s.numel() for s in decode_slots)
            slots = torch.zeros(len(decode_slots), max_len, dtype=torch.long, device=dev)
            mask = torch.zeros(len(decode_slots), 1, 1, max_len, dtype=torch.bool, device=dev)
            for row, s in enumerate(decode_slots):
                slots[row, : s.numel()] = s
                mask[row, 0, 0, : s.numel()] = True
            decode = DecodeBatch(
                torch.tensor(decode_index, device=dev),
                slots,
                mask,
                calibrated,
                span if len(decode_slots) == 1 else None,
            )
        meta = AttentionMetadata(torch.cat(slot_mapping), prefills, decode)
        return torch.tensor(ids, device=dev), torch.cat(positions), meta, sample_index

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Logits [num sampling sequences, vocab] and the batch rows they belong to."""
        hidden: dict[int, torch.Tensor] = {}
        decode_only = False
        regular = ScheduledBatch()
        regular_rows: list[int] = []
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if seq.blend is not None and seq.num_computed == 0:
                h = self._blend(seq, batch.blend_layers.get(id(seq)))
                if h is not None:
                    hidden[row] = h
                if h is not None or n == 0:
                    continue  # a blend's piece (or a failed one: a plain prefill from the next step)
            regular.seqs.append(seq)
            regular.num_new_tokens.append(n)
            regular_rows.append(row)
        if regular.seqs:
            input_ids, positions, meta, sample_index = self.prepare(regular)
            # A step of decode rows only: the quantized products round each row's x to int8 as
            # its 1-row step would (`int8_activations`; qkernel.decode_step).
            decode_only = not meta.prefills and not hidden
            with qkernel.decode_step(decode_only):
                out = self.model(input_ids, positions, self.kv_caches, meta)
            if any(s.params.prompt_logprobs is not None for s in regular.seqs):
                record_prompt_logprobs(self.model.compute_logits, out, regular.seqs, regular.num_new_tokens)
            if any(s.fusion is not None for s in regular.seqs):
                record_question_logprobs(self.model.compute_logits, out, regular.seqs, regular.num_new_tokens)
            for row, i in zip(regular_rows, sample_index, strict=True):
                if i >= 0:
                    hidden[row] = out[i : i + 1]
        rows = sorted(hidden)
        if not rows:
            return torch.empty(0, self.spec.vocab_size), rows
        with qkernel.decode_step(decode_only):
            return self.model.compute_logits(torch.cat([hidden[r] for r in rows])).cpu(), rows

    def _blend(self, seq: Sequence, stop: int | None) -> torch.Tensor | None:
        """The blend prefill of a layout-"offset" request, its layers up to `stop` (None: all of
        them) in this step: the last token's hidden state once the last layer ran, else None. None
        also after a failure, which leaves the request to an ordinary prefill of every token (its
        blocks are simply overwritten)."""
        blend = seq.blend
        assert blend is not None, "a blend needs the request's options"
        cfg = blend.config
        try:
            if blend.run is None:
                blend.run = BlendRun(self.model, self.kv_caches, self._blend_input(seq, cfg), cfg)
            run = blend.run
            run.run(run.num_layers if stop is None else stop)
            if not run.done:
                return None
            result = run.result()
        except Exception as e:  # any failure: plain prefill, never a crash or a wrong KV
            cause = f"{type(e).__name__}: {e}"
            if cause not in self.blend_failure_causes:
                self.blend_failure_causes.add(cause)
                logger.warning("blend failed (%s); falling back to a plain prefill", cause, exc_info=True)
            self.blend_fallbacks += 1
            seq.blend = None
            seq.reuse.blend_fallback = True
            seq.reuse.num_prefix_cached = seq.reuse.num_chunk_cached = 0  # every token is computed now
            # ... by a plain prefill, whose blocks any prompt with these tokens may find.
            seq.prefix_keys.make_plain()
            return None
        blend.run = None
        state = seq.chunks
        assert state is not None
        seq.kv_list.calibration = run.inp.calibration  # decode attends to the blended chunks alike
        keys = seq.prefix_keys
        keys.num_exact = run.inp.num_exact
        if keys.kv_key is not None:
            # Its blocks are found under the blend's key from the first one holding blended KV.
            keys.kv_key_from = min(keys.kv_key_from, keys.num_exact // self.block_size)
            keys.cacheable = True
        seq.reuse.blend_reused_tokens = result.reused_tokens
        seq.reuse.blend_recomputed_tokens = result.recomputed_tokens
        # Cached = read from an entry that existed before the request and not recomputed.
        kept = result.reused.split([n for _, n in state.slices])
        counts = [int(k.sum()) if hit else 0 for k, hit in zip(kept, state.was_cached, strict=True)]
        seq.reuse.num_prefix_cached, seq.reuse.num_chunk_cached = counts[0], sum(counts[1:])
        self.blend_reused_tokens += result.reused_tokens
        self.blend_recomputed_tokens += result.recomputed_tokens
        return result.hidden

    def _blend_input(self, seq: Sequence, cfg: ChunkConfig) -> BlendInput:
        """What a blend reads: the request's tokens, its entries' slots and how far each moved, and
        where its KV goes."""
        state = seq.chunks
        assert state is not None, "a blend needs the request's entries"
        prompt = state.prompt
        s = len(prompt.sys_token_ids)
        spans, start = [], s
        for chunk in prompt.chunks:
            spans.append((start, len(chunk)))
            start += len(chunk)
        # S was computed at [0, s) and the first chunk right after it: their KV, cached or
        # recomputed, is a plain prefill's, which the prefix cache may offer to any request. Not
        # so for a separator-free slice cut from the middle of an entry, or from an entry computed
        # after another S: that KV was computed in another context.
        first_exact = bool(prompt.chunks) and state.slices[1][0] == 0
        first_exact = first_exact and state.entries[1].token_ids[0] == tuple(prompt.sys_token_ids)
        prior = None
        if needs_stored_scores(cfg):
            prior = self._stored_sensitivity(s, state.entries[1:], state.slices[1:])
        return BlendInput(
            token_ids=torch.tensor(seq.token_ids, device=self.device),
            cached_slots=state.cached_slots,
            cached_delta=state.cached_delta,
            num_sys=s,
            chunk_spans=spans,
            own_slots=block_slots(seq.block_table, self.block_size, seq.num_tokens, self.device),
            calibration=calibration_for(s, start, cfg.calibration_temperature, cfg.calibration_scale),
            num_exact=s + (len(prompt.chunks[0]) if first_exact else 0),
            fresh_from=None if seq.prefix_keys.kv_key is None else start // self.block_size * self.block_size,
            prior=prior,
        )

    def measure_sensitivity(self, entries: list[Entry]) -> None:
        """Measure the sensitivity (engine/sensitivity.py) of the chunk entries that have none yet:
        one pass per distinct S among them (S, the passage P and their chunks)."""
        missing: dict[tuple[int, ...], list[Entry]] = {}
        for entry in {id(e): e for e in entries if e.sensitivity is None}.values():  # a slice twice: once
            missing.setdefault(entry.token_ids[0], []).append(entry)
        for sys_ids, group in missing.items():
            chunks = [
                (block_slots(e.pages, self.block_size, e.num_tokens, self.device), e.token_ids[-1])
                for e in group
            ]
            scores = measure(self.model, self.kv_caches, sys_ids, self.neutral_ids, chunks)
            for entry, score in zip(group, scores, strict=True):
                entry.sensitivity = score
                if self.chunks is not None:
                    self.chunks.sensitivity_measured(entry)

    def _stored_sensitivity(
        self, num_sys: int, entries: list[Entry], slices: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Per cached token of a request (S, then the used slice of each chunk entry), its entry's
        stored sensitivity (S: zeros), measured now for the entries that have none yet."""
        self.measure_sensitivity(entries)
        parts = [torch.zeros(num_sys)]
        for entry, (start, n) in zip(entries, slices, strict=True):
            assert entry.sensitivity is not None
            parts.append(entry.sensitivity[start : start + n])
        return torch.cat(parts)
