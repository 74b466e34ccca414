"""`chunkcache calibrate`: measure what each reuse configuration keeps of full prefill on a model.

Every prompt runs under full prefill and under each candidate configuration (greedy, warm pool,
`fidelity.measure`); per configuration the profile records the share of full prefill's replies /
correct answers kept, the share of document tokens recomputed and the warm TTFT against full
prefill's. Results are appended per prompt to `<identity>.results.jsonl` beside the profile, so an
interrupted run resumes where it stopped; the profile `<identity>.json` (and a PNG) is rewritten
from all of them at the end.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from chunkcache.config import ReuseOptions
from chunkcache.errors import InvalidRequestError
from chunkcache.fidelity import measure
from chunkcache.fidelity import profile as profiles
from chunkcache.fidelity.configs import FULL, ChunkOptions
from chunkcache.fidelity.prompts import CalibrationPrompt

if TYPE_CHECKING:
    from chunkcache.llm import LLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Paths:
    profile: Path
    results: Path
    plot: Path

    @classmethod
    def beside(cls, out: Path, identity: str) -> Paths:
        stem = out / identity
        return cls(
            out / profiles.file_name(identity), stem.with_suffix(".results.jsonl"), stem.with_suffix(".png")
        )


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """The results file's records by prompt key (a torn last line, from a killed run, is ignored)."""
    records: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("key"), str):
            records[record["key"]] = record
    return records


def run(
    llm: LLM,
    prompts: list[CalibrationPrompt],
    configs: dict[str, ChunkOptions],
    max_tokens: int,
    results: Path,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every prompt not yet in `results` under full prefill and every configuration, appended to it
    as it goes. Returns the records of `prompts` (old and new) and the prompts that failed."""
    done = read_results(results)
    wanted: dict[str, ChunkOptions | None] = {FULL: None, **configs}
    todo = [
        p
        for p in prompts
        if not set(wanted) <= set(done.get(p.key(p.tokens(max_tokens)), {}).get("outcomes", {}))
    ]
    if len(todo) < len(prompts):
        logger.info(
            "resuming: %d of %d prompts already measured in %s",
            len(prompts) - len(todo),
            len(prompts),
            results,
        )
    sep = llm.engine.config.chunk.separator
    failed: list[str] = []
    results.parent.mkdir(parents=True, exist_ok=True)
    torn = results.exists() and results.stat().st_size > 0 and not results.read_bytes().endswith(b"\n")
    with results.open("a") as f:
        if torn:  # a run killed mid-line: the next record starts on a line of its own
            f.write("\n")
        for i, p in enumerate(tqdm(todo, desc="calibrate", unit="prompt")):
            text = measure.render(llm.tokenizer, list(p.documents), p.question, sep, p.system)
            try:
                outcomes = measure.measure(llm, text, wanted, p.tokens(max_tokens), rotate=i)
            except (InvalidRequestError, ValueError) as e:  # e.g. longer than the model's context
                failed.append(f"prompt {p.question[:40]!r}: {e}")
                continue
            record = {
                "key": p.key(p.tokens(max_tokens)),
                "answers": p.answers,
                "outcomes": {n: {**asdict(o), "correct": p.correct(o.reply)} for n, o in outcomes.items()},
            }
            f.write(json.dumps(record) + "\n")
            f.flush()
            done[record["key"]] = record
    keys = [p.key(p.tokens(max_tokens)) for p in prompts]
    return [done[k] for k in keys if k in done], failed


def _measured(name: str, options: ChunkOptions, records: list[dict[str, Any]]) -> profiles.Measured:
    rows = [
        (r["outcomes"][FULL], r["outcomes"][name], r["answers"]) for r in records if name in r["outcomes"]
    ]
    counted = kept = identical = answered = right = 0
    for full, mine, answers in rows:
        same = mine["reply"] == full["reply"]
        identical += same
        if answers is None:
            counted += 1
            kept += same
            continue
        answered += 1
        right += bool(mine["correct"])
        if full["correct"]:
            counted += 1
            kept += bool(mine["correct"])
    full_ttft = sum(full["ttft_s"] for full, _, _ in rows)
    ratio = sum(mine["ttft_s"] for _, mine, _ in rows) / full_ttft if rows and full_ttft > 0 else None
    n = len(rows)
    return profiles.Measured(
        name,
        ReuseOptions.from_mapping(options),
        prompts=n,
        counted=counted,
        kept=kept,
        kept_fraction=kept / counted if counted else None,
        identical=identical / n if n else None,
        accuracy=right / answered if answered else None,
        recomputed_share=sum(mine["recomputed"] for _, mine, _ in rows) / n if n else None,
        ttft_ratio=ratio,
        speedup=1 / ratio if ratio else None,
    )


def summarize(
    llm: LLM,
    identity: str,
    prompt_set: str,
    configs: dict[str, ChunkOptions],
    records: list[dict[str, Any]],
    max_tokens: int,
) -> profiles.Profile:
    full = [r["outcomes"][FULL] for r in records]
    graded = [o["correct"] for o in full if o["correct"] is not None]
    return profiles.Profile(
        model=llm.engine.model_name,
        identity=identity,
        device=str(llm.engine.device),
        dtype=str(llm.engine.runner.dtype).removeprefix("torch."),
        prompt_set=prompt_set,
        max_tokens=max_tokens,
        prompts=len(records),
        full_accuracy=sum(graded) / len(graded) if graded else None,
        full_ttft_ms=1000 * sum(o["ttft_s"] for o in full) / len(full) if full else None,
        configurations=tuple(_measured(name, options, records) for name, options in configs.items()),
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ci(c: profiles.Measured) -> str:
    interval = c.kept_interval()
    return "-" if interval is None else f"{100 * interval[0]:.0f}-{100 * interval[1]:.0f}%"


def table(profile: profiles.Profile, target: float) -> str:
    """The profile as a table; `*` marks what an engine with `fidelity_target target` would use."""
    chosen = (
        profiles.choose(profile, target).chosen.name
        if any(c.complete for c in profile.configurations)
        else None
    )
    width = max(22, 2 + max(len(c.name) for c in profile.configurations))  # the name column
    lines = [
        f"{profile.model} ({profile.dtype}, {profile.device}): {profile.prompts} prompts ({profile.prompt_set}); "
        f"full prefill {_pct(profile.full_accuracy)} correct, warm TTFT {profile.full_ttft_ms or 0:.1f} ms",
        f"{'configuration':<{width}}{'kept':>12}{'kept %':>8}{'95% CI':>10}{'same reply':>11}{'correct':>9}{'recomputed':>11}"
        f"{'TTFT ratio':>11}{'speedup':>9}",
    ]
    for c in profile.configurations:
        mark = "*" if c.name == chosen else " "
        ratio = "-" if c.ttft_ratio is None else f"{c.ttft_ratio:.3f}"
        speed = "-" if c.speedup is None else f"{c.speedup:.2f}x"
        lines.append(
            f"{mark}{c.name:<{width - 1}}{f'{c.kept}/{c.counted}':>12}{_pct(c.kept_fraction):>8}{_ci(c):>10}{_pct(c.identical):>11}"
            f"{_pct(c.accuracy):>9}{_pct(c.recomputed_share):>11}{ratio:>11}{speed:>9}"
        )
    if chosen is not None:
        lines.append(f"* fidelity_target {target:g}: {profiles.choose(profile, target).reason(target)}")
    return "\n".join(lines)


def plot(profile: profiles.Profile, target: float, path: Path) -> str:
    """A PNG of kept share against warm TTFT speedup; without matplotlib, says so instead."""
    try:
        import matplotlib
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install 'chunkcache[calibrate]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in profile.configurations:
        if c.complete:
            ax.plot(c.speedup, 100 * (c.kept_fraction or 0), "o")
            ax.annotate(
                c.name, (c.speedup, 100 * (c.kept_fraction or 0)), textcoords="offset points", xytext=(5, 4)
            )
    ax.axhline(100 * target, linestyle=":", color="grey", label=f"target {target:g}")
    ax.set_xscale("log")
    ax.set_xlabel("warm TTFT speedup over full prefill (x, log scale)")
    ax.set_ylabel("full prefill's replies/answers kept (%)")
    ax.set_title(
        f"chunkcache calibrate: {profile.model}, {profile.dtype}, {profile.prompts} prompts", fontsize=9
    )
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def check_args(args: Any) -> dict[str, ChunkOptions]:
    """The command line's mistakes, before the model loads; returns the configurations to measure."""
    from chunkcache.config import REQUEST_CHUNK_OPTIONS
    from chunkcache.engine_args import engine_options
    from chunkcache.errors import UsageError
    from chunkcache.fidelity.configs import CANDIDATES

    if not 0 < args.target <= 1:
        raise UsageError(f"--target must be a fraction in (0, 1], got {args.target}")
    if args.limit < 0 or args.max_tokens <= 0:
        raise UsageError("--limit must be >= 0 and --max-tokens > 0")
    given = engine_options(args)
    fixed = sorted(k for k in given if k in REQUEST_CHUNK_OPTIONS or k.startswith("fidelity_"))
    if given.get("enable_chunk_cache") is False:
        fixed.append("enable_chunk_cache")  # without it every configuration is a full prefill
    # The full prefill's KV would serve every configuration:
    fixed += [k for k in ("exact_follow_ups", "exact_prefix_reads") if given.get(k)]
    if fixed or "served_model_name" in given:
        raise UsageError(
            f"calibrate measures its own reuse configurations on the weights: drop {fixed or ['served_model_name']} "
            "(--target sets the target the table marks)"
        )
    unknown = [c for c in args.configs or [] if c not in CANDIDATES]
    if unknown:
        raise UsageError(f"unknown configurations {unknown}; known: {list(CANDIDATES)}")
    return {c: CANDIDATES[c] for c in args.configs or CANDIDATES}


def load_prompts(args: Any, separator: str) -> tuple[list[CalibrationPrompt], str]:
    """The prompts and a description of where they come from; bad lines are reported and skipped."""
    import sys

    from chunkcache.errors import UsageError
    from chunkcache.fidelity import prompts as fp

    if args.prompts is None:
        try:
            found = fp.builtin(args.limit, args.set, args.split)
        except ModuleNotFoundError as e:
            raise UsageError(str(e)) from None
        split = "" if args.split == "all" else f", {args.split} split"
        return found, f"built-in questions ({args.set}{split})"
    path = Path(args.prompts)
    if not path.is_file():
        raise UsageError(f"--prompts {path} is not a file")
    found, errors = fp.read_file(path, separator)
    for error in errors:
        print(f"skipped {error}", file=sys.stderr)
    if not found:
        raise UsageError(f"--prompts {path} holds no valid prompt")
    return (found[: args.limit] if args.limit else found), str(path)


def command(args: Any, load_llm: Any) -> int:
    """`chunkcache calibrate`: measure, write the profile, the table and the PNG."""
    from chunkcache import envs
    from chunkcache.engine_args import engine_config
    from chunkcache.fidelity.configs import fits
    from chunkcache.fidelity.gate import identity

    configs = check_args(args)
    separator = engine_config(args.model or "default", args).chunk.separator
    prompts, prompt_set = load_prompts(args, separator)
    llm = load_llm(args, **measure.ENGINE_OPTIONS)
    try:
        layers = llm.engine.spec.num_layers
        too_deep = [c for c, o in configs.items() if not fits(o, layers)]
        if too_deep:
            logger.warning("skipped %s: check layers beyond the model's %d layers", too_deep, layers)
        configs = {c: o for c, o in configs.items() if c not in too_deep}
        ident = identity(llm.engine.runner.model, llm.tokenizer, llm.engine.model_name)
        paths = Paths.beside(Path(args.out or envs.fidelity_dir()).expanduser(), ident)
        records, failed = run(llm, prompts, configs, args.max_tokens, paths.results)
        for failure in failed:
            print(f"failed {failure}")
        if not records:
            print("no prompt could be measured: no profile written")
            return 1
        profile = summarize(llm, ident, prompt_set, configs, records, args.max_tokens)
    finally:
        llm.close()
    paths.profile.write_text(profile.to_json())
    print(table(profile, args.target))
    print(f"wrote {paths.profile} (results per prompt: {paths.results})")
    print(plot(profile, args.target, paths.plot))
    return 0
