"""`chunkcache serve | route | generate | eval | calibrate | prewarm | models | env`: one entry point, one sub-command per job."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from chunkcache.engine_args import MODEL_HELP, add_engine_arguments, engine_config, engine_options
from chunkcache.errors import UsageError, add_debug_argument, run_command

if TYPE_CHECKING:
    from chunkcache.llm import LLM


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from a prompt offline and print the result")
    p.add_argument(
        "--model",
        default=None,
        help=MODEL_HELP,
    )
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    p.add_argument("--chat", action="store_true", help="render each prompt as a user message first")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="tokens to generate at most, > 0 (default: %(default)s)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help=">= 0; 0 = greedy (default: %(default)s)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling share, in (0, 1] (default: %(default)s)"
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=-1,
        help="sample among the k likeliest tokens; -1 = all (default: %(default)s)",
    )
    p.add_argument("--stop", action="append", default=None, help="stop at this string; repeat for several")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="also return this many top log-probabilities per token, >= 0",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_arguments(p)


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="quality of chunk reuse modes against a full prefill")
    p.add_argument(
        "--model",
        default=None,
        help=MODEL_HELP,
    )
    p.add_argument("--prompts", required=True, help="JSONL: {'prompt': 'S # # C1 # # ... # # Q'} per line")
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        help="modes to run (default: all): full isolated offset blend@R... boundary-K",
    )
    p.add_argument(
        "--ratios", type=float, nargs="+", default=[0.05, 0.15, 0.3], help="blend recompute ratios"
    )
    p.add_argument("--check-layer", type=int, default=1, help="the blend check layer")
    p.add_argument("--boundary-tokens", type=int, default=4, help="k of the boundary-k (EPIC) mode")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy continuation length for exact match")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    add_engine_arguments(p)


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure what each reuse configuration keeps of full prefill on a model: a profile "
        "for --fidelity-target",
    )
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument(
        "--prompts",
        default=None,
        help='JSONL, one a line: {"documents": [...], "question": "...", "answers": [...] optional, '
        '"system": "..." optional} (default: the built-in fidelity questions)',
    )
    p.add_argument(
        "--target",
        type=float,
        default=0.95,
        help="the target the table marks a choice for (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="profile folder (default: $CHUNKCACHE_FIDELITY_DIR or ~/.cache/chunkcache/fidelity)",
    )
    p.add_argument("--limit", type=int, default=0, help="measure the first N prompts only (0 = all)")
    p.add_argument(
        "--set",
        choices=["original", "counterfactual", "both", "rag", "all"],
        default="all",
        help="built-in questions: the fidelity sets (original, counterfactual, both: 3-5 short "
        "documents), the real RAG shape (rag: 8 alike documents of ~500 tokens, questions over one "
        "to three of them), or all (default: %(default)s, alternating)",
    )
    p.add_argument(
        "--split",
        choices=["all", "tune", "heldout"],
        default="all",
        help="built-in questions: which half of each set (default: %(default)s); calibrate on "
        "tune to keep heldout for judging the choice (bench_fidelity_gate.py --split heldout)",
    )
    p.add_argument(
        "--configs", nargs="+", default=None, help="reuse configurations to measure (default: all)"
    )
    p.add_argument("--max-tokens", type=int, default=24, help="greedy reply length (default: %(default)s)")
    add_engine_arguments(p)


def run_calibrate(args: argparse.Namespace) -> int:
    from chunkcache.fidelity.calibrate import command

    return command(args, load_llm)


def _add_prewarm(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prewarm", help="compute documents' KV offline into the disk or remote chunk tier")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument(
        "--documents",
        required=True,
        help='JSONL, one item a line: {"system": "...", "documents": ["...", ...]} or '
        '{"prompt": "S # # C1 # # ... # # Q"} (the question is ignored)',
    )
    p.add_argument("--window", type=int, default=8, help="items in flight at once (default: %(default)s)")
    add_engine_arguments(p)


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the models known by a short name; install one")
    p.add_argument("--install", metavar="NAME", default=None, help="download, join and verify this model")


def run_models(args: argparse.Namespace) -> int:
    import logging

    from chunkcache.model import catalog, fetch

    if args.install is not None:
        model = catalog.known(args.install)
        if model is None:
            raise UsageError(f"unknown model {args.install!r}; known: {', '.join(catalog.KNOWN_MODELS)}")
        logging.basicConfig(level="INFO", format="%(message)s")
        print(fetch.install(model))
        return 0
    for model in catalog.KNOWN_MODELS.values():
        path = catalog.candidate_path(model)
        installed = path is not None and path.is_file()
        if installed and model.source is catalog.Source.PART_PACKAGES:
            installed = fetch.is_verified(model, path)
        default = " (default)" if model.name == catalog.DEFAULT_MODEL else ""
        print(f"{model.name}{default}: {model.title}, {model.size_bytes / 1e9:.2f} GB, {model.license}")
        print(f"  source: {model.publisher}; sha256 {model.sha256}")
        print(f"  {'installed: ' + str(path) if installed else 'not installed: ' + model.install_hint()}")
    return 0


def _add_env(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "env",
        help="what a bug report needs: versions, CPU features, kernels, dtype and weights auto, "
        "threads, models installed",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument(
        "--require-kernels",
        action="store_true",
        help="build the C kernels now (into the kernel cache) and exit 2 naming why where they do not "
        "build or load (the container image's build step)",
    )


def run_env(args: argparse.Namespace) -> int:
    from chunkcache.collect_env import command

    return command(args.json, args.require_kernels)


def load_llm(args: argparse.Namespace, **overrides: Any) -> LLM:
    """The command line's engine. Options are validated before the model loads; what the model
    refuses while loading (a checkpoint it cannot read, check layers beyond its depth) is the
    user's mistake too, so a ValueError here is a `UsageError`."""
    from chunkcache.llm import LLM
    from chunkcache.model.loader import default_model

    model = args.model or default_model()
    engine_config(model, args, **overrides)
    try:
        return LLM(model, **{**overrides, **engine_options(args)})
    except ValueError as e:
        raise UsageError(str(e)) from e


def run_prewarm(args: argparse.Namespace) -> int:
    items = []
    with open(args.documents) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{args.documents}:{number}: not JSON: {e}") from None
            if not isinstance(item, dict):
                raise UsageError(f"{args.documents}:{number}: expected a JSON object")
            items.append(item)
    chunk = engine_config(args.model or "default", args).chunk  # checked before the model loads
    if not (chunk.disk_dir or chunk.remote):
        raise UsageError(
            "prewarm needs a tier to fill: --chunk-cache-disk-dir and/or --chunk-cache-remote "
            "(or CHUNKCACHE_CHUNK_CACHE_DISK_DIR / CHUNKCACHE_CHUNK_CACHE_REMOTE)"
        )
    llm = load_llm(args)
    try:
        outputs = llm.prewarm(items, use_tqdm=True, window=args.window)
        tiers = llm.chunk_cache_stats()["tiers"]  # type: ignore[index]
    finally:
        llm.close()
    failed = [o for o in outputs if o.error is not None]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    summary = {"items": len(outputs), "failed": len(failed), "tokens": tokens, "already_cached": cached}
    print(json.dumps({**summary, "tiers": tiers}))
    return 1 if failed else 0


def run_eval(args: argparse.Namespace) -> int:
    from chunkcache.evaluate import default_modes, evaluate, format_table, load_prompts, results_json
    from chunkcache.fidelity.measure import ENGINE_OPTIONS

    # The file and the modes are checked before the model loads: a mistake is reported at once.
    try:
        prompts = load_prompts(args.prompts, engine_config(args.model or "default", args).chunk.separator)
    except ValueError as e:  # not JSON, or a record without the fields it needs
        raise UsageError(str(e)) from e
    modes = default_modes(args.ratios, args.boundary_tokens, args.check_layer)
    if args.modes:
        known = {m.name for m in modes}
        unknown = [m for m in args.modes if m not in known]
        if unknown:
            raise UsageError(f"unknown modes {unknown}; available: {sorted(known)}")
        # The reference is always computed first: every other mode is measured against it.
        modes = [m for m in modes if m.name == "full" or m.name in args.modes]
    for name in ("exact_follow_ups", "exact_prefix_reads"):
        if engine_options(args).get(name):
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"eval measures reuse modes against a full prefill: drop {flag}")
    llm = load_llm(args, enable_prefix_caching=False, **ENGINE_OPTIONS)
    results = evaluate(llm, prompts, modes, args.max_tokens)
    print(format_table(results, args.max_tokens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results_json(results), f, indent=2)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from chunkcache.sampling import SamplingParams

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
        )
        params.validate()
    except ValueError as e:
        raise UsageError(str(e)) from e
    llm = load_llm(args)
    for prompt in args.prompt:
        start = time.perf_counter()
        if args.chat:
            out = llm.chat([{"role": "user", "content": prompt}], params)[0]
        else:
            out = llm.generate([prompt], params)[0]
        elapsed = time.perf_counter() - start
        completion = out.outputs[0]
        record = {
            "prompt": prompt,
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(completion.token_ids),
            "cached_tokens": out.num_cached_tokens,
            "chunk_cached_tokens": out.num_chunk_cached_tokens,
            "ttft_s": round(out.metrics.ttft or 0.0, 4),
            "total_s": round(elapsed, 4),
        }
        if args.json:
            print(json.dumps(record))
        else:
            print(completion.text)
            print(
                f"[{record['prompt_tokens']} prompt tokens, {record['cached_tokens']} cached "
                f"({record['chunk_cached_tokens']} from the chunk cache), {record['completion_tokens']} "
                f"generated, TTFT {record['ttft_s'] * 1000:.1f} ms, {completion.finish_reason}]",
                file=sys.stderr,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse, then dispatch. Nothing heavy is imported before dispatching: `route` runs without torch."""
    parser = argparse.ArgumentParser(prog="chunkcache", description=__doc__)
    add_debug_argument(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_eval(sub)
    _add_calibrate(sub)
    _add_prewarm(sub)
    _add_models(sub)
    _add_env(sub)

    from chunkcache.router.app import add_route_arguments, run_route
    from chunkcache.server.cli import add_serve_arguments, run_serve

    add_serve_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    add_route_arguments(sub.add_parser("route", help="KV-cache-aware router in front of several servers"))
    for command in sub.choices.values():
        add_debug_argument(command, sub_command=True)
    args = parser.parse_args(argv)
    commands = {
        "models": run_models,
        "env": run_env,
        "generate": run_generate,
        "eval": run_eval,
        "calibrate": run_calibrate,
        "prewarm": run_prewarm,
        "serve": run_serve,
        "route": run_route,
    }
    return run_command(parser.prog, lambda: commands[args.command](args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
