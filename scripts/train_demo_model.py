#!/usr/bin/env python
"""Train the bundled demo models: small Qwen3s that answer questions about documents.

    python scripts/train_demo_model.py --out-dir chunkcache/demo        # the whole recipe, < 1 h on 2 cores
    python scripts/train_demo_model.py --tiny --steps 5 --out /tmp/tiny  # seconds (the test does this)

The recipe (`--out-dir`): both variants trained from scratch side by side, one thread each
(`--steps`, 2400 each, ~48 min on this 2-core machine): `model-full` on full causal prompts only,
`model-block` also on the chunk-isolated layout (Block-Attention style). One run alone:
`--variant full|block --out DIR`; `--init-from CKPT` continues a checkpoint (a second stage).

Task and prompt format: `chunkcache/demo/corpus.py`. Every example is a chunked chat prompt

    <|bos|><|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n # # {doc 1} # # ... # # {doc n}
    # # {question}<|im_end|>\\n<|im_start|>assistant\\n  ->  " {answer}<|im_end|>"

with 2-6 documents about invented entities drawn fresh per example; the answer restates the fact
sentence it rests on ("Zorvak has 4120 people."), for two-hop questions the bridge sentence and
then that one. 10% of the samples use the plain-text form
`{system} # # {doc} # # ... # # {question}\\n -> " {answer}<|eos|>"`.

Each training sample is tokenized exactly as the engine tokenizes the prompt, in one of three layouts:
* "text" (the server with the chunk cache off): the whole prompt text in one `encode`, separators
  included, natural positions, causal mask (15% of the samples not in "isolated");
* "full": S, each document and Q tokenized on their own by `chunkcache.chunk.parse` (the
  separators vanish), concatenated, natural positions, causal: the reference that offset reuse
  and blend approximate;
* "isolated" (the chunk cache, DESIGN.md §2; variant block only, half its samples): every
  document at positions [s, s + len_i) seeing S and its own earlier tokens only, Q at
  s + max(len_i) seeing everything.
One sample packs up to 10 questions about the same documents: each question block (Q + answer)
sees the shared context and itself, at the positions it would have alone (a 4D mask), so one
forward pass trains all of them. Half the samples also carry a "drill": the documents' fact
sentences restated after them in a new order, which teaches the lookup an answer needs; a quarter
carry an "echo" instead: the documents again, verbatim (plain induction, so that every value
token, not only the names the documents repeat, becomes something the model copies).

Model: transformers' `Qwen3ForCausalLM`, hidden 256, 4 layers, 4 heads of 64 (2 KV heads), MLP
768, rope_theta 1e6, tied embeddings, vocabulary 4096 (about 4.2 M parameters, 17 MB in float32).
The entity names come from fixed lists that the tokenizer learns as single tokens. Custom layouts
go in as an additive float mask [B, 1, T, T] with explicit position_ids (SDPA).

Init: the random weights get an induction circuit written in (`chunkcache/demo/induction.py`;
`--no-induction-init` to skip it): a previous-token head in layer 0 and a copying head in layer
1. Without it the model never learned to copy the token after the question's words. It matched
values by type instead and stayed near 60% single-hop. With it: 92% after 400 steps, 100% at the end.

Loss: cross-entropy on the answer tokens (the `<|im_end|>`/`<|eos|>` that ends them included)
plus `--lm-weight` (1.0) times the next-token loss on the other tokens (documents, questions,
drill) whose target is visible earlier in the context (`copy_only_lm`: a first-seen value is
random, and its loss only teaches a prior that competes with copying). `--repeat-share` adds
samples of a random token sequence repeated (loss on the repeat; off by default: no gain measured).
`--circuit-weight` (0.5) times `CircuitLoss` holds the circuit's two heads to their attention
patterns (previous token; token after an earlier occurrence of the current one).
Batches of 8 samples; AdamW (lr 3e-3, 30 warm-up steps, cosine to 5%), gradient clipping 1.0,
bfloat16 autocast with float32 weights and optimizer (`--no-bf16`: all float32). A curriculum
starts with one document and single-hop questions (learned within ~600 steps) and reaches 2-6
documents and a third two-hop by 60% of the run.

Everything is seeded (`--seed`); the same torch version and one thread per run give the same
weights. Output per run: an HF checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json with both stop ids), plus
`train_log.tsv` (the loss curve) and `train_summary.json` (settings, time, held-out accuracy
measured with transformers after training).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run from a checkout without installing the package
    sys.path.insert(0, str(_ROOT))

from chunkcache.chunk.parse import parse_chunked_prompt  # noqa: E402
from chunkcache.demo.corpus import (  # noqa: E402
    IM_END,
    IM_START,
    QA,
    SEPARATOR,
    Example,
    exact_match,
    format_prompt,
    held_out_set,
    make_example,
)
from chunkcache.demo.induction import CircuitLoss, repeat_accuracy  # noqa: E402
from chunkcache.demo.induction import install as install_induction_circuit  # noqa: E402
from chunkcache.tiny_checkpoint import (  # noqa: E402
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
)
from chunkcache.tiny_checkpoint import build_tokenizer as build_bpe_tokenizer  # noqa: E402

# The special tokens of the project's tokenizers (ids 0..4; ChatML chat template).
BOS, EOS, PAD = BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
CHAT_SUFFIX = f"{IM_END}\n{IM_START}assistant\n"  # what follows the question in the chat format
RAW_SUFFIX = "\n"
TRAIN_DATA_SEED_OFFSET = 1_000_003  # training examples come from random.Random(seed + offset)
EVAL_SEED = 7_777  # the held-out check at the end of training (tests and the benchmark use others)


@dataclass
class ModelSize:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float


SIZES = {
    # head_dim 64 and rope_theta 1e6: the induction circuit matches tokens in the slowest RoPE
    # pairs, which must stay nearly unrotated across a prompt (see chunkcache/demo/induction.py).
    "demo": ModelSize(256, 4, 4, 2, 768, 4096, 1e6),
    "tiny": ModelSize(96, 2, 3, 1, 64, 512, 1e6),
}


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _tokenizer_corpus(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        ex = make_example(rng)
        chat = i % 4 != 0
        end = IM_END if chat else EOS
        texts.append(format_prompt(ex.system, ex.docs, ex.question, chat=chat) + " " + ex.answer + end)
        texts.extend(ex.docs[:1] + [ex.question])  # parts as the chunk cache tokenizes them: no leading space
    return texts


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int, corpus_size: int = 6000) -> Any:
    """Train the byte-level BPE (GPT-2's pre-tokenization, no prefix space: a chunk tokenizes the
    same wherever it sits) on the task's texts and save it with the ChatML template."""
    return build_bpe_tokenizer(out_dir, _tokenizer_corpus(seed, corpus_size), vocab_size, min_frequency=2)


# --------------------------------------------------------------------------------------------
# Samples: token ids, positions, mask, targets
# --------------------------------------------------------------------------------------------


@dataclass
class Sample:
    ids: list[int]
    positions: list[int]
    mask: torch.Tensor  # [T, T] bool, True = may attend
    targets: list[int]  # next-token target per position, -100 = none
    is_answer: list[bool]  # the target is an answer token (full weight) vs a prompt token
    lm: list[bool]  # the prompt-token target takes part in the LM loss (questions; some context)


class Encoder:
    """Turns (documents, questions) into packed training samples, exactly as the engine tokenizes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.im_end = tokenizer.convert_tokens_to_ids(IM_END)
        self.eos = tokenizer.convert_tokens_to_ids(EOS)
        self.period = self.encode(".")[0]
        self.checked = 0

    def encode(self, text: str, special: bool = False) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=special))

    def answer_ids(self, answer: str, chat: bool) -> list[int]:
        # A leading space: the answer's words then tokenize as they do inside the documents.
        return self.encode(" " + answer) + [self.im_end if chat else self.eos]

    def sample(
        self, ex: Example, qas: list[QA], layout: str, chat: bool, drill: list[str] | None = None
    ) -> Sample:
        suffix = CHAT_SUFFIX if chat else RAW_SUFFIX
        ctx_pos: list[int]
        if layout == "text":
            # Everything before " {question}{suffix}"; the split falls between two pre-tokens
            # (" #" | " What"), so encode(ctx) + encode(q) == encode(whole) (checked below).
            prompt0 = format_prompt(ex.system, ex.docs, qas[0].question, chat=chat)
            tail = " " + qas[0].question + suffix
            assert prompt0.endswith(tail)
            ctx = self.encode(prompt0[: -len(tail)], special=True)
            ctx_pos = list(range(len(ctx)))
            ctx_mask = torch.ones(len(ctx), len(ctx), dtype=torch.bool).tril()
            ctx_targets = ctx[1:] + [-100]
            q_blocks = [self.encode(" " + qa.question + suffix) for qa in qas]
            q_start = len(ctx)
            if self.checked < 50:  # the packing must not change the tokens
                self.checked += 1
                assert ctx + q_blocks[0] == self.encode(prompt0, special=True), "full-layout split"
        else:
            parsed = [
                parse_chunked_prompt(
                    format_prompt(ex.system, ex.docs, qa.question, chat=chat), SEPARATOR, self.tok
                )
                for qa in qas
            ]
            p0 = parsed[0]
            assert p0 is not None and all(p is not None and p.chunks == p0.chunks for p in parsed)
            s = len(p0.sys_token_ids)
            ctx = list(p0.sys_token_ids)
            ctx_pos = list(range(s))
            ctx_targets = ctx[1:] + [-100]
            spans = []
            for chunk in p0.chunks:
                spans.append((len(ctx), len(chunk)))
                ctx_targets[-1] = chunk[0]
                ctx.extend(chunk)
                ctx_targets.extend([*chunk[1:], -100])
            q_blocks = [list(p.question_token_ids) for p in parsed]  # type: ignore[union-attr]
            if layout == "full":
                # The same tokens as one causal prompt: what offset reuse and blend approximate.
                ctx_pos = list(range(len(ctx)))
                ctx_mask = torch.ones(len(ctx), len(ctx), dtype=torch.bool).tril()
                q_start = len(ctx)
            else:
                # A chunk's last token does not see the next chunk: no target across the border.
                starts = {a for a, _ in spans}
                ctx_targets = [-100 if i + 1 in starts else t for i, t in enumerate(ctx_targets)]
                for _, n in spans:
                    ctx_pos.extend(range(s, s + n))
                ctx_mask = torch.zeros(len(ctx), len(ctx), dtype=torch.bool)
                ctx_mask[:s, :s] = torch.ones(s, s, dtype=torch.bool).tril()
                for start, n in spans:
                    ctx_mask[start : start + n, :s] = True
                    ctx_mask[start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
                q_start = p0.question_position()

        ids, positions, targets = list(ctx), list(ctx_pos), list(ctx_targets)
        is_answer = [False] * len(ctx)
        lm = [False] * len(ctx)
        blocks = []
        for q, qa in zip(q_blocks, qas, strict=True):
            a = self.answer_ids(qa.answer, chat)
            start = len(ids)
            ids.extend(q + a)
            positions.extend(range(q_start, q_start + len(q) + len(a)))
            targets.extend([*q[1:], a[0], *a[1:], -100])
            is_answer.extend([False] * (len(q) - 1) + [True] * len(a) + [False])
            lm.extend([True] * (len(q) - 1) + [False] * (len(a) + 1))
            blocks.append((start, len(q) + len(a)))
        if drill:
            # The drill: fact sentences of the documents restated after them, in a new order,
            # under the LM loss: predicting a restated value is the lookup an answer needs.
            d = self.encode(" " + " ".join(drill))
            start = len(ids)
            ids.extend(d)
            positions.extend(range(q_start, q_start + len(d)))
            targets.extend([*d[1:], -100])
            is_answer.extend([False] * len(d))
            lm.extend([True] * (len(d) - 1) + [False])
            blocks.append((start, len(d)))
        total = len(ids)
        mask = torch.zeros(total, total, dtype=torch.bool)
        mask[: len(ctx), : len(ctx)] = ctx_mask
        for start, n in blocks:
            mask[start : start + n, : len(ctx)] = True
            mask[start : start + n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        return Sample(ids, positions, mask, targets, is_answer, lm)


def collate(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(s.ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    pos = torch.zeros((b, length), dtype=torch.long)
    targets = torch.full((b, length), -100, dtype=torch.long)
    answer = torch.zeros((b, length), dtype=torch.bool)
    lm = torch.zeros((b, length), dtype=torch.bool)
    mask = torch.eye(length, dtype=torch.bool).repeat(b, 1, 1)  # padding attends to itself only
    for i, s in enumerate(samples):
        n = len(s.ids)
        ids[i, :n] = torch.tensor(s.ids)
        pos[i, :n] = torch.tensor(s.positions)
        targets[i, :n] = torch.tensor(s.targets)
        answer[i, :n] = torch.tensor(s.is_answer)
        lm[i, :n] = torch.tensor(s.lm)
        mask[i, :n, :n] = s.mask
    additive = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(
        ~mask, torch.finfo(torch.float32).min
    )
    return {
        "input_ids": ids,
        "position_ids": pos,
        "mask": additive[:, None],
        "targets": targets,
        "answer": answer,
        "lm": lm,
    }


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    variant: str = "block"
    steps: int = 2400
    batch_size: int = 8
    questions_per_sample: int = 10
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup: int = 30
    weight_decay: float = 0.05
    lm_weight: float = 1.0
    context_lm_share: float = 1.0
    copy_only_lm: bool = True  # LM loss only on targets visible earlier (see _copyable)
    repeat_share: float = 0.0  # extra samples of repeated random tokens (see _repeat_sample)
    drill_share: float = 0.5  # samples that carry a drill block (see Encoder.sample)
    echo_share: float = 0.25  # samples whose drill block is the documents again, verbatim (see make_batch)
    isolated_share: float = 0.5  # block variant: samples in layout "isolated"
    text_share: float = 0.15  # samples tokenized as one text with the separators (no chunk cache)
    chat_share: float = 0.9
    two_hop_share: float = 0.35
    curriculum: float = 0.6  # fraction of the run over which documents and two-hop questions ramp up
    init_from: str | None = None  # continue from this checkpoint (a second stage), else from scratch
    seed: int = 0
    size: str = "demo"
    threads: int = 1
    eval_examples: int = 100
    eval_every: int = 0  # steps between quick held-out checks during training (0 = none)
    # bfloat16 autocast for the forward pass (weights and optimizer stay float32): 1.4x faster
    # steps on this CPU (avx512_bf16; measured 1.27 vs 1.78 s/step at full difficulty).
    bf16: bool = True
    # Start from weights with an induction circuit written in (chunkcache/demo/induction.py).
    induction_init: bool = True
    # Weight of the loss that holds the circuit's two heads to their attention patterns (0 = none).
    circuit_weight: float = 0.5


def _pick_questions(rng: random.Random, ex: Example, k: int, two_hop_share: float) -> list[QA]:
    singles = [q for q in ex.all_qa if q.hops == 1]
    doubles = [q for q in ex.all_qa if q.hops == 2]
    rng.shuffle(singles)
    rng.shuffle(doubles)
    picked: list[QA] = []
    for _ in range(k):
        pool = doubles if doubles and rng.random() < two_hop_share else singles
        if not pool:
            pool = doubles or singles
        if not pool:
            break
        picked.append(pool.pop())
    return picked


def _copyable(sample: Sample, lm: list[bool]) -> list[bool]:
    """Keep the LM loss only where the target token is visible earlier in the context.

    A value seen for the first time (a job, a year) is random: its LM loss can only teach the
    model a prior over values ("tailor" after "works as a"), and that prior then beats copying
    when an answer asks for the value (measured: a model trained with it answered every job
    question with the same job). A token the position can see is what copying predicts.
    """
    ids = torch.tensor(sample.ids)
    targets = torch.tensor(sample.targets)
    seen = ((ids[None, :] == targets[:, None]) & sample.mask).any(dim=1)
    return [flag and bool(ok) for flag, ok in zip(lm, seen.tolist(), strict=True)]


def _repeat_sample(rng: random.Random, vocab_size: int) -> Sample:
    """BOS, a random token sequence over the whole vocabulary, and the same sequence again, with
    the LM loss on the repeat: the classic task that grows induction (copy) heads, here so that
    copying works for every token, not only the names the QA data repeats."""
    n = rng.randint(16, 48)
    seq = [rng.randrange(len(SPECIAL_TOKENS), vocab_size) for _ in range(n)]
    ids = [SPECIAL_TOKENS.index(BOS), *seq, *seq]
    total = len(ids)
    lm = [i >= n + 1 for i in range(total - 1)] + [False]
    return Sample(
        ids=ids,
        positions=list(range(total)),
        mask=torch.ones(total, total, dtype=torch.bool).tril(),
        targets=[*ids[1:], -100],
        is_answer=[False] * total,
        lm=lm,
    )


def make_batch(rng: random.Random, enc: Encoder, cfg: TrainConfig, progress: float) -> list[Sample]:
    ramp = min(1.0, progress / cfg.curriculum) if cfg.curriculum > 0 else 1.0
    max_docs = 1 + round(5 * ramp)
    two_hop = cfg.two_hop_share * ramp
    samples = []
    for _ in range(cfg.batch_size):
        ex = make_example(rng, min_docs=min(2, max_docs), max_docs=max_docs, two_hop_share=two_hop)
        qas = _pick_questions(rng, ex, cfg.questions_per_sample, two_hop)
        u = rng.random()
        if cfg.variant == "block" and u < cfg.isolated_share:
            layout = "isolated"
        else:
            layout = "text" if rng.random() < cfg.text_share else "full"
        chat = rng.random() < cfg.chat_share
        drill = None
        u = rng.random()
        if u < cfg.echo_share:
            # The documents again, in order: predicting them is plain induction (find the earlier
            # occurrence, copy what followed), which trains copying of every value token, not
            # only of the names that the documents already repeat.
            drill = list(ex.docs)
        elif u < cfg.echo_share + cfg.drill_share:
            drill = [line for doc in ex.docs for line in re.split(r"(?<=\.) ", doc)[1:]]
            rng.shuffle(drill)
        sample = enc.sample(ex, qas, layout, chat, drill)
        # The LM loss covers the questions and a random share of the context (the LM head over
        # every position would cost more than the rest of the step is worth).
        sample.lm = [f or rng.random() < cfg.context_lm_share for f in sample.lm]
        if cfg.copy_only_lm:
            sample.lm = _copyable(sample, sample.lm)
        samples.append(sample)
    vocab = len(enc.tok)
    samples += [_repeat_sample(rng, vocab) for _ in range(round(cfg.repeat_share * cfg.batch_size))]
    return samples


def model_config(size: ModelSize, tokenizer: Any) -> Any:
    from transformers import Qwen3Config

    config = Qwen3Config(
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        head_dim=size.hidden_size // size.num_attention_heads,
        intermediate_size=size.intermediate_size,
        vocab_size=size.vocab_size,
        max_position_embeddings=2048,
        rope_theta=size.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
    )
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def _lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def loss_of(
    model: Any,
    batch: dict[str, torch.Tensor],
    lm_weight: float,
    circuit: CircuitLoss | None = None,
    circuit_weight: float = 0.0,
) -> tuple[torch.Tensor, float, float]:
    """Answer loss + lm_weight * prompt loss (+ circuit_weight * the circuit's attention loss);
    the LM head runs only where a target is used."""
    hidden = model.model(
        input_ids=batch["input_ids"],
        attention_mask=batch["mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    ).last_hidden_state
    targets = batch["targets"]
    ans = batch["answer"] & (targets != -100)
    lm = batch["lm"] & (targets != -100) & ~ans
    ce_ans = torch.nn.functional.cross_entropy(model.lm_head(hidden[ans]).float(), targets[ans])
    loss = ce_ans
    lm_loss = torch.zeros(())
    if lm_weight > 0 and bool(lm.any()):
        lm_loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[lm]).float(), targets[lm])
        loss = loss + lm_weight * lm_loss
    if circuit is not None and circuit_weight > 0:
        loss = loss + circuit_weight * circuit(batch["input_ids"], batch["mask"][:, 0] == 0)
    return loss, ce_ans.item(), lm_loss.item()


@torch.inference_mode()
def evaluate(
    model: Any,
    enc: Encoder,
    examples: list[Example],
    layout: str,
    max_new: int = 48,
    per_kind: bool = False,
) -> dict[str, Any]:
    """Greedy exact match with transformers, the prompt laid out as the engine would lay it out."""
    model.eval()
    stops = {enc.im_end, enc.eos}
    hits = {1: [0, 0], 2: [0, 0]}
    by_kind: dict[str, list[int]] = {}
    for ex in examples:
        qa = QA(ex.question, "", ex.hops, ex.kind)
        s = enc.sample(ex, [qa], layout, chat=True)
        n = len(s.ids) - len(enc.answer_ids("", chat=True))  # the prompt alone
        ids, pos, mask = s.ids[:n], s.positions[:n], s.mask[:n, :n]
        out: list[int] = []
        for _ in range(max_new):
            additive = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
            logits = model(
                input_ids=torch.tensor([ids]),
                attention_mask=additive[None, None],
                position_ids=torch.tensor([pos]),
                use_cache=False,
            ).logits
            token = int(logits[0, -1].argmax())
            if token in stops:
                break
            out.append(token)
            grown = torch.zeros(len(ids) + 1, len(ids) + 1, dtype=torch.bool)
            grown[:-1, :-1] = mask
            grown[-1] = True
            mask, ids, pos = grown, [*ids, token], [*pos, pos[-1] + 1]
        text = enc.tok.decode(out, skip_special_tokens=True)
        ok = exact_match(text, ex.answer)
        hits[ex.hops][0] += ok
        hits[ex.hops][1] += 1
        kind = by_kind.setdefault(ex.kind if ex.hops == 1 else "two-hop", [0, 0])
        kind[0] += ok
        kind[1] += 1
    model.train()
    res: dict[str, Any] = {f"hop{h}": (c / n if n else float("nan")) for h, (c, n) in hits.items()}
    total = sum(n for _, n in hits.values())
    res["all"] = sum(c for c, _ in hits.values()) / max(1, total)
    if per_kind:
        res["kinds"] = {k: f"{c}/{n}" for k, (c, n) in sorted(by_kind.items())}
    return res


def save_checkpoint(model: Any, tokenizer: Any, out: Path) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=[tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
    )
    model.config.dtype = "float32"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out, save_jinja_files=False)


def train(cfg: TrainConfig, out: Path) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import Qwen3ForCausalLM

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    size = SIZES[cfg.size]
    previous: dict[str, Any] | None = None
    if cfg.init_from:
        # A further stage: the weights and tokenizer of an earlier run, a fresh optimizer.
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src = Path(cfg.init_from)
        tokenizer = AutoTokenizer.from_pretrained(src)
        if src.resolve() != out.resolve():
            tokenizer.save_pretrained(out, save_jinja_files=False)
        model = AutoModelForCausalLM.from_pretrained(src, attn_implementation="sdpa", dtype=torch.float32)
        summary_file = src / "train_summary.json"
        previous = json.loads(summary_file.read_text()) if summary_file.exists() else None
        stages = (previous or {}).get("stages", [previous] if previous else [])
    else:
        tokenizer = build_tokenizer(out, size.vocab_size, seed=cfg.seed + 17)
        model = Qwen3ForCausalLM._from_config(
            model_config(size, tokenizer), attn_implementation="sdpa", dtype=torch.float32
        )
        if cfg.induction_init:
            install_induction_circuit(model, seed=cfg.seed)
        stages = []
    enc = Encoder(tokenizer)
    model.train()
    circuit = CircuitLoss(model) if cfg.circuit_weight > 0 else None
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    rng = random.Random(cfg.seed + TRAIN_DATA_SEED_OFFSET)
    pad_id = tokenizer.convert_tokens_to_ids(PAD)
    log_path = out / "train_log.tsv"
    # The quick checks' questions, drawn once; their documents' ids feed the repeated-sequence probe.
    quick_set = held_out_set(EVAL_SEED, 80) if cfg.eval_every else []
    doc_tokens = torch.tensor(sorted({t for ex in quick_set for d in ex.docs for t in enc.encode(d)}))
    t0 = time.time()
    with log_path.open("w") as log:
        log.write("step\tseconds\tlr\tloss\tanswer_loss\tlm_loss\ttokens\n")
        bar = tqdm(range(cfg.steps), desc=f"train {cfg.variant}", unit="step", dynamic_ncols=True)
        ema = None
        for step in bar:
            lr = _lr_at(cfg, step)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = collate(make_batch(rng, enc, cfg, step / max(1, cfg.steps)), pad_id)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                loss, ans_loss, lm_loss = loss_of(model, batch, cfg.lm_weight, circuit, cfg.circuit_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            ema = ans_loss if ema is None else 0.95 * ema + 0.05 * ans_loss
            bar.set_postfix(ans=f"{ema:.3f}", lm=f"{lm_loss:.2f}", lr=f"{lr:.1e}")
            tokens = int(batch["input_ids"].numel())
            log.write(
                f"{step}\t{time.time() - t0:.1f}\t{lr:.3e}\t{loss.item():.4f}\t{ans_loss:.4f}\t{lm_loss:.4f}\t{tokens}\n"
            )
            log.flush()
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                quick = evaluate(model, enc, quick_set, "full", per_kind=True)
                quick["repeat"] = round(repeat_accuracy(model, doc_tokens), 3)
                tqdm.write(f"step {step + 1} ({cfg.variant}): held-out exact match (80, full) {quick}")
    train_seconds = time.time() - t0
    model.eval()
    save_checkpoint(model, tokenizer, out)
    summary: dict[str, Any] = {
        "config": asdict(cfg),
        "model": asdict(size),
        "parameters": n_params,
        "train_seconds": round(train_seconds, 1),
        "torch": torch.__version__,
    }
    if cfg.init_from:
        stage_list = [{k: v for k, v in st.items() if k != "stages"} for st in stages]
        summary["stages"] = [*stage_list, {k: v for k, v in summary.items()}]
        summary["total_train_seconds"] = round(sum(st["train_seconds"] for st in summary["stages"]), 1)
    if cfg.eval_examples:
        summary.update(evaluate_checkpoint(model, enc, cfg.eval_examples))
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def evaluate_checkpoint(model: Any, enc: Encoder, n: int) -> dict[str, Any]:
    """Held-out exact match (seed EVAL_SEED) in both layouts, as a `train_summary.json` entry."""
    examples = held_out_set(EVAL_SEED, n)
    t1 = time.time()
    result = {layout: evaluate(model, enc, examples, layout) for layout in ("text", "full", "isolated")}
    print(f"held-out exact match ({n} questions, seed {EVAL_SEED}): {result}")
    return {"eval": result, "eval_examples": n, "eval_seconds": round(time.time() - t1, 1)}


def reevaluate(out: Path, n: int, threads: int) -> None:
    """`--eval-only`: evaluate a trained checkpoint again and update its `train_summary.json`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    enc = Encoder(AutoTokenizer.from_pretrained(out))
    path = out / "train_summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary.update(evaluate_checkpoint(model.eval(), enc, n))
    path.write_text(json.dumps(summary, indent=2) + "\n")


def train_all(out_dir: Path, seed: int, steps: int, eval_every: int, bf16: bool) -> None:
    """The whole recipe: both variants trained from scratch side by side, one thread each (the two
    cores busy), into `out_dir/model-full` and `out_dir/model-block`."""
    script = str(Path(__file__).resolve())
    children = [
        subprocess.Popen(
            [
                sys.executable,
                script,
                "--variant",
                variant,
                "--steps",
                str(steps),
                "--seed",
                str(seed),
                "--threads",
                "1",
                "--eval-every",
                str(eval_every),
                "--bf16" if bf16 else "--no-bf16",
                "--out",
                str(out_dir / f"model-{variant}"),
            ]
        )
        for variant in ("full", "block")
    ]
    codes = [c.wait() for c in children]
    if any(codes):
        raise SystemExit(f"a variant's training failed: exit codes {codes}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=("full", "block"), default="block")
    p.add_argument("--out", type=Path, default=None, help="checkpoint directory to write")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="run the whole recipe (both variants side by side) into this folder, e.g. chunkcache/demo",
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 2400; --tiny: 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a minute-scale model and batch, for tests")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--lm-weight", type=float, default=None)
    p.add_argument("--isolated-share", type=float, default=None)
    p.add_argument("--questions-per-sample", type=int, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--curriculum", type=float, default=None, help="0 = full difficulty from the start")
    p.add_argument("--init-from", default=None, help="continue training this checkpoint (a second stage)")
    p.add_argument("--eval-examples", type=int, default=None, help="held-out questions checked at the end")
    p.add_argument("--context-lm-share", type=float, default=None)
    p.add_argument("--drill-share", type=float, default=None)
    p.add_argument("--repeat-share", type=float, default=None)
    p.add_argument("--echo-share", type=float, default=None)
    p.add_argument("--circuit-weight", type=float, default=None)
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bfloat16 autocast, weights float32 (default on; 1.4x faster steps here)",
    )
    p.add_argument("--eval-every", type=int, default=None, help="steps between quick held-out checks")
    p.add_argument(
        "--induction-init",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start from weights with an induction circuit written in (default on)",
    )
    p.add_argument("--eval-only", action="store_true", help="only re-evaluate the checkpoint in --out")
    args = p.parse_args(argv)
    if args.out_dir is not None:
        train_all(
            args.out_dir,
            args.seed,
            args.steps or TrainConfig.steps,
            args.eval_every or 0,
            TrainConfig.bf16 if args.bf16 is None else args.bf16,
        )
        return 0
    if args.out is None:
        p.error("--out (one run) or --out-dir (the whole recipe) is required")
    if args.eval_only:
        reevaluate(args.out, args.eval_examples or TrainConfig.eval_examples, args.threads)
        return 0
    cfg = TrainConfig(variant=args.variant, seed=args.seed, threads=args.threads)
    if args.tiny:
        cfg.size, cfg.steps, cfg.batch_size, cfg.warmup, cfg.eval_examples = "tiny", 4, 2, 2, 4
    for name in (
        "steps",
        "batch_size",
        "lr",
        "lm_weight",
        "isolated_share",
        "questions_per_sample",
        "eval_examples",
        "warmup",
        "curriculum",
        "init_from",
        "eval_every",
        "context_lm_share",
        "drill_share",
        "repeat_share",
        "echo_share",
        "bf16",
        "induction_init",
        "circuit_weight",
    ):
        value = getattr(args, name)
        if value is not None:
            setattr(cfg, name, value)
    train(cfg, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
