"""Engine options as command-line flags, generated from the config tree.

Every flag defaults to None ("not given"), so `EngineConfig.from_options` applies the environment
and then the config's own default, in that order. A new config field becomes a flag by itself; its
help comes from `OPTION_HELP` below (a test fails until the field has a line there), its choices
from `config.OPTION_CHOICES`, the tuples the validators check, so the two cannot disagree, and its
argument group (docs section) from `config.OPTION_GROUPS`. An option whose default depends on the
model shows the generic default and each known model's own (model/catalog.py).
"""

from __future__ import annotations

import argparse
import typing
from typing import Any

from chunkcache import envs
from chunkcache.config import (
    OPTION_CHOICES,
    OPTION_GROUPS,
    REQUEST_CHUNK_OPTIONS,
    EngineConfig,
    option_names,
    option_specs,
)
from chunkcache.errors import UsageError
from chunkcache.model.catalog import KNOWN_MODELS

MODEL_HELP = (
    "a known model's short name (qwen2.5-coder-1.5b, the default; smollm2; see `chunkcache models`), "
    "a checkpoint directory (config.json + safetensors), a .gguf file or a directory holding one, "
    "or a hub id where a hub is reachable"
)

# What each group of options serves: the description of its `--help` group (titled "<group> options")
# and of its docs/options.md section.
GROUP_HELP: dict[str, str] = {
    "model": "which model runs where, in which precision and with which kernels",
    "memory": "the paged KV cache of running requests, prefix caching, and the chunk KV pool with "
    "its disk and remote tiers",
    "scheduling": "what one engine step runs: how many sequences and tokens, how long prompts are cut",
    "reuse": "how a prompt's documents reuse their cached KV: chunking, the layout, fusion, blend, "
    "APE calibration, separator-free matching, exact follow-ups",
    "fidelity": "the fidelity gate (reuse chosen by the share of full prefill's answers it keeps) and "
    "its shadow checks",
    "server": "what the engine tells the outside: its served name and its KV events for a router",
}

# What each flat engine option does and the values it takes; `--help` adds the default and the
# choices. docs/chunk-cache.md and docs/operations.md explain the costs behind them.
OPTION_HELP: dict[str, str] = {
    "device": "torch device to run on: auto (CUDA, else Ascend NPU, else CPU), cpu, cuda, cuda:N, npu",
    "dtype": "weights and KV dtype; auto = bfloat16 on CPUs with native bf16 matrix instructions, "
    "float32 on other CPUs, the checkpoint's dtype elsewhere",
    "seed": "seed of the sampler's random generator (requests may set their own)",
    "served_model_name": "model name reported by /v1/models and accepted in requests (default: the path)",
    "tokenizer": "tokenizer directory or hub id used instead of the checkpoint's own",
    "adapter": "LoRA adapter directory (peft format) merged into the weights at load",
    "threads": "torch's and the C kernels' CPU threads, > 0 (default: the physical cores this process may use, capped by its cgroup CPU quota)",
    "narrow_weights": "CPU float32: also keep a plain weight layout for 1-3 sequence decode steps "
    "(faster decode, up to 2x weight memory)",
    "compile_decode": "compile one-sequence decode steps with torch.compile at start "
    "(faster decode: the 1.5B's at llama.cpp's speed; 12-50 s start-up on SmolLM2, ~100 s on the 1.5B; "
    "needs a C++ compiler)",
    "weights": "CPU: how projections hold their weights: dense (dequantized to dtype), native (a GGUF's "
    "own quantization: 4-bit types as int4 with their codes, 5-8-bit ones re-quantized to int8 per "
    "channel, others dense), int8 (per output channel, any checkpoint); quantized products of many rows "
    "(prefill) multiply float32 blocks dequantized from the codes, no dense copy held; native also keeps "
    "the token embedding as the file's blocks (rows dequantized per lookup, exactly) unless a tied lm_head "
    "reads it densely; auto (CPU and GGUF, else dense): per projection kind and GGUF type, native unless "
    "dense measures over 1.1x as fast at both 1 and 128 rows at load (timings logged)",
    "int8_activations": "CPU, quantized weights under the AVX2 kernel: a decode step's products "
    "(every sequence of a batch, with the numbers of its step alone) round the activations to int8 per block "
    "of 32 and sum integer products, as llama.cpp does (prompts keep float32), and native "
    "weights hold Q6_K and Q4_K tensors as the file's own blocks (exact; 0.82x the bytes of int8, 0.9x "
    "int4's with its factors); "
    "off keeps float32 activations",
    "require_kernels": "CPU: refuse to start (exit 2, naming the reason) where the C kernels of "
    "quantized products cannot be built or loaded, instead of serving with torch's slower ones",
    "block_size": "tokens per paged KV block, > 0",
    "kv_cache_tokens": "KV cache budget in tokens, >= block_size; wins over --kv-cache-memory-gb "
    "(default: 0.5 GiB)",
    "kv_cache_memory_gb": "KV cache budget in GiB, > 0 (default when neither budget is given: 0.5)",
    "enable_prefix_caching": "reuse the KV of identical prompt prefixes (hash-chained blocks)",
    "hash_seed": "seed of the first block's parent hash, any string (default: PYTHONHASHSEED, "
    "else random per process as in vLLM)",
    "prefix_caching_hash_algo": "block hash function, as vLLM's --prefix-caching-hash-algo",
    "max_num_seqs": "sequences scheduled together at most, > 0",
    "max_num_batched_tokens": "tokens run in one step at most (longer prompts are prefilled in pieces), > 0",
    "long_prefill_token_threshold": "a prefill longer than this runs in pieces of at most this many "
    "tokens per step (a last piece of at most 1/8 of it joins the one before; a blend: as many of "
    "its layers as that many tokens' work; a fusion request's streams: together), after the "
    "step's decodes and short prompts, > 0",
    "max_long_partial_prefills": "long prefills (more than long_prefill_token_threshold tokens left; "
    "a fusion request's joint stream once chosen) computed at once, oldest first; the others wait, "
    "short prompts pass them, > 0",
    "min_decode_share": "while streams decode, long prefills and background work run only while the "
    "streams keep at least this share of their decode-only rate, in [0, 1); 0 = off",
    "max_model_len": "prompt plus generated tokens at most, > 0 (default: the model's context length)",
    "enable_chunk_cache": "reuse documents' KV wherever they sit in a prompt (chunked prompts)",
    "chunk_separator": "non-empty text that splits a prompt into S SEP C1 SEP ... SEP Q",
    "chunk_cache_size_gb": "memory budget of the chunk KV pool in GiB, >= 0",
    "chunk_cache_lru_threshold": "pool usage share in (0, 1] above which LRU eviction starts",
    "chunk_cache_hash_algorithm": "hash of a chunk's key (model, system part, chunk tokens)",
    "chunk_layout": "isolated: chunks share one position range, exact reuse without recompute; "
    "offset: chunks at their natural positions, cached K re-rotated, then blend; "
    "fusion: one exact stream per chunk (S + Ci + Q), their next-token distributions combined each step",
    "max_chunks": "chunks allowed in one prompt, > 0; more is a 400",
    "chunk_cache_disk_dir": "directory of a disk tier under the pool (one safetensors file per chunk)",
    "chunk_cache_disk_gb": "size of the disk tier in GiB, > 0",
    "chunk_cache_remote": "redis://host:port/db (or rediss://, unix://) of a remote tier shared by replicas",
    "blend_check_layers": "layout offset: increasing layer indices below the model's depth at which "
    "blend selects the tokens to recompute",
    "blend_recompute_ratios": "share of chunk tokens recomputed at each check layer, one per layer, "
    "in [0, 1], not increasing (1 = full prefill, 0 = pure reuse)",
    "blend_selector": "how blend ranks tokens: K or V deviation at the check layer (check layers from 1), "
    "a deviation threshold, the question's attention, or each chunk's stored deviation",
    "blend_unit": "token: recompute the selected tokens; chunk: whole chunks within the same token budget",
    "blend_threshold": "selector threshold: recompute tokens whose relative K deviation exceeds it, >= 0",
    "blend_boundary_tokens": "EPIC: always recompute the first k tokens of every chunk, >= 0",
    "blend_min_tokens": "prompts with fewer chunk tokens than this get a plain prefill, >= 0",
    "calibration_temperature": "APE: temperature of the attention the question pays the chunks, > 0 "
    "(1 = exact)",
    "calibration_scale": "APE: factor on the chunks' total attention, > 0 (1 = exact)",
    "separator_free": "layouts offset and fusion: find cached documents inside plain prompts (no separator needed)",
    "separator_free_min_tokens": "shortest matched run reused by separator-free matching, >= 1",
    "documents_format": "how a chat request's documents are written when its template has none; "
    "must contain {text}, may contain {title}",
    "exact_follow_ups": "layouts offset and fusion: prefill a document order seen exact_follow_ups_sights times as background work so "
    "that later requests with the same system part and documents in the same order are answered exactly, as "
    "one plain prompt over that prefix (under fusion: no streams), as a prefix cache serves a repeated prompt; "
    "needs prefix caching",
    "exact_prefix_reads": "layouts offset and fusion: a request whose system part and documents, in this order, "
    "are in the prefix cache as a plain prefill's KV runs as that plain prompt (only its question computed, a "
    "full prefill's answer); exact_follow_ups implies it; needs prefix caching",
    "exact_follow_ups_sights": "with exact_follow_ups: requests that must show a document order before its "
    "background prefill is queued: 1 the first, 2 a repeat (no job for orders seen once: random retrieval "
    "pays nothing), >= 1",
    "fusion_rule": "layout fusion: how the streams' distributions combine: contrastive (PCED, against the "
    "no-document stream), max_confidence (the surest stream decides), product (relevance-weighted experts)",
    "fusion_amateur": "layout fusion: add the no-document stream S + Q (required by contrastive)",
    "fusion_contrast_weight": "layout fusion, contrastive: beta, how far each document stream is pushed away "
    "from the no-document stream, in [0, 100]",
    "fusion_relevance_weight": "layout fusion, contrastive: gamma, weight of each stream's relevance (its "
    "log-likelihood of the question) when choosing the stream, in [0, 100]",
    "fusion_pair": "layout fusion: add the exact stream S + Ci + Cj + Q over the two documents whose streams "
    "find the question most likely (one document more prefilled): none, expert (one more stream under the "
    "rule), lead (the only document stream the rule reads)",
    "fusion_pair_margin": "layout fusion with fusion_pair: add the pair stream only when the two most relevant "
    "documents' relevance (mean log-likelihood of the question, nats) differ by at most this, in [0, 100] "
    "(100: always)",
    "fusion_max_joint": "layout fusion with fusion_pair: the joint stream reads every document within "
    "fusion_pair_margin of the most relevant one, at most this many (>= 2; 2: the pair stream; each "
    "document beyond the first is prefilled)",
    "fusion_joint_blend": "layout fusion with fusion_pair lead: blend the joint stream's documents after the "
    "first (their cached KV re-rotated, the blend_* options' share recomputed) instead of prefilling them",
    "fusion_joint_excerpt": "layout fusion with fusion_pair: the joint stream reads at most this many tokens of "
    "each document after its first: its first line and the lines sharing the question's words (0: all; "
    "a document under 4 budgets, or sharing no word, all of it; not under fusion_joint_blend)",
    "fusion_max_streams": "layout fusion: at most this many document streams (the most relevant) decode past "
    "the first step; 0: all",
    "kv_events_endpoint": "ZMQ endpoint to publish KV events on, e.g. tcp://*:5557 (default: off)",
    "kv_events_topic": "KV event topic (default: kv@<instance>@<model>)",
    "kv_events_replay_endpoint": "ZMQ ROUTER endpoint serving missed event batches by sequence number",
    "kv_events_buffer_steps": "published batches the replay socket keeps, > 0",
    "kv_events_curve_secret_key": "ZMQ CURVE: this engine's secret certificate file (encrypts events)",
    "kv_events_curve_authorized_keys": "ZMQ CURVE: directory of public keys (*.key) allowed to connect",
    "kv_events_curve_server_key": "ZMQ CURVE: the router's public key file, when the PUB socket connects",
    "kv_events_insecure": "bind KV event sockets on non-loopback addresses without CURVE (anyone who reaches "
    "them reads prompts' token ids); otherwise a wildcard host binds 127.0.0.1",
    "fidelity_target": "share of full prefill's replies/answers reuse must keep, in (0, 1]: at start the "
    "engine serves chunked prompts with the fastest configuration of the model's profile (chunkcache "
    "calibrate) that kept that much by the lower end of its 95-percent (Wilson) interval, else the most accurate one (default: off, the model's own defaults)",
    "fidelity_profile": "with fidelity_target: a profile file, or a folder of profiles named by model "
    "identity (default: $CHUNKCACHE_FIDELITY_DIR, else ~/.cache/chunkcache/fidelity)",
    "fidelity_sample_rate": "share of chunked requests served by the engine's reuse configuration that "
    "are re-run as a full prefill in background time and compared with it (greedy replies token by token, "
    "sampled ones by their next-token distributions), in [0, 1] (default: 0.01 with fidelity_target, else 0)",
    "fidelity_distribution_steps": "a sampled reply's shadow check compares the next-token distributions "
    "(total variation) of its first this many tokens with full prefill's, teacher-forced on the reply",
    "fidelity_window": "shadow checks the controller judges a configuration by (rolling agreement), and "
    "waits for after each move before the next; with a profile it climbs to a more accurate "
    "configuration below fidelity_target, steps back towards speed above target + fidelity_margin",
    "fidelity_margin": "how far above fidelity_target the rolling agreement must stay for the controller "
    "to step back towards speed, in [0, 1)",
    "fidelity_max_share": "the most share of the engine's step CPU time shadow checks may take, in (0, 1]: "
    "a request drawn for a check while their share is above it is not checked (counted over_budget)",
}


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The engine options as flags, one argument group per `OPTION_GROUPS` entry."""
    specs = option_specs()
    for group_name, names in OPTION_GROUPS.items():
        group = parser.add_argument_group(f"{group_name} options", GROUP_HELP[group_name])
        for name in names:
            _add_flag(group, name, *specs[name])
    return parser


def _add_flag(group: argparse._ArgumentGroup, name: str, tp: Any, default: Any) -> None:
    """One option's flag: its form from its type (a bool gets --no-), every default None so that
    `EngineConfig.from_options` can tell a flag given from one left to the environment and model."""
    flag = "--" + name.replace("_", "-")
    what = OPTION_HELP.get(name, f"engine option {name}")
    help_text = what if "(default:" in what else f"{what} (default: {_show(default)}{_per_model(name)})"
    choices = OPTION_CHOICES.get(name)
    if tp is bool:
        group.add_argument(
            flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
    elif typing.get_origin(tp) in (list, tuple):
        item = typing.get_args(tp)[0] if typing.get_args(tp) else str
        group.add_argument(flag, dest=name, type=item, nargs="+", default=None, help=help_text)
    elif tp in (int, float, str):
        group.add_argument(flag, dest=name, type=tp, default=None, choices=choices, help=help_text)
    else:
        raise TypeError(f"engine option {name} has type {tp!r}, which has no command-line form")


def _per_model(name: str, quote: str = "") -> str:
    """The known models that are served with their own default of this option, with it: the
    catalog's `chunk_defaults` / `engine_defaults` (empty where none sets it)."""
    own = [
        f"{model.name}: {quote}{_show(value)}{quote}"
        for model in KNOWN_MODELS.values()
        for option, value in model.chunk_defaults + model.engine_defaults
        if option == name
    ]
    return "; " + "; ".join(own) if own else ""


def _show(default: Any) -> str:
    if default is None:
        return "unset"
    if isinstance(default, tuple):
        return " ".join(str(v) for v in default)
    return repr(default).replace("%", "%%")  # argparse formats help with %


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line."""
    return {name: getattr(args, name) for name in option_names() if getattr(args, name, None) is not None}


def engine_config(model: str, args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The validated config of the command line's engine options (and the environment's).

    A value the config refuses (out of range, unknown name, a malformed environment variable) is
    the user's mistake, so it becomes a `UsageError`: one line, no traceback.
    """
    try:
        return EngineConfig.from_options(model, **{**overrides, **engine_options(args)})
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from e


def options_markdown() -> str:
    """docs/options.md: every engine option with its flag, default, values, environment variables
    and whether a request may set it, from the same sources as `--help` (a test keeps the file equal
    to this; `python -m chunkcache.engine_args > docs/options.md` rewrites it)."""
    lines = [
        "# Engine options",
        "",
        "Generated by `python -m chunkcache.engine_args > docs/options.md` from the config tree",
        "(`chunkcache/config.py`), `engine_args.OPTION_HELP` and the model catalog; do not edit by hand.",
        "Each option is a keyword of `LLM(...)` and a flag of `chunkcache generate | serve | eval |",
        "prewarm`; those marked *request* are also fields of a completions or chat body (and",
        "`chunk_options=` offline). A default that depends on the model shows the generic one (any model",
        "not in the catalog) and then each known model's own (`chunkcache/model/catalog.py`).",
        "Grouped by what the options serve:",
        "",
        *(f"- [{group}](#{group}-options): {GROUP_HELP[group]}" for group in OPTION_GROUPS),
    ]
    specs = option_specs()
    for group, names in OPTION_GROUPS.items():
        lines += ["", f"## {group.capitalize()} options", "", GROUP_HELP[group].capitalize() + ".", ""]
        lines += ["| option / flag | default | what it does | environment |", "|---|---|---|---|"]
        lines += [_markdown_row(name, *specs[name]) for name in names]
    return "\n".join(lines) + "\n"


def _markdown_row(name: str, tp: Any, default: Any) -> str:
    """One option's row of docs/options.md."""
    flag = "--" + name.replace("_", "-")
    if tp is bool:
        flag += f" / --no-{name.replace('_', '-')}"
    what = OPTION_HELP.get(name, "")
    if name in OPTION_CHOICES:
        what += "; one of " + ", ".join(f"`{c}`" for c in OPTION_CHOICES[name])
    if name in REQUEST_CHUNK_OPTIONS:
        what += " (*request*)"
    env = ", ".join(f"`{v}`" for v in envs.env_names(name))
    shown = f"`{_show(default)}`" if default is not None else "unset"
    shown = (shown + _per_model(name, quote="`")).replace("%%", "%")
    cells = [f"`{name}` `{flag}`", shown, what, env]
    return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


if __name__ == "__main__":
    print(options_markdown(), end="")
