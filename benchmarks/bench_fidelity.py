"""What reuse costs in answers: correct answers per reuse mode on real text with a real model.

Each question of `fidelity_set` (real encyclopedic texts, 3-5 documents, the answer in one or two
of them; `--set`: those "original" questions, the "counterfactual" ones of `counterfactual_set`,
whose answer fact was replaced in its document so that no model knows it, or both) is rendered with the model's chat template as a chunked prompt:
system turn, then the user turn `SEP doc1 SEP ... SEP docN SEP question`, split by the engine.
"full" is a full prefill of exactly the same tokens (the chunked prompt's token ids as a plain
prompt); "closed" is the same question with no documents at all (a plain prompt: what the model
answers from memory); every other mode is a chunked request over a warm chunk pool (the documents
were seen before, as in production). Greedy answers; correct = every expected answer in the reply.

Per mode: accuracy with a 95% bootstrap interval, answers kept / lost / gained against full
(paired, per question), the warm TTFT of a one-token request, wall and CPU time, as a ratio
against full on the same prompts, modes interleaved per question (rotating order), and decode
tokens/s of the answer runs (the engine's first-token to finish time). Everything is reported per
set; with "closed" run, also on the document-dependent questions alone (those the model misses
closed-book), where the documents, not memory, must supply the answer. Prints tables, writes JSON,
a PNG per set (accuracy against TTFT speedup), and one SUMMARY line per set.

    python benchmarks/bench_fidelity.py --threads 1 [--set both] [--split heldout] [--limit N] [--modes ...]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import counterfactual_set
import fidelity_set
from tqdm import tqdm

from chunkcache import LLM, SamplingParams
from chunkcache.config import WEIGHTS
from chunkcache.fidelity import measure
from chunkcache.fidelity.configs import CANDIDATES
from chunkcache.fidelity.configs import fusion as _fusion
from chunkcache.fidelity.configs import offset as _offset
from chunkcache.fidelity.measure import SYSTEM

SEP = " # # "
LABEL_MARK = "~"  # MODE~LABEL: a mode run on another model variant (an adapter, a dtype, a device)
CLOSED = "closed"  # the mode that asks the question without the documents
SETS = ("original", "counterfactual")
__all__ = ["SEP", "SYSTEM"]  # bench_separator_free's prompt format


def _query(layer: int, ratio: float, unit: str = "token") -> dict[str, Any]:
    return _offset([layer], [ratio], blend_selector="query_attention", blend_unit=unit)


# name -> chunk options (None = a plain prompt: full prefill, or for "closed" the question alone).
# Recovery methods are options of the same blend.
MODES: dict[str, dict[str, Any] | None] = {
    "full": None,
    CLOSED: None,
    # Fusion (issue 32): one exact stream per document (S + Ci + Q), combined every decode step.
    "fusion/max_confidence": _fusion("max_confidence", fusion_amateur=False),
    "fusion/product": _fusion("product", fusion_amateur=False),
    "fusion/contrastive": _fusion("contrastive", fusion_amateur=True),
    # The relevance bonus (gamma) decides which stream speaks when the streams' own contrast
    # is close; gamma 0 lets a second document's stream take over for the second half of a
    # two-document answer.
    **{
        f"fusion/contrastive/g{g}": _fusion("contrastive", fusion_amateur=True, fusion_relevance_weight=g)
        for g in (0.0, 0.5)
    },
    # A stronger contrast (beta) pushes a stream away from what the model says without documents.
    **{
        f"fusion/contrastive/b{b}": _fusion("contrastive", fusion_amateur=True, fusion_contrast_weight=b)
        for b in (0.25, 0.5, 1.0)
    },
    # A third kind of stream for two-document questions: S + Ci + Cj + Q, exact, over the two
    # documents whose streams find Q most likely; one more expert, or the only document stream read.
    "fusion/contrastive/pair": _fusion("contrastive", fusion_amateur=True, fusion_pair="expert"),
    "fusion/contrastive/pairlead": _fusion("contrastive", fusion_amateur=True, fusion_pair="lead"),
    # The pair only where the two most relevant documents are close (fusion_pair_margin, chosen by
    # benchmarks/fusion_pair_margin.py: 0.2 on SmolLM2's tune questions). Margin 0.0 never adds it
    # (the replies of fusion/contrastive) but still decides, so `record` gets every relevance cheaply.
    **{
        f"fusion/contrastive/pairlead/m{m}": _fusion(
            "contrastive", fusion_amateur=True, fusion_pair="lead", fusion_pair_margin=m
        )
        for m in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0)
    },
    # The joint stream over up to k documents within the margin of the most relevant one
    # (fusion_max_joint; k = 2 is the pair above), for questions that need three documents.
    **{
        f"fusion/contrastive/joint{k}/m{m}": _fusion(
            "contrastive", fusion_amateur=True, fusion_pair="lead", fusion_pair_margin=m, fusion_max_joint=k
        )
        for k in (3, 4)
        for m in (0.6, 0.8, 1.0, 1.5, 2.0)
    },
    # Its documents after the first blended (fusion_joint_blend: the cached KV re-rotated, 15%
    # recomputed at layer 1) instead of prefilled.
    **{
        f"fusion/contrastive/joint{k}b/m{m}": _fusion(
            "contrastive",
            fusion_amateur=True,
            fusion_pair="lead",
            fusion_pair_margin=m,
            fusion_max_joint=k,
            fusion_joint_blend=True,
        )
        for k in (2, 3, 4)
        for m in (0.6, 0.8, 1.0, 1.5, 2.0)
    },
    # At most s document streams decode past the first step (fusion_max_streams): many documents.
    **{
        f"fusion/contrastive/pairlead/m0.6/s{n}": _fusion(
            "contrastive",
            fusion_amateur=True,
            fusion_pair="lead",
            fusion_pair_margin=0.6,
            fusion_max_streams=n,
        )
        for n in (2, 4)
    },
    **{
        f"fusion/contrastive/joint3/m0.6/s{n}": _fusion(
            "contrastive",
            fusion_amateur=True,
            fusion_pair="lead",
            fusion_pair_margin=0.6,
            fusion_max_joint=3,
            fusion_max_streams=n,
        )
        for n in (1, 2)
    },
    # The joint stream reads at most x tokens of each document after its first: its first line and
    # the lines sharing the question's words (fusion_joint_excerpt; off by default).
    **{
        f"fusion/contrastive/joint3/m0.6/s1/x{x}": {
            **CANDIDATES["fusion/contrastive/joint3/m0.6/s1"],
            "fusion_joint_excerpt": x,
        }
        for x in (48, 64, 96)
    },
    "isolated": {"chunk_layout": "isolated"},
    "offset": _offset([0], [0.0]),
    "blend@0.15": _offset([1], [0.15]),
    "blend@0.3": _offset([1], [0.3]),
    "blend@0.5": _offset([1], [0.5]),
    "blend@0.9": _offset([1], [0.9]),
    "query@0.15": _query(1, 0.15),
    "query@0.3": _query(1, 0.3),
    "query@0.3/L4": _query(4, 0.3),
    "qchunk@0.3": _query(1, 0.3, "chunk"),
    "qchunk@0.3/L4": _query(4, 0.3, "chunk"),
    "qchunk@0.5/L4": _query(4, 0.5, "chunk"),
    "kchunk@0.3": _offset([1], [0.3], blend_unit="chunk"),
    # Gradual filtering (CacheBlend): a deeper second check ranks what the first kept.
    "blend@0.5,0.15/L1,4": _offset([1, 4], [0.5, 0.15]),
    "blend@0.6,0.3/L1,4": _offset([1, 4], [0.6, 0.3]),
    # EPIC: the first 8 tokens of every document always run, on top of the 15% by K deviation.
    "blend@0.15+b8": _offset([1], [0.15], blend_boundary_tokens=8),
    # Ranked by the sensitivity each entry measured once (engine/sensitivity.py), chosen before
    # layer 0 (/L0: the others never run) or at layer 1 (every document token runs layer 0).
    **{f"stored@{r}/L0": _offset([0], [r], blend_selector="stored_deviation") for r in (0.15, 0.3, 0.4)},
    **{f"stored@{r}": _offset([1], [r], blend_selector="stored_deviation") for r in (0.15, 0.3)},
}


def _ape(base: str, temperature: float, scale: float) -> dict[str, Any]:
    options = MODES[base]
    assert options is not None
    return {**options, "calibration_temperature": temperature, "calibration_scale": scale}


# APE's calibration (attention temperature T, scale s of Q's attention to the chunks), measured on
# the tune split only: it lowered the share of full's answers kept under every layout.
for _base, _points in (
    ("isolated", ((0.8, 1.0), (0.6, 1.0))),
    ("offset", ((0.9, 1.0), (0.8, 1.0))),
    ("blend@0.15", ((0.9, 1.0), (0.8, 1.0), (0.6, 1.0), (1.0, 0.7), (0.8, 1.2))),
):
    for _t, _s in _points:
        MODES[f"{_base}+ape{_t}/{_s}"] = _ape(_base, _t, _s)


@dataclass
class ModeResult:
    """Per question id: correct or not, the reply, the share of document tokens recomputed,
    (for the timed questions) the warm TTFT as (wall, cpu) seconds, and the answer run's decode
    as (tokens after the first, seconds from the first token to the last)."""

    correct: dict[str, bool] = field(default_factory=dict)
    replies: dict[str, str] = field(default_factory=dict)
    recomputed: dict[str, float] = field(default_factory=dict)
    ttft: dict[str, tuple[float, float]] = field(default_factory=dict)
    decode: dict[str, tuple[int, float]] = field(default_factory=dict)


def render(tokenizer: Any, docs: list[str], question: str) -> str:
    """The benchmark's prompt: the system turn, then `SEP doc1 ... SEP docN SEP question`."""
    return measure.render(tokenizer, docs, question, SEP)


def render_closed(tokenizer: Any, question: str) -> list[int]:
    """The closed-book prompt: the same system turn and question, no documents (token ids, so that
    the engine takes it as a plain prompt)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _decode(out: Any) -> tuple[int, float]:
    metrics = out.metrics
    return len(out.outputs[0].token_ids) - 1, metrics.finished_time - metrics.first_token_time


def evaluate(
    llm: LLM,
    questions: list[fidelity_set.Question],
    modes: dict[str, dict[str, Any] | None],
    max_tokens: int,
    ttft_every: int,
    elements: dict[int, fidelity_set.Element],
    checkpoint: Any = None,
) -> dict[str, ModeResult]:
    """Every question through every mode; `checkpoint(results)` is called after each question."""
    results = {name: ModeResult() for name in modes}
    answer = SamplingParams(temperature=0, max_tokens=max_tokens)
    names = list(modes)
    for i, q in enumerate(tqdm(questions, desc="questions", unit="q")):
        text = render(llm.tokenizer, q.documents(elements), q.question)
        parsed = measure.parse(llm, text)
        full_ids = parsed.all_token_ids()
        closed_ids = render_closed(llm.tokenizer, q.question)
        # Warm the pool: production reuse means the documents were seen before (and, for the
        # modes that rank by it, each entry measured its sensitivity; here in a request of
        # another blend key, so that no mode finds its own blended blocks).
        # Plain prompts only (full, closed): nothing reads the pool, so no warm request is spent.
        if any(o is not None for o in modes.values()):
            measure.warm(
                llm, text, any(o and o.get("blend_selector") == "stored_deviation" for o in modes.values())
            )
        timed = ttft_every > 0 and i % ttft_every == 0
        rotation = names[i % len(names) :] + names[: i % len(names)]  # interleave, rotating order
        for name in rotation:
            options = modes[name]
            prompt: str | list[int] = closed_ids if name == CLOSED else full_ids if options is None else text
            res = results[name]
            blended = 0
            if timed:
                # Timed before the answer run: a full prefill must not hit its own prompt's
                # blocks in the prefix cache (only a shared system part, as in production).
                wall, cpu, blended = measure.ttft(llm, prompt, options)
                res.ttft[q.qid] = (wall, cpu)
            out = measure.run(llm, prompt, answer, options)
            reply = out.outputs[0].text
            res.replies[q.qid] = reply
            res.correct[q.qid] = fidelity_set.correct(reply, q.answers)
            res.decode[q.qid] = _decode(out)
            blended = max(blended, out.num_blend_recomputed_tokens)
            share = measure.recomputed_share(options, blended, parsed)
            res.recomputed[q.qid] = 0.0 if name == CLOSED else share
        if checkpoint is not None:
            checkpoint(results)
    return results


def bootstrap(values: list[bool], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def summarize(results: dict[str, ModeResult], questions: list[fidelity_set.Question]) -> list[dict[str, Any]]:
    full = results["full"]
    qids = [q.qid for q in questions]
    # TTFT on the questions every timed mode timed (merged runs may have timed different ones).
    timing = [r for r in results.values() if any(qid in r.ttft for qid in qids)]
    timed = [qid for qid in qids if timing and all(qid in r.ttft for r in timing)]
    full_wall = sum(full.ttft[qid][0] for qid in timed)
    full_cpu = sum(full.ttft[qid][1] for qid in timed)
    rows = []
    for name, res in results.items():
        hits = [res.correct[qid] for qid in qids]
        lo, hi = bootstrap(hits)
        kept = sum(res.correct[q] and full.correct[q] for q in qids)
        lost = sum(full.correct[q] and not res.correct[q] for q in qids)
        gained = sum(res.correct[q] and not full.correct[q] for q in qids)
        by_hops: dict[int, list[bool]] = defaultdict(list)
        for q in questions:
            by_hops[q.hops].append(res.correct[q.qid])
        row: dict[str, Any] = {
            "mode": name,
            "n": len(qids),
            "accuracy": sum(hits) / len(hits),
            "ci95": [lo, hi],
            "single": sum(by_hops[1]) / max(1, len(by_hops[1])),
            "double": sum(by_hops[2]) / max(1, len(by_hops[2])),
            "kept": kept,
            "lost": lost,
            "gained": gained,
            # Replies word for word full prefill's: a numerically different full prefill (another
            # dtype, quantized weights) changes some replies before it changes any answer.
            "same": sum(res.replies[q] == full.replies[q] for q in qids),
            "full_correct": sum(full.correct[q] for q in qids),
            "kept_share": kept / max(1, sum(full.correct[q] for q in qids)),
            "recomputed_share": sum(res.recomputed[q] for q in qids) / len(qids),
            # Counterfactual questions: replies that give the real value the document no longer holds.
            "memory": sum(
                fidelity_set.correct(res.replies[q.qid], memory)
                for q in questions
                if (memory := getattr(q, "memory", None))
            ),
        }
        steps = [res.decode[qid] for qid in qids if qid in res.decode and res.decode[qid][0] > 0]
        if steps:
            row["decode_tps"] = sum(n for n, _ in steps) / max(1e-9, sum(t for _, t in steps))
        if timed and all(qid in res.ttft for qid in timed):
            wall = sum(res.ttft[qid][0] for qid in timed)
            row["ttft_ms"] = 1000 * wall / len(timed)
            row["speedup_wall"] = full_wall / wall
            row["speedup_cpu"] = full_cpu / max(1e-9, sum(res.ttft[qid][1] for qid in timed))
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'mode':<22}{'acc':>7}{'95% CI':>16}{'1-doc':>7}{'2-doc':>7}{'kept':>9}{'lost':>6}"
        f"{'gained':>8}{'same':>6}{'mem':>5}{'recomp':>8}{'TTFT ms':>9}{'x wall':>8}{'x cpu':>7}{'dec t/s':>8}"
    )
    for r in rows:
        ci = f"{100 * r['ci95'][0]:.1f}-{100 * r['ci95'][1]:.1f}"
        print(
            f"{r['mode']:<22}{100 * r['accuracy']:>6.1f}%{ci:>16}{100 * r['single']:>6.1f}%"
            f"{100 * r['double']:>6.1f}%{r['kept']:>5}/{r['full_correct']:<3}{r['lost']:>6}{r['gained']:>8}"
            f"{r['same']:>6}{r['memory']:>5}{100 * r['recomputed_share']:>7.1f}%{r.get('ttft_ms', float('nan')):>9.1f}"
            f"{r.get('speedup_wall', float('nan')):>8.2f}{r.get('speedup_cpu', float('nan')):>7.2f}"
            f"{r.get('decode_tps', float('nan')):>8.1f}"
        )


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, r in enumerate(rows):
        if "speedup_wall" not in r or r["mode"] == CLOSED:
            continue
        is_full = r["mode"] == "full"
        ax.errorbar(
            r["speedup_wall"],
            100 * r["accuracy"],
            yerr=[[100 * (r["accuracy"] - r["ci95"][0])], [100 * (r["ci95"][1] - r["accuracy"])]],
            fmt="*" if is_full else "o",
            markersize=12 if is_full else 6,
            color="black" if is_full else None,
            capsize=3,
        )
        ax.annotate(
            r["mode"],
            (r["speedup_wall"], 100 * r["accuracy"]),
            textcoords="offset points",
            xytext=(5, 4 if k % 2 else -12),  # alternate sides: close points' names do not overlap
            fontsize=8,
        )
    full = next(r for r in rows if r["mode"] == "full")
    ax.axhline(100 * full["accuracy"] * 0.95, linestyle=":", color="grey", label="95% of full's accuracy")
    ax.set_xscale("log")
    ax.set_xlabel("warm TTFT speedup over full prefill (x, wall, log scale)")
    ax.set_ylabel("correct answers (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def question_set(q: fidelity_set.Question) -> str:
    return "counterfactual" if isinstance(q, counterfactual_set.CounterfactualQuestion) else "original"


def load_questions(which: str) -> list[fidelity_set.Question]:
    """The frozen questions of `which` set ("original", "counterfactual" or "both")."""
    original = fidelity_set.load() if which in ("original", "both") else []
    counterfactual = counterfactual_set.load() if which in ("counterfactual", "both") else []
    return [*original, *counterfactual]


def report(results: dict[str, ModeResult], questions: list[fidelity_set.Question], args: Any) -> None:
    """Everything apart per question set: the two sets measure different things."""
    for name in SETS:
        qs = [q for q in questions if question_set(q) == name]
        if qs:
            print(f"\n=== {name} set ===")
            plot_path: Path | None = args.plot
            if plot_path is not None and name != "original":
                plot_path = plot_path.with_stem(f"{plot_path.stem}_{name}")
            report_set(results, qs, plot_path, f"{name}, {Path(args.model).name}", name)


def _document_dependent(results: dict[str, ModeResult], qs: list[fidelity_set.Question]):
    """The questions the model misses closed-book (empty when "closed" was not run)."""
    closed = results.get(CLOSED)
    return [q for q in qs if closed is not None and not closed.correct[q.qid]]


def report_set(
    results: dict[str, ModeResult],
    questions: list[fidelity_set.Question],
    plot_path: Path | None,
    title: str,
    name: str,
) -> None:
    """Tables for every split and for its document-dependent questions, the plot and the SUMMARY
    line (held-out part)."""
    splits = {"tune": [], "heldout": []}
    for q in questions:
        splits[q.split].append(q)
    summary_rows: list[dict[str, Any]] = []
    choice_rows: list[dict[str, Any]] = []  # the default is chosen on these (the tune split)
    # TTFT is a property of the prompts' shape: a split without timed questions shows the
    # speedups measured on the timed questions of the whole set.
    overall = {r["mode"]: r for r in summarize(results, questions)}
    parts = [("all", questions), *splits.items()]
    parts += [
        (f"{split}, document-dependent", _document_dependent(results, qs)) for split, qs in splits.items()
    ]
    for split, qs in parts:
        if not qs:
            continue
        rows = summarize(results, qs)
        for row in rows:
            if "speedup_wall" not in row and "speedup_wall" in overall[row["mode"]]:
                row.update({k: overall[row["mode"]][k] for k in ("ttft_ms", "speedup_wall", "speedup_cpu")})
        print(f"\n{split}: {len(qs)} questions ({sum(q.hops == 2 for q in qs)} need two documents)")
        print_table(rows)
        if split == "heldout" or not summary_rows:
            summary_rows, summary_split = rows, split
        if split == "tune" or not choice_rows:
            choice_rows, choice_split = rows, split
    if plot_path:
        plot(summary_rows, plot_path, f"bench_fidelity: {summary_split} questions, {title}")
    full = next(r for r in summary_rows if r["mode"] == "full")
    # The default rule (issue 15): the fastest mode keeping >= 95% of full's correct answers, else
    # the one keeping most among those >= 2x faster; chosen on "tune", reported on "heldout".
    # "closed" reads no document: never a candidate.
    fast = [r for r in choice_rows if r["mode"] not in ("full", CLOSED) and r.get("speedup_wall", 0) >= 2.0]
    keeping = [r for r in fast if r["kept_share"] >= 0.95]
    best = (
        max(keeping, key=lambda r: r["speedup_wall"])
        if keeping
        else max(fast, key=lambda r: (r["kept_share"], r["accuracy"]), default=None)
    )
    shown = {r["mode"]: r for r in summary_rows}
    best_text = (
        f"default {best['mode']} (chosen on {choice_split}) keeps {100 * shown[best['mode']]['kept_share']:.0f}% "
        f"of full's answers at {best['speedup_wall']:.2f}x"
        if best
        else "no mode >= 2x"
    )
    print(
        f"SUMMARY bench_fidelity set={name} n={full['n']} split={summary_split} full={100 * full['accuracy']:.1f}% "
        + " ".join(f"{r['mode']}={100 * r['accuracy']:.1f}%" for r in summary_rows if r["mode"] != "full")
        + f" | {best_text}"
    )


def _dump(results: dict[str, ModeResult], path: Path) -> None:
    path.write_text(json.dumps({m: asdict(r) for m, r in results.items()}))


def _load(paths: list[Path]) -> dict[str, ModeResult]:
    merged: dict[str, ModeResult] = {}
    for path in paths:
        for mode, raw in json.loads(path.read_text()).items():
            res = merged.setdefault(mode, ModeResult())
            res.correct.update(raw["correct"])
            res.replies.update(raw["replies"])
            res.recomputed.update(raw["recomputed"])
            res.ttft.update({k: tuple(v) for k, v in raw["ttft"].items()})
            res.decode.update({k: tuple(v) for k, v in raw.get("decode", {}).items()})
    return merged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint (default: chunkcache's default model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--weights",
        default="dense",
        choices=WEIGHTS,
        help="how projections hold their weights (engine option `weights`; label the run with --label). "
        "dense by default, as every recorded run was, whatever the model serves by default",
    )
    parser.add_argument(
        "--int8-activations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="engine option `int8_activations` (default: the engine's)",
    )
    parser.add_argument(
        "--compile-decode", action="store_true", help="engine option `compile_decode` (label the run)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", choices=[*SETS, "both"], default="original", help="which questions")
    parser.add_argument("--split", choices=["all", "tune", "heldout"], default="all")
    parser.add_argument(
        "--limit", type=int, default=0, help="first N questions of each set's split (0 = all)"
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), help=f"from {list(MODES)}")
    parser.add_argument(
        "--docs",
        type=int,
        choices=[1, 2],
        default=None,
        help="only the questions needing this many documents",
    )
    parser.add_argument(
        "--without-full",
        action="store_true",
        help="do not run full prefill (--merge the --raw file with a run that did)",
    )
    parser.add_argument(
        "--qids", nargs="+", default=None, help="only these question ids (after the other filters)"
    )
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--ttft-every", type=int, default=4, help="time the TTFT of every k-th question")
    parser.add_argument("--elements", type=Path, default=None, help="element texts exported as JSON")
    parser.add_argument("--shard", default="0/1", help="I/N: run every N-th question from the I-th")
    parser.add_argument("--raw", type=Path, default=None, help="write per-question results here")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, help="report on --raw files")
    parser.add_argument("--skip", type=Path, nargs="+", default=[], help="skip questions done in --raw files")
    parser.add_argument(
        "--timing", type=Path, nargs="+", default=[], help="with --merge: take the TTFTs from these files"
    )
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument(
        "--adapter",
        type=Path,
        default=None,
        help="a LoRA adapter (training/reuse_adapter.py) merged into the model; its modes are labelled "
        "with the adapter directory's name unless --label says otherwise",
    )
    parser.add_argument(
        "--label",
        default=None,
        help="name this run's modes MODE~LABEL, so that --merge compares them with another run's full "
        "prefill (e.g. a bfloat16 run against the float32 one: how many answers a numerically "
        "equivalent full prefill keeps)",
    )
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {list(MODES)}")
    modes = {m: MODES[m] for m in dict.fromkeys([*([] if args.without_full else ["full"]), *args.modes])}
    questions = load_questions(args.set)
    if args.split != "all":
        questions = [q for q in questions if q.split == args.split]
    if args.limit:  # the first N of each set
        questions = [
            q for name in SETS for q in [q for q in questions if question_set(q) == name][: args.limit]
        ]
    if args.docs:  # after --limit: the first N's two-document questions, which earlier runs hold
        questions = [q for q in questions if q.hops == args.docs]
    if args.qids:
        questions = [q for q in questions if q.qid in set(args.qids)]
    if args.model is None:
        from chunkcache.model.loader import model_path

        args.model = str(model_path("smollm2"))
    if args.merge:
        results = _load(args.merge)
        if args.timing:
            # Accuracy from one run (e.g. every question on a GPU), TTFT from another (a CPU).
            timing = _load(args.timing)
            for mode, res in results.items():
                # A labelled run's modes take the base mode's TTFT where they have none of their own
                # (an adapter's modes run the same kernels over merged weights).
                base = mode.split(LABEL_MARK)[0]
                res.ttft = (
                    timing[mode].ttft if mode in timing else timing[base].ttft if base in timing else {}
                )
        # The questions that every merged mode answered (a mode may have run on a subset).
        report(results, [q for q in questions if all(q.qid in r.correct for r in results.values())], args)
        return
    # Done = answered by a full prefill, labelled or not (a --label run names it full~LABEL).
    skipped = _load(args.skip) if args.skip else {}
    done = {
        qid for mode, res in skipped.items() if mode.split(LABEL_MARK)[0] == "full" for qid in res.correct
    }
    index, count = (int(x) for x in args.shard.split("/"))
    questions = [q for q in questions if q.qid not in done][index::count]
    adapter = str(args.adapter) if args.adapter else None
    label = args.label or (args.adapter.name if adapter else None)
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        adapter=adapter,
        weights=args.weights,
        **({} if args.int8_activations is None else {"int8_activations": args.int8_activations}),
        **({"compile_decode": True} if args.compile_decode else {}),
        **measure.ENGINE_OPTIONS,  # no mode may read the full prefill's exact prefix
    )
    t0 = time.time()
    elements = fidelity_set.load_elements(args.elements)

    def labelled(res: dict[str, ModeResult]) -> dict[str, ModeResult]:
        return {f"{m}{LABEL_MARK}{label}": r for m, r in res.items()} if label else res

    dump = (lambda res: _dump(labelled(res), args.raw)) if args.raw else None
    results = labelled(evaluate(llm, questions, modes, args.max_tokens, args.ttft_every, elements, dump))
    print(f"{len(questions)} questions, model {args.model}, {time.time() - t0:.0f} s")
    if args.raw:
        _dump(results, args.raw)
    if count == 1 and "full" in results:
        report(results, questions, args)
    elif count == 1:
        print("labelled modes are compared with another run's full prefill: --merge this --raw file with it")


if __name__ == "__main__":
    sys.exit(main())
