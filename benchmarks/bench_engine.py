"""The engine against transformers, side by side in one process, on the same checkpoint.

Checkpoint: `--model` (a directory or a .gguf file; `--model smollm2` = SmolLM2-135M-Instruct,
`--model default` = the default model), else random weights shaped like Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads,
2 KV heads, vocab 151936, tied embeddings), built by `tests/support/tiny_checkpoint.py` on first use.
fp32, CPU. transformers runs `AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)`
(for a GGUF: with `gguf_file=`, its own dequantization) with `attn_implementation="sdpa"`, under
`torch.inference_mode()`. Prompts are random ordinary token
ids, fresh for every run (so the prefix cache, on as by default, never hits: checked), the same
ids for both sides. Both sides are warmed up first; in each repetition the side that goes first
alternates. Times are medians over the repetitions; a ratio is transformers' median time over
ours (> 1 = we are faster).

1. prefill: one 2048-token prompt. Ours: the wall time of `LLM.generate(ids, max_tokens=1)`, with
   `max_num_batched_tokens` >= 2048 so the prompt is one step (this includes the logits of the last
   token, sampling and detokenizing). Theirs: the wall time of one forward with `logits_to_keep=1`.
2. decode at batch 1: a 512-token prompt, 128 new tokens (greedy, EOS ignored / `min_new_tokens`).
   Decode rate EXCLUDING prefill for both: (128 - 1) tokens over the time from the first generated
   token to the last. Ours from `RequestOutput.metrics` (first_token_time -> finished_time), theirs
   from a streamer that stamps every token `generate` emits. Total times are printed too.
3. batch of 16: 16 prompts of 256 tokens, 64 new tokens each. Ours: all 16 submitted at once to one
   `LLM.generate`; theirs: ONE batched `generate` call on the [16, 256] tensor (equal lengths, so no
   padding). Total wall time of all of it (prefill included) for both; throughput = 16 * 64
   generated tokens over that time.

Every measurement also prints the ratio of process CPU seconds (transformers / ours). With
`--threads 1` that ratio hardly depends on the load other processes put on a shared machine, while
wall time does; with several threads it also counts threads spinning at barriers. The summary line
holds the wall-clock ratios.

The greedy tokens of the decode run are compared between the two sides (a check that both did the
same work; fp32 rounding may flip a near-tie late in a random model's continuation).

    python benchmarks/bench_engine.py [--quick] [--model DIR|FILE.gguf|default] [--model-dir DIR] [--repeats 3] [--batch-repeats 2] [--threads N] [--compile-decode]

The last line is `SUMMARY bench_engine: prefill=X.XXx decode=X.XXx batch16=X.XXx` followed by the
same three as CPU-time ratios (`cpu_prefill=... cpu_decode=... cpu_batch16=...`).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import torch
from common import (
    add_common_args,
    bench_model,
    describe_machine,
    fmt_runs,
    hf_causal_lm,
    interleaved,
    median,
    now,
    ordinary_token_ids,
    random_token_ids,
    setup_torch,
    summary,
)
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from chunkcache import LLM, SamplingParams


@dataclass(frozen=True)
class Shapes:
    prefill_len: int = 2048
    decode_prompt: int = 512
    decode_new: int = 128
    batch: int = 16
    batch_prompt: int = 256
    batch_new: int = 64


QUICK = Shapes(prefill_len=256, decode_prompt=64, decode_new=16, batch=4, batch_prompt=64, batch_new=8)


class Runs:
    """Wall and process-CPU seconds of the runs of one measurement."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def add(self, start: tuple[float, float], end: tuple[float, float]) -> None:
        self.wall.append(end[0] - start[0])
        self.cpu.append(end[1] - start[1])

    def ratio_over(self, other: Runs) -> float:
        """Median wall time of self over other's (self = transformers: > 1 = ours faster)."""
        return median(self.wall) / median(other.wall)

    def cpu_text(self) -> str:
        return f"[CPU {median(self.cpu):.4g} s]"

    def cpu_ratio(self, other: Runs) -> float:
        return median(self.cpu) / median(other.cpu)

    def cpu_ratio_text(self, other: Runs) -> str:
        return f"CPU-time ratio {self.cpu_ratio(other):.2f}x"


class TokenClock(BaseStreamer):
    """Stamps each batch of tokens `generate` emits; the first `put` is the prompt."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(now())

    def end(self) -> None:
        pass


def log(msg: str) -> None:
    tqdm.write(msg)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=3, help="runs of prefill and decode (median)")
    parser.add_argument(
        "--batch-repeats",
        type=int,
        default=2,
        help="runs of the batch measurement (2 = ours, theirs, theirs, ours: cancels a linear drift)",
    )
    parser.add_argument(
        "--compile-decode",
        action="store_true",
        help="engine option compile_decode: batch-1 decode steps through torch.compile",
    )
    args = parser.parse_args()
    setup_torch(args.threads)
    shapes = QUICK if args.quick else Shapes()
    model = bench_model(args)
    rng = random.Random(args.seed)
    log(f"machine: {describe_machine()}")
    log(f"checkpoint: {model}  shapes: {shapes}")

    llm = LLM(
        model,
        # The engine sets torch's (process-wide) threads: transformers then runs with the same.
        threads=args.threads,
        device="cpu",
        dtype="float32",
        enable_chunk_cache=False,
        max_num_batched_tokens=max(2048, shapes.prefill_len),
        max_num_seqs=max(64, shapes.batch),
        compile_decode=args.compile_decode,
    )
    if args.compile_decode:
        from chunkcache.model.linear import Linear

        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
        fused = sorted({f"{m.in_features}x{m.out_features}" for m in linears if m.fused is not None})
        log(
            f"compile_decode: fused 1-row products for {', '.join(fused) or 'no projection'}; BLAS for the rest"
        )
    hf = hf_causal_lm(model, dtype=torch.float32, attn_implementation="sdpa").eval()
    vocab = ordinary_token_ids(llm.tokenizer, llm.engine.spec.vocab_size)
    pad_id = hf.generation_config.pad_token_id

    def ours_generate(prompts: list[list[int]], new: int):  # -> list[RequestOutput]
        sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        outs = llm.generate(prompts, sp)
        cached = sum(o.num_cached_tokens for o in outs)
        assert cached == 0, f"fresh prompts hit the prefix cache ({cached} tokens): not a fair measurement"
        return outs

    @torch.inference_mode()
    def hf_generate_batch(
        prompts: list[list[int]], new: int, streamer: BaseStreamer | None = None
    ) -> list[list[int]]:
        """One `generate` call over equal-length prompts (no padding needed)."""
        x = torch.tensor(prompts)
        out = hf.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=pad_id,
            streamer=streamer,
        )
        return out[:, x.shape[1] :].tolist()

    def hf_generate(ids: list[int], new: int, streamer: BaseStreamer | None = None) -> list[int]:
        return hf_generate_batch([ids], new, streamer)[0]

    @torch.inference_mode()
    def hf_prefill(ids: list[int]) -> None:
        hf(torch.tensor([ids]), logits_to_keep=1)

    # ---- warm-up ---------------------------------------------------------------------------
    for _ in tqdm(range(2), desc="warm-up"):
        ids = random_token_ids(rng, 64, vocab)
        ours_generate([ids, random_token_ids(rng, 48, vocab)], 4)
        hf_prefill(ids)
        hf_generate(ids, 4)

    # ---- 1. prefill ------------------------------------------------------------------------
    ours_p, hf_p = Runs(), Runs()
    bar = tqdm(total=2 * args.repeats, desc=f"prefill {shapes.prefill_len}")
    prompts = [random_token_ids(rng, shapes.prefill_len, vocab) for _ in range(args.repeats)]

    def ours_prefill(i: int) -> None:
        t0 = now()
        ours_generate([prompts[i]], 1)
        ours_p.add(t0, now())
        bar.update()

    def theirs_prefill(i: int) -> None:
        t0 = now()
        hf_prefill(prompts[i])
        hf_p.add(t0, now())
        bar.update()

    interleaved(args.repeats, ours_prefill, theirs_prefill)
    bar.close()
    n = shapes.prefill_len
    prefill_ratio = hf_p.ratio_over(ours_p)
    log(
        f"prefill, one {n}-token prompt:\n"
        f"  ours         {fmt_runs(ours_p.wall)} = {n / median(ours_p.wall):.1f} tok/s {ours_p.cpu_text()}\n"
        f"  transformers {fmt_runs(hf_p.wall)} = {n / median(hf_p.wall):.1f} tok/s {hf_p.cpu_text()}\n"
        f"  ratio {prefill_ratio:.2f}x (target >= 1.0x); {hf_p.cpu_ratio_text(ours_p)}"
    )

    # ---- 2. decode at batch 1 --------------------------------------------------------------
    new = shapes.decode_new
    ours_d, hf_d, ours_all, hf_all = Runs(), Runs(), Runs(), Runs()
    ours_tokens: dict[int, list[int]] = {}
    hf_tokens: dict[int, list[int]] = {}
    prompts = [random_token_ids(rng, shapes.decode_prompt, vocab) for _ in range(args.repeats)]
    bar = tqdm(total=2 * args.repeats, desc=f"decode {shapes.decode_prompt}+{new}")
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)

    def ours_decode(i: int) -> None:
        # The engine's step loop, driven here so that both clocks are read at the first token.
        eng = llm.engine
        rid = f"decode-{i}"
        t0 = now()
        eng.add_request(rid, prompts[i], sp)
        first: tuple[float, float] | None = None
        final = None
        while eng.has_unfinished_requests():
            for out in eng.step():
                if first is None and out.outputs[0].token_ids:
                    first = now()
                if out.finished:
                    final = out
        t1 = now()
        assert first is not None and final is not None and final.num_cached_tokens == 0
        assert len(final.outputs[0].token_ids) == new
        ours_d.add(first, t1)
        ours_all.add(t0, t1)
        ours_tokens[i] = final.outputs[0].token_ids
        bar.update()

    def theirs_decode(i: int) -> None:
        clock = TokenClock()
        t0 = now()
        hf_tokens[i] = hf_generate(prompts[i], new, clock)
        t1 = now()
        assert len(clock.times) == new, len(clock.times)
        hf_d.add(clock.times[0], clock.times[-1])
        hf_all.add(t0, t1)
        bar.update()

    interleaved(args.repeats, ours_decode, theirs_decode)
    bar.close()
    same_tokens = []
    for i in range(args.repeats):
        a, b = ours_tokens[i], hf_tokens[i]
        first_diff = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        same_tokens.append("all equal" if first_diff is None else f"differ from token {first_diff}")
    rate = new - 1
    decode_ratio = hf_d.ratio_over(ours_d)
    log(
        f"decode at batch 1, {shapes.decode_prompt}-token prompt, {new} new tokens "
        f"(rate over the {rate} tokens after the first, prefill excluded):\n"
        f"  ours         {fmt_runs(ours_d.wall)} = {rate / median(ours_d.wall):.2f} tok/s {ours_d.cpu_text()}"
        f"  (total with prefill {fmt_runs(ours_all.wall)})\n"
        f"  transformers {fmt_runs(hf_d.wall)} = {rate / median(hf_d.wall):.2f} tok/s {hf_d.cpu_text()}"
        f"  (total with prefill {fmt_runs(hf_all.wall)})\n"
        f"  greedy tokens ours vs transformers: {'; '.join(same_tokens)}\n"
        f"  ratio {decode_ratio:.2f}x (target >= 1.2x); {hf_d.cpu_ratio_text(ours_d)}; "
        f"with prefill: wall {hf_all.ratio_over(ours_all):.2f}x, {hf_all.cpu_ratio_text(ours_all)}"
    )

    # ---- 3. a batch of requests ------------------------------------------------------------
    b, plen, bnew = shapes.batch, shapes.batch_prompt, shapes.batch_new
    ours_b, hf_b = Runs(), Runs()
    batches = [[random_token_ids(rng, plen, vocab) for _ in range(b)] for _ in range(args.batch_repeats)]
    bar = tqdm(total=2 * args.batch_repeats, desc=f"batch {b}x({plen}+{bnew})")

    def ours_batch(i: int) -> None:
        t0 = now()
        outs = ours_generate(batches[i], bnew)
        ours_b.add(t0, now())
        assert all(len(o.outputs[0].token_ids) == bnew for o in outs)
        bar.update()

    def theirs_batch(i: int) -> None:
        t0 = now()
        outs = hf_generate_batch(batches[i], bnew)
        hf_b.add(t0, now())
        assert len(outs) == b and all(len(o) == bnew for o in outs)
        bar.update()

    interleaved(args.batch_repeats, ours_batch, theirs_batch)
    bar.close()
    gen = b * bnew
    batch_ratio = hf_b.ratio_over(ours_b)
    log(
        f"{b} requests of {plen} prompt tokens + {bnew} new tokens (total time, prefill included):\n"
        f"  ours, all {b} at once           {fmt_runs(ours_b.wall)} = {gen / median(ours_b.wall):.2f} generated tok/s {ours_b.cpu_text()}\n"
        f"  transformers, one batched call  {fmt_runs(hf_b.wall)} = {gen / median(hf_b.wall):.2f} generated tok/s {hf_b.cpu_text()}\n"
        f"  ratio {batch_ratio:.2f}x (target >= 4x); {hf_b.cpu_ratio_text(ours_b)}"
    )
    print(
        summary(
            "bench_engine",
            prefill=f"{prefill_ratio:.2f}x",
            decode=f"{decode_ratio:.2f}x",
            **{f"batch{b}": f"{batch_ratio:.2f}x"},
            cpu_prefill=f"{hf_p.cpu_ratio(ours_p):.2f}x",
            cpu_decode=f"{hf_d.cpu_ratio(ours_d):.2f}x",
            **{f"cpu_batch{b}": f"{hf_b.cpu_ratio(ours_b):.2f}x"},
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
