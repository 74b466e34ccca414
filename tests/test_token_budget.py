"""The per-step token budget (engine/scheduler.py): decodes, then short prompts, then long prefills
in pieces, then background work, so no request waits behind another's prefill. Counted in steps,
never in time."""

from __future__ import annotations

import pytest

from chunkcache import SamplingParams
from chunkcache.config import SchedulerConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.core.sequence import Sequence, SequenceKind
from chunkcache.engine import scheduler as scheduler_module
from chunkcache.engine.scheduler import Scheduler
from chunkcache.outputs import RequestOutput
from tests.support.engines import tiny_llm
from tests.support.oracle import hf_first_token_logprobs, hf_greedy

MAX_OUT = 4


def _scheduler(
    budget: int, threshold: int, num_blocks: int = 256, long_at_once: int = 1
) -> tuple[Scheduler, BlockManager]:
    blocks = BlockManager(num_blocks, 16, enable_prefix_caching=True, hash_seed="0", medium="GPU")
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        max_long_partial_prefills=long_at_once,
    )
    return Scheduler(config, blocks), blocks


def _seq(name: str, length: int, background: bool = False, max_out: int = MAX_OUT) -> Sequence:
    prompt = [(hash(name) + 7 * j) % 900 + 1 for j in range(length)]
    params = SamplingParams(max_tokens=max_out)
    kind = SequenceKind.PREFIX_JOB if background else SequenceKind.REQUEST
    return Sequence(name, list(prompt), list(prompt), params, kind=kind)


def _step(sched: Scheduler, blocks: BlockManager) -> dict[str, int]:
    """One step as the engine takes it, with a fake model (each sequence computes what it was
    given and samples token 7). Returns the tokens each sequence got, by request id."""
    batch = sched.schedule()
    assert sum(batch.num_new_tokens) <= sched.max_num_batched_tokens
    for seq in sched.waiting:
        assert not seq.block_table, f"waiting {seq.request_id} holds blocks"
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed += n
        blocks.register_full_blocks(seq.block_table, seq.token_ids, seq.block_hashes, seq.num_computed)
        if seq.num_computed == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq)
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}


def test_a_short_request_gets_its_first_token_within_a_step() -> None:
    """A 1,000-token prompt and an 8-token request in a 64-token budget: the short one is answered
    by the step after it arrives (running first, as before, it waited 15 more steps for the
    long prefill), and the long one goes on in pieces of the threshold meanwhile."""
    sched, blocks = _scheduler(budget=64, threshold=16)
    long = _seq("long", 1000)
    sched.add(long)
    for _ in range(2):
        assert _step(sched, blocks) == {"long": 16}
    short = _seq("short", 8)
    sched.add(short)
    assert _step(sched, blocks) == {"short": 8, "long": 16}
    assert short.num_output_tokens == 1
    # A prompt longer than the threshold is a long one: it waits for the running long prefill.
    middle = _seq("middle", 40)
    sched.add(middle)
    assert _step(sched, blocks) == {"short": 1, "long": 16}


def test_long_prefills_end_one_after_another() -> None:
    """Long prompts arriving together are prefilled first come first served, the oldest
    `max_long_partial_prefills` at a time: the first ends its prefill after its own pieces, not
    near the last one's end (every one a piece per step: processor sharing). A short prompt still
    passes them, and a long one starts as soon as the one before has a piece's work left."""
    sched, blocks = _scheduler(budget=64, threshold=16)
    first, second = _seq("first", 64), _seq("second", 64)
    sched.add(first)
    sched.add(second)
    for _ in range(3):
        assert _step(sched, blocks) == {"first": 16}
    assert _step(sched, blocks) == {"first": 16, "second": 16}  # first's last piece: not long any more
    assert first.num_output_tokens == 1
    sched.add(_seq("short", 8))
    assert _step(sched, blocks) == {"first": 1, "short": 8, "second": 16}
    # Two at a time: both get pieces from the first step, and end together.
    sched, blocks = _scheduler(budget=64, threshold=16, long_at_once=2)
    sched.add(_seq("first", 64))
    sched.add(_seq("second", 64))
    assert _step(sched, blocks) == {"first": 16, "second": 16}


def test_a_short_tail_joins_the_piece_before_it() -> None:
    """A prefill that would end in a piece of at most threshold / 8 tokens takes them in the piece
    before (a step costs something whatever its tokens: native weights dequantize every weight per
    step); one token more and it runs in two pieces as before."""
    sched, blocks = _scheduler(budget=64, threshold=16)
    sched.add(_seq("tail", 16 + 2))
    assert _step(sched, blocks) == {"tail": 18}
    sched, blocks = _scheduler(budget=64, threshold=16)
    sched.add(_seq("pieces", 16 + 3))
    assert _step(sched, blocks) == {"pieces": 16}
    assert _step(sched, blocks) == {"pieces": 3}
    # Within the budget still: the tail joins only what the step has room for.
    sched, blocks = _scheduler(budget=17, threshold=16)
    sched.add(_seq("budget", 16 + 2))
    assert _step(sched, blocks) == {"budget": 17}


def test_running_decodes_get_a_token_every_step() -> None:
    sched, blocks = _scheduler(budget=40, threshold=32)
    streams = [_seq(f"stream{i}", 5, max_out=50) for i in range(4)]
    for seq in streams:
        sched.add(seq)
    _step(sched, blocks)
    sched.add(_seq("long", 2000))
    for _ in range(20):
        got = _step(sched, blocks)
        assert all(got[s.request_id] == 1 for s in streams)
        assert got["long"] == 32  # a piece of the threshold beside the decodes


def test_background_work_gets_what_is_left_and_never_starves() -> None:
    sched, blocks = _scheduler(budget=48, threshold=32)
    job = _seq("job", 200, background=True, max_out=1)
    other = _seq("other", 200, background=True, max_out=1)
    sched.add(job)
    sched.add(other)
    # Alone too, one piece a step: a request arriving meanwhile waits for one piece at most.
    assert _step(sched, blocks) == {"job": 32}
    sched.add(_seq("request", 40))
    # Beside a request's prefill, nothing: its first token never waits for background work.
    assert _step(sched, blocks) == {"request": 32}
    assert _step(sched, blocks) == {"request": 8}
    # Beside its decodes, one piece at most: its step is no longer than a long prefill's.
    assert _step(sched, blocks) == {"request": 1, "job": 32}
    # Two long prompts take the whole budget every step: the job still gets its share.
    sched.add(_seq("long1", 3000))
    sched.add(_seq("long2", 3000))
    served = []
    for _ in range(3 * (scheduler_module.BACKGROUND_MAX_WAIT_STEPS + 1)):
        served.append(_step(sched, blocks).get("job", 0))
    gaps = "".join("x" if n else "." for n in served).split("x")
    assert max(map(len, gaps)) <= scheduler_module.BACKGROUND_MAX_WAIT_STEPS
    assert sum(served) >= 2 * scheduler_module.BACKGROUND_STEP_TOKENS


def test_a_request_takes_the_blocks_of_background_work() -> None:
    """Four blocks: a background prefill holds three; a request needing two takes them back (a
    yield, not a preemption), and the job resumes from the prefix cache afterwards."""
    sched, blocks = _scheduler(budget=16, threshold=16, num_blocks=4)
    job = _seq("job", 64, background=True, max_out=1)
    sched.add(job)
    for _ in range(3):
        _step(sched, blocks)
    assert len(job.block_table) == 3 and job.num_computed == 48
    request = _seq("request", 16, max_out=8)
    sched.add(request)
    while not request.is_finished:
        _step(sched, blocks)
    assert sched.num_preemptions == 0
    while not job.is_finished:
        _step(sched, blocks)
    assert job.reuse.num_prefix_cached >= 16  # what the request did not overwrite was still cached
    assert blocks.num_free_blocks == blocks.num_blocks
    blocks.check_integrity()


def test_preemption_still_frees_blocks_for_running_requests() -> None:
    """Over-committed KV under pieces: two 200-token prompts each wanting 300 more tokens in 32
    blocks; preemption lets both finish and every block comes back."""
    sched, blocks = _scheduler(budget=64, threshold=16, num_blocks=32)
    seqs = [_seq(f"r{i}", 200, max_out=300) for i in range(2)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(20_000):
        _step(sched, blocks)
        if not sched.has_work():
            break
    assert all(s.is_finished and s.num_output_tokens == 300 for s in seqs)
    assert sched.num_preemptions > 0
    assert blocks.num_free_blocks == blocks.num_blocks
    blocks.check_integrity()


def test_a_long_prompt_prefilled_in_pieces_matches_transformers(checkpoint) -> None:
    """Pieces of 8 tokens in a 24-token budget, beside short requests: the same logits and greedy
    tokens as transformers' one pass (1e-4, float32); the short request is answered by the step
    after it arrives."""
    path = checkpoint(arch="qwen2")
    llm = tiny_llm(
        path,
        kv_cache_tokens=1024,
        chunk_cache_size_gb=None,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=8,
    )
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    long_ids = [(5 * j) % 200 + 3 for j in range(150)]
    engine.add_request("long", long_ids, greedy)
    engine.step()
    engine.add_request("short", "Alice", greedy)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in outputs:
                outputs[out.request_id] = steps
            if out.finished:
                outputs[out.request_id + "/final"] = out
        steps += 1
    assert outputs["short"] == 0  # its first token came from the first step after it arrived
    assert outputs["long"] > 150 // 8 - 2  # the long prompt took its pieces
    for name in ("long", "short"):
        out = outputs[name + "/final"]
        ref = hf_first_token_logprobs(path, out.prompt_token_ids)
        for token, lp in out.outputs[0].logprobs[0].items():
            assert abs(ref[token].item() - lp) < 1e-4, (name, token)
        assert out.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, 8)
    llm.check_integrity()


def test_a_prewarm_is_background_work_that_yields_to_requests(checkpoint) -> None:
    """A prewarm's fill jobs run on what requests leave: a request arriving meanwhile is answered
    by the step after it arrives; one that needs a document the prewarm is still computing
    promotes that job to an ordinary one; the prewarm completes and everything comes back."""
    path = checkpoint(arch="llama")
    llm = tiny_llm(
        path,
        kv_cache_tokens=1024,
        chunk_cache_size_gb=0.01,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
        chunk_layout="offset",  # its promoted job serves an offset request (the default is fusion)
    )
    engine = llm.engine
    finished: dict[str, RequestOutput] = {}

    def step() -> list[RequestOutput]:
        outputs = engine.step()
        finished.update({o.request_id: o for o in outputs if o.finished})
        return outputs

    docs = [" ".join(f"fact {i} number {j} is here." for j in range(12)) for i in range(6)]
    engine.add_prewarm("warm", system="Answer from the documents.", documents=docs)
    step()
    jobs = [s for s in [*engine.scheduler.running, *engine.scheduler.waiting] if s.kind.is_fill]
    assert len(jobs) >= 6 and all(j.kind.is_background for j in jobs)  # S may be done already
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("short", "Alice", greedy)
    firsts = [o for o in step() if o.request_id == "short"]
    assert firsts and firsts[0].outputs[0].token_ids  # the first step after it arrived
    last = jobs[-1]
    assert last.kind.is_background and last.num_computed == 0
    doc = next(d for d in docs if llm.tokenizer.encode(d, add_special_tokens=False) == last.token_ids)
    llm_prompt = "Answer from the documents. # # " + doc + " # # Which?"
    engine.add_request("needs", llm_prompt, greedy)
    step()
    assert not last.kind.is_background  # a request waits for it now
    while engine.has_unfinished_requests():
        step()
    assert set(finished) == {"warm", "short", "needs"}
    assert all(o.outputs[0].finish_reason != "error" for o in finished.values())
    assert llm.chunk_cache_stats()["entries"] == 7
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.check_integrity()


def _timed_steps(sched: Scheduler, blocks: BlockManager, steps: int, piece_s: float) -> list[dict[str, int]]:
    """Steps with a fake clock: a decode-only step takes 0.04 s, one with other work `piece_s`."""
    got = []
    for _ in range(steps):
        batch_seqs = _step_and_report(sched, blocks)
        only_decodes = all(n == 1 for n in batch_seqs[0].values())
        sched.step_took(batch_seqs[1], 0.04 if only_decodes else piece_s)
        got.append(batch_seqs[0])
    return got


def _step_and_report(sched: Scheduler, blocks: BlockManager):
    batch = sched.schedule()
    tokens = {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed += n
        blocks.register_full_blocks(seq.block_table, seq.token_ids, seq.block_hashes, seq.num_computed)
        if seq.num_computed == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq)
    return tokens, batch


@pytest.mark.parametrize(("piece_s", "least", "most"), [(0.8, 0.5, 0.6), (0.05, 0.8, 1.0)])
def test_running_streams_keep_their_share_of_the_decode_rate(
    piece_s: float, least: float, most: float
) -> None:
    """A step with a long prefill's piece takes 20 decode steps' time (a CPU): pieces run only
    while the stream keeps half its decode-only rate, so it does, and the long prompt still
    progresses. Where a piece costs little (a GPU) nothing is held back."""
    sched, blocks = _scheduler(budget=64, threshold=32)
    stream = _seq("stream", 4, max_out=10_000)
    sched.add(stream)
    _timed_steps(sched, blocks, 5, piece_s)  # decode-only steps: the idle rate
    sched.add(_seq("long", 3000))
    got = _timed_steps(sched, blocks, 200, piece_s)
    assert all(g["stream"] == 1 for g in got)
    seconds = sum(0.04 if set(g) == {"stream"} else piece_s for g in got)
    keep = (len(got) / seconds) / (1 / 0.04)
    assert least <= keep <= most, keep
    assert sum(g.get("long", 0) for g in got) >= 32 * 8  # still progresses
    # A short request is never held back.
    sched.add(_seq("short", 8))
    assert "short" in _timed_steps(sched, blocks, 1, piece_s)[0]


def test_min_decode_share_zero_turns_the_guard_off() -> None:
    blocks = BlockManager(256, 16, enable_prefix_caching=True, hash_seed="0", medium="GPU")
    config = SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=32, min_decode_share=0)
    sched = Scheduler(config, blocks)
    sched.add(_seq("stream", 4, max_out=10_000))
    _timed_steps(sched, blocks, 5, 0.8)
    sched.add(_seq("long", 3000))
    assert all("long" in g for g in _timed_steps(sched, blocks, 20, 0.8))


def test_short_prompts_do_not_make_long_prefills_look_cheap() -> None:
    """Short requests keep arriving (their steps cost little more than a decode step): the guard
    still prices a long prefill's step by the steps that ran one, and the stream keeps half."""
    sched, blocks = _scheduler(budget=64, threshold=32)
    sched.add(_seq("stream", 4, max_out=10_000))
    _timed_steps(sched, blocks, 5, 0.8)
    sched.add(_seq("long", 6000))
    seconds = steps = 0.0
    for i in range(300):
        if i % 3 == 0:
            sched.add(_seq(f"short{i}", 4, max_out=1))
        tokens, batch = _step_and_report(sched, blocks)
        cost = 0.8 if "long" in tokens else 0.04 if set(tokens) == {"stream"} else 0.06
        sched.step_took(batch, cost)
        seconds, steps = seconds + cost, steps + 1
    keep = (steps / seconds) / (1 / 0.04)
    assert keep >= 0.5, keep


@pytest.mark.parametrize("piece_s", [2.4, 10.0])
def test_a_long_prefill_is_not_starved_when_its_step_costs_more_than_the_window(piece_s: float) -> None:
    """A step with a piece costs 60 or 250 decode steps (the 1.5B on a CPU, where a blend piece
    of the budget costs ~250): the guard's window held ~50 steps, so after one such step it never
    let another through while the stream ran. Now the long prompt progresses and the stream
    still keeps about half its decode-only rate."""
    sched, blocks = _scheduler(budget=64, threshold=32)
    sched.add(_seq("stream", 4, max_out=100_000))
    _timed_steps(sched, blocks, 5, piece_s)
    sched.add(_seq("long", 3000))
    got = _timed_steps(sched, blocks, 3000, piece_s)
    pieces = sum(1 for g in got if "long" in g)
    seconds = sum(0.04 if set(g) == {"stream"} else piece_s for g in got)
    assert pieces >= 0.4 * 3000 * 0.04 / piece_s, pieces  # ~half the time goes to the long prompt
    assert (len(got) / seconds) / (1 / 0.04) >= 0.45
