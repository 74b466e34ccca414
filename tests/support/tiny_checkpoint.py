"""Tiny random Hugging Face checkpoints, built locally with `transformers` and `tokenizers`.

Tests and benchmarks need real checkpoints (a `config.json` written by transformers,
`*.safetensors` weights, a tokenizer with a chat template) without network access and without
downloading gigabytes. This module makes them from scratch, deterministically:

* `build_tokenizer` trains a byte-level BPE tokenizer (~1000 tokens) on a built-in synthetic
  English corpus, with BOS/EOS/PAD and ChatML special tokens and a ChatML chat template.
* `build_checkpoint` instantiates a Llama / Qwen2 / Qwen3 / Mistral model from a transformers
  config (so `config.json` is exactly what transformers itself writes, RoPE scaling included),
  fills its weights from a seeded generator and saves it with `save_pretrained`.

The same arguments always give byte-identical files, so a checkpoint can be cached on disk and
rebuilt anywhere. transformers is the oracle the engine is tested against; these checkpoints are
the common ground both load.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports stay lazy so that importing this module is cheap
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

__all__ = [
    "ARCHS",
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IM_END_TOKEN",
    "IM_START_TOKEN",
    "PAD_TOKEN",
    "PRESETS",
    "ROPE_TYPES",
    "SPECIAL_TOKENS",
    "build_checkpoint",
    "build_tokenizer",
    "checkpoint_config",
    "corpus",
]

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Order fixes the ids: the trainer assigns special tokens ids 0..4 in this order.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

TOKENIZER_VOCAB_SIZE = 1000

# ChatML, opened by BOS as Llama's templates are: a rendered chat is tokenized with
# add_special_tokens=False (as vLLM does), so the template alone writes the special prefix.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn", "dynamic")
PRESETS: tuple[str, ...] = ("tiny", "qwen2.5-0.5b")
_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

# Bump when the build recipe changes, so that on-disk caches keyed by the stamp are rebuilt.
_RECIPE_VERSION = 2
_STAMP_FILE = "chunkcache_build.json"

# --------------------------------------------------------------------------------------------
# Corpus and tokenizer
# --------------------------------------------------------------------------------------------

_NAMES = (
    "Zorvath", "Quilmar", "Bexley", "Tandro", "Mirela", "Okkun", "Veltra", "Sarnim", "Pellow",
    "Drusk", "Hanfeld", "Ilvani", "Corbin", "Yessa", "Ruthan", "Glimmer", "Nadox", "Ferrowin",
)  # fmt: skip
_PLACES = (
    "Ashford", "the Blue Valley", "Port Kellam", "Mount Orrin", "the old mill", "Lake Tessaly",
    "the northern market", "Brightwater", "the harbor", "Fennick Island", "the river town",
)  # fmt: skip
_THINGS = (
    "apples", "lanterns", "copper coins", "blue stones", "river boats", "old maps", "wool",
    "clocks", "letters", "bridges", "candles", "horses", "books", "glass jars", "seeds",
)  # fmt: skip
_VERBS = (
    "builds", "sells", "collects", "paints", "repairs", "counts", "carries", "finds", "keeps",
    "trades", "hides", "measures", "writes", "studies", "guards",
)  # fmt: skip
_ADJS = (
    "small", "large", "quiet", "bright", "ancient", "busy", "green", "cold", "famous", "strange",
    "tall", "gentle", "hidden", "golden",
)  # fmt: skip
_QUESTIONS = (
    "Who {verb} {thing} in {place}?",
    "How many {thing} does {name} have?",
    "Where does {name} live?",
    "What does {name} {verb_base}?",
    "Is {place} {adj}?",
    "When did {name} arrive in {place}?",
)
_SENTENCES = (
    "{name} {verb} {thing} in {place}.",
    "{name} lives in {place} and {verb} {num} {thing}.",
    "In {year}, {name} moved to {place}.",
    "The {adj} town of {place} has {num} {thing}.",
    "{name} and {name2} are friends; they met in {place}.",
    "Every morning {name} {verb} {thing}, and every evening {name2} {verb2} them.",
    "There are {num} {adj} {thing} near {place}.",
    '{name} said: "I have {num} {thing}!"',
    "The answer is {num}.",
    "{name} is {age} years old and very {adj}.",
    "Note #{num}: {place} is {adj} ({num2}% of days).",
)


def corpus(num_lines: int = 600, seed: int = 1234) -> list[str]:
    """The built-in training corpus: simple generated sentences, questions and `# #` prompts.

    Generated from a fixed seed so the tokenizer (and everything built on it) is reproducible.
    It mixes invented names, numbers, punctuation, the chunk separator `" # # "` and newlines,
    so all of those tokenize into reasonably short sequences.
    """
    rng = random.Random(seed)

    def fill(template: str) -> str:
        name, name2 = rng.sample(_NAMES, 2)
        verb, verb2 = rng.sample(_VERBS, 2)
        return template.format(
            name=name,
            name2=name2,
            verb=verb,
            verb2=verb2,
            verb_base=verb[:-1],
            thing=rng.choice(_THINGS),
            place=rng.choice(_PLACES),
            adj=rng.choice(_ADJS),
            num=rng.randint(0, 999),
            num2=rng.randint(0, 100),
            year=rng.randint(1700, 2030),
            age=rng.randint(2, 99),
        )

    lines: list[str] = []
    for i in range(num_lines):
        kind = i % 6
        if kind < 3:
            lines.append(fill(rng.choice(_SENTENCES)))
        elif kind == 3:
            lines.append(fill(rng.choice(_QUESTIONS)))
        elif kind == 4:
            # A chunked prompt as docs/design.md §2 writes it: S # # C1 # # C2 # # Q.
            parts = [fill(rng.choice(_SENTENCES)) for _ in range(rng.randint(2, 4))]
            lines.append(" # # ".join(["You are a helpful assistant.", *parts, fill(rng.choice(_QUESTIONS))]))
        else:
            lines.append(" ".join(fill(rng.choice(_SENTENCES)) for _ in range(3)) + "\n")
    return lines


def _train_tokenizer_json(texts: list[str], vocab_size: int, min_frequency: int) -> str:
    """Train the byte-level BPE on `texts` and return its `tokenizer.json` text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a chunk must tokenize the same wherever it sits (docs/design.md §2),
    # and decode(encode(x)) must give x back without an extra leading space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # Seeding the whole byte alphabet makes every string encodable (no unknown tokens).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # The template runs only when encode(..., add_special_tokens=True), which is exactly the
    # contract the engine relies on: S gets BOS, chunks and questions do not.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tok.to_str(pretty=True)


def build_tokenizer(
    out_dir: str | os.PathLike[str],
    texts: list[str] | None = None,
    vocab_size: int = TOKENIZER_VOCAB_SIZE,
    min_frequency: int = 1,
) -> PreTrainedTokenizerFast:
    """Train the tiny tokenizer, save it into `out_dir` (transformers format) and return it.

    `texts` defaults to the built-in `corpus()`.
    The result round-trips through `transformers.AutoTokenizer.from_pretrained(out_dir)`.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(
            _train_tokenizer_json(corpus() if texts is None else texts, vocab_size, min_frequency)
        ),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        # Byte-level BPE is lossless; the default clean-up would turn " ." into "." on decode.
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
        padding_side="left",
    )
    # save_jinja_files=False keeps the template inside tokenizer_config.json (the older, widely
    # read place) instead of a separate chat_template.jinja.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    return tokenizer


# --------------------------------------------------------------------------------------------
# Model config
# --------------------------------------------------------------------------------------------


def _rope_parameters(rope: str, rope_theta: float, max_position_embeddings: int) -> dict[str, Any]:
    """RoPE settings in transformers 5's `rope_parameters` form (`rope_theta` lives inside).

    Scaled variants pretend the model was pre-trained on a quarter of its context, so that the
    scaling actually changes some frequencies for the tiny head_dim of 16.
    """
    original = max(1, max_position_embeddings // 4)
    params: dict[str, Any]
    if rope == "default":
        params = {"rope_type": "default"}
    elif rope == "linear":
        params = {"rope_type": "linear", "factor": 2.0}
    elif rope == "llama3":
        # Llama 3.1's shape (low 1, high 4) with factor 4 so that original * factor = max positions.
        params = {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": original,
        }
    elif rope == "yarn":
        params = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": original}
    elif rope == "dynamic":
        params = {"rope_type": "dynamic", "factor": 2.0}
    else:
        raise ValueError(f"unknown rope {rope!r}; expected one of {ROPE_TYPES}")
    params["rope_theta"] = float(rope_theta)
    return params


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _tokenizer_ids() -> dict[str, int]:
    # The trainer places the special tokens first, in SPECIAL_TOKENS order.
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}


def checkpoint_config(
    arch: str = "llama",
    rope: str = "default",
    dtype: str = "float32",
    tie_word_embeddings: bool | None = None,
    preset: str = "tiny",
    sliding_window: int | None = None,
    **overrides: Any,
) -> PretrainedConfig:
    """The transformers config `build_checkpoint` would save (cheap: no weights are made).

    `overrides` are passed to the config constructor last, so any field can be changed
    (`num_hidden_layers=4`, `rms_norm_eps=1e-5`, ...).
    """
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {_DTYPES}")
    ids = _tokenizer_ids()
    if preset == "tiny":
        kw: dict[str, Any] = {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": _round_up(TOKENIZER_VOCAB_SIZE, 64),
            "max_position_embeddings": 2048,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        }
    elif preset == "qwen2.5-0.5b":
        if arch != "qwen2":
            raise ValueError("preset 'qwen2.5-0.5b' is a qwen2 model; pass arch='qwen2'")
        kw = {
            "hidden_size": 896,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "intermediate_size": 4864,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        }
    else:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
    if tie_word_embeddings is not None:
        kw["tie_word_embeddings"] = tie_word_embeddings
    kw.update(overrides)
    rope_theta = kw.pop("rope_theta")
    if "rope_parameters" not in kw:
        kw["rope_parameters"] = _rope_parameters(rope, rope_theta, kw["max_position_embeddings"])
    # Qwen3Config defaults head_dim to 128 whatever the hidden size; always pin it explicitly.
    kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    kw.setdefault("bos_token_id", ids[BOS_TOKEN])
    kw.setdefault("eos_token_id", ids[EOS_TOKEN])
    kw.setdefault("pad_token_id", ids[PAD_TOKEN])

    if arch == "llama":
        cls, arch_name = transformers.LlamaConfig, "LlamaForCausalLM"
    elif arch == "qwen2":
        cls, arch_name = transformers.Qwen2Config, "Qwen2ForCausalLM"
    elif arch == "qwen3":
        cls, arch_name = transformers.Qwen3Config, "Qwen3ForCausalLM"
    else:
        cls, arch_name = transformers.MistralConfig, "MistralForCausalLM"

    if arch == "mistral":
        # MistralConfig defaults to a 4096-token window; the engine does not support sliding
        # windows, so the default checkpoint must not have one.
        kw.setdefault("sliding_window", sliding_window)
    elif sliding_window is not None:
        kw.setdefault("sliding_window", sliding_window)
        if arch in ("qwen2", "qwen3"):
            # Qwen2/Qwen3 only apply the window when use_sliding_window is set (layer_types follow).
            kw.setdefault("use_sliding_window", True)
            kw.setdefault("max_window_layers", 0)
        # LlamaConfig has no window; the value is still saved, for loaders that must reject it.

    config = cls(**kw)
    config.architectures = [arch_name]
    config.dtype = dtype
    return config


# --------------------------------------------------------------------------------------------
# Weights and checkpoint
# --------------------------------------------------------------------------------------------


def _init_weights(model: Any, seed: int, num_real_tokens: int) -> None:
    """Fill every parameter from a seeded generator, in a fixed order.

    transformers' own init (std 0.02, unit norms, zero biases) makes a random model's logits
    nearly flat and its greedy output often one repeated token, and zero biases / unit norms
    would let an engine that forgets a bias or a norm weight still match. Instead:
    * linear weights ~ N(0, 1/fan_in) (unit gain), so every attention and MLP block adds O(1)
      per element to the residual and greedy continuations depend on the context;
    * embeddings ~ N(0, 0.1^2), small next to those block outputs (as in trained models). With
      tied embeddings a large embedding makes logit(t) = h . e_t dominated by |e_t|^2, i.e.
      the model repeats its input token forever;
    * the final norm gets gain 3, so logits have std ~2-3 and greedy argmaxes are well separated
      (no near-ties that float rounding could flip between two implementations);
    * other norm weights ~ 1 + N(0, 0.1^2) and biases ~ N(0, 0.1^2): non-trivial on purpose;
    * rows of the embedding / lm_head past the tokenizer's `num_real_tokens` (the vocab is
      padded to a multiple of 64) are zero, so their logit is exactly 0, far below the best
      real token's: greedy decoding never emits an id the tokenizer cannot decode (as with a
      trained model, whose padding rows are never trained towards).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters() deduplicates tied weights and has a stable order for a given config.
        for name, param in model.named_parameters():
            shape = param.shape
            if name.endswith("bias"):
                value = torch.randn(shape, generator=gen) * 0.1
            elif "norm" in name:
                value = 1.0 + torch.randn(shape, generator=gen) * 0.1
                if name == "model.norm.weight":
                    value = value * 3.0
            elif "embed_tokens" in name:
                value = torch.randn(shape, generator=gen) * 0.1
            elif len(shape) == 2:
                value = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
            else:
                raise AssertionError(f"unexpected parameter {name} {tuple(shape)}")
            if "embed_tokens" in name or name.startswith("lm_head"):
                value[num_real_tokens:] = 0.0
            param.copy_(value.to(param.dtype))


def _args_stamp(args: dict[str, Any]) -> str:
    blob = json.dumps({"recipe": _RECIPE_VERSION, **args}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _is_built(out: Path, stamp: str) -> bool:
    try:
        return json.loads((out / _STAMP_FILE).read_text())["stamp"] == stamp
    except (OSError, ValueError, KeyError):
        return False


def build_checkpoint(
    out_dir: str | os.PathLike[str],
    arch: str = "llama",
    rope: str = "default",
    dtype: str = "float32",
    tie_word_embeddings: bool | None = None,
    sharded: bool = False,
    seed: int = 0,
    preset: str = "tiny",
    sliding_window: int | None = None,
    **overrides: Any,
) -> Path:
    """Build a random checkpoint (config, safetensors weights, tokenizer, generation config).

    `out_dir` is also a cache: if it already holds a complete build with the same arguments
    (recorded in `chunkcache_build.json`), nothing is rebuilt. A build is written to a sibling
    temp directory and renamed into place, so an interrupted build never looks complete.
    `tie_word_embeddings=None` means the preset's default (tiny: False, qwen2.5-0.5b: True).
    `sharded=True` splits the weights over several files with `model.safetensors.index.json`.
    Returns `Path(out_dir)`.
    """
    out = Path(out_dir)
    args = {
        "arch": arch,
        "rope": rope,
        "dtype": dtype,
        "tie_word_embeddings": tie_word_embeddings,
        "sharded": sharded,
        "seed": seed,
        "preset": preset,
        "sliding_window": sliding_window,
        "overrides": overrides,
    }
    stamp = _args_stamp(args)
    if _is_built(out, stamp):
        return out
    # Validate (and fail fast) before touching the disk.
    config = checkpoint_config(arch, rope, dtype, tie_word_embeddings, preset, sliding_window, **overrides)

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    # mkdtemp makes the directory 0700; give the final checkpoint ordinary permissions.
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    try:
        # Build in float32 and cast once at the end, so every dtype holds the same values
        # up to rounding. from_config's own random init is overwritten by _init_weights.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _init_weights(model, seed, num_real_tokens=TOKENIZER_VOCAB_SIZE)
        model = model.to(getattr(torch, dtype)).eval()
        model.config.dtype = dtype
        ids = _tokenizer_ids()
        # Chat turns end with <|im_end|>, plain text with <|eos|>: stop on either (as Qwen does).
        model.generation_config = GenerationConfig(
            bos_token_id=ids[BOS_TOKEN],
            eos_token_id=[ids[EOS_TOKEN], ids[IM_END_TOKEN]],
            pad_token_id=ids[PAD_TOKEN],
        )
        if sharded:
            # A quarter of the weights per shard: always several shards, whatever the preset.
            total = sum(p.numel() * p.element_size() for p in model.parameters())
            max_shard_size: int | str = max(1, total // 4)
        else:
            max_shard_size = "100GB"
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        del model
        build_tokenizer(tmp)
        (tmp / _STAMP_FILE).write_text(
            json.dumps({"stamp": stamp, "args": args}, sort_keys=True, default=str)
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
