"""Fine-tune a LoRA adapter with which reused documents keep the answers of a full prefill.

Why: on SmolLM2-135M, reading documents whose KV was computed without each other loses a quarter
to a half of full prefill's correct answers, and no training-free method measured in
benchmarks/RESULTS.md moves that (issue 15). Block-Attention (Sun et al. 2024) and KVLink (Yang
et al. 2025) fine-tune the model on the attention pattern it gets at serving time. This recipe does
that by self-distillation, so it needs no labelled data and keeps the model's own behaviour:

- teacher: the base model (adapter disabled) reading the prompt with a full prefill, and its
  greedy reply: what the user would get without reuse;
- student: base + LoRA reading the same tokens as the engine serves them in layout "offset" with
  no recompute: each document's KV computed right after S alone (what the chunk cache holds), its
  K re-rotated to the document's place, the question and the reply running over that cache (as
  served with prefix caching off; with it on, the last document's tokens after its last full KV
  block run fresh too, so that follow-ups can read the blocks: a few tokens of difference);
- loss: KL(teacher || student) of the next-token distributions over the reply (teacher-forced).

The adapter is saved in peft's format (adapter_config.json, adapter_model.safetensors); the engine
merges it into the weights at load (`--adapter DIR`). Training text: `reuse_corpus` (CPython's
reference documentation, disjoint from the fidelity benchmark's element texts).

    python training/reuse_adapter.py --out adapters/smollm2-reuse --samples 600 --threads 2
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reuse_corpus

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _layer_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cache(config: Any, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for index, (k, v) in enumerate(layers):
        cache.update(k, v, index)
    return cache


def reuse_cache(model: Any, sample: reuse_corpus.Sample, device: str) -> Any:
    """The KV the engine assembles for layout "offset" with no recompute, with autograd: S run
    alone; each document run right after S (as if it came first, which is what the chunk cache
    stores); its K re-rotated from there to the document's place in this prompt (RoPE composes:
    rotating by the shift equals computing at the new position)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    base = model.get_base_model()
    s = len(sample.sys_ids)
    sys_kv = _layer_kv(
        model(input_ids=torch.tensor([sample.sys_ids], device=device), use_cache=True).past_key_values
    )
    parts = [sys_kv]
    start = s
    for chunk in sample.chunks:
        ids = torch.tensor([chunk], device=device)
        positions = torch.arange(s, s + len(chunk), device=device)[None]
        kv = _layer_kv(
            model(
                input_ids=ids,
                position_ids=positions,
                past_key_values=_cache(base.config, sys_kv),
                use_cache=True,
            ).past_key_values
        )
        shift = torch.full((1, len(chunk)), start - s, device=device)
        cos, sin = base.model.rotary_emb(kv[0][1], shift)
        parts.append(
            [(apply_rotary_pos_emb(k[:, :, s:], k[:, :, s:], cos, sin)[1], v[:, :, s:]) for k, v in kv]
        )
        start += len(chunk)
    layers = [
        (torch.cat([p[i][0] for p in parts], dim=2), torch.cat([p[i][1] for p in parts], dim=2))
        for i in range(len(sys_kv))
    ]
    return _cache(base.config, layers)


@dataclass
class Target:
    """The teacher's greedy reply and its log-probs at every reply position."""

    reply: list[int]
    logprobs: torch.Tensor  # [len(reply), vocab]


@torch.no_grad()
def teach(model: Any, sample: reuse_corpus.Sample, max_new: int, device: str) -> Target:
    ids = torch.tensor([sample.prompt_ids], device=device)
    with model.disable_adapter():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    reply = out.sequences[0, ids.shape[1] :].tolist()
    logits = torch.cat([step.float() for step in out.logits[: len(reply)]])
    return Target(reply, torch.log_softmax(logits, dim=-1))


def student_logprobs(model: Any, sample: reuse_corpus.Sample, reply: list[int], device: str) -> torch.Tensor:
    """log-probs [len(reply), vocab] of the adapted model reading the documents' reused KV (layout
    "offset", nothing recomputed), teacher-forced on `reply`."""
    cache = reuse_cache(model, sample, device)
    tail = list(sample.q_ids) + reply[:-1]
    start = len(sample.prompt_ids) - len(sample.q_ids)
    positions = torch.arange(start, start + len(tail), device=device)[None]
    ids = torch.tensor([tail], device=device)
    logits = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits
    return torch.log_softmax(logits[0, len(sample.q_ids) - 1 :].float(), dim=-1)


def kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student)."""
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


@dataclass
class Validation:
    kl: float  # mean KL(full prefill || reuse) over reply positions
    agree: float  # share of reply positions whose argmax under reuse is the teacher's token


@torch.no_grad()
def validate(model: Any, val: list[tuple[reuse_corpus.Sample, Target]], device: str) -> Validation:
    model.eval()
    kls, agree, count = [], 0, 0
    for sample, target in val:
        student = student_logprobs(model, sample, target.reply, device)
        kls.append(kl(target.logprobs.to(device), student).item())
        agree += int((student.argmax(-1).cpu() == torch.tensor(target.reply)).sum())
        count += len(target.reply)
    return Validation(sum(kls) / len(kls), agree / count)


def load(model_path: str, args: argparse.Namespace) -> tuple[Any, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from chunkcache.model.gguf_file import load_gguf_tokenizer

    path, kwargs = Path(model_path), {}
    if path.suffix == ".gguf":
        kwargs["gguf_file"] = path.name
        path = path.parent
        tokenizer = load_gguf_tokenizer(Path(model_path))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
    base = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="sdpa", **kwargs
    ).to(args.device)
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=0.0,
        target_modules=args.targets.split(","),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, config), tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: chunkcache's)")
    parser.add_argument("--out", type=Path, required=True, help="adapter directory to write")
    parser.add_argument("--samples", type=int, default=600, help="training prompts (one pass)")
    parser.add_argument("--val", type=int, default=24, help="validation prompts (another seed)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--targets", default=TARGETS, help="comma-separated module names")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--accum", type=int, default=2, help="prompts per optimizer step")
    parser.add_argument("--warmup", type=int, default=10, help="optimizer steps of linear warm-up")
    parser.add_argument("--max-new", type=int, default=24, help="teacher reply length")
    parser.add_argument("--val-every", type=int, default=100, help="validate every N prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.model is None:
        from chunkcache.model.loader import model_path

        args.model = model_path("smollm2")
    model, tokenizer = load(args.model, args)
    train = reuse_corpus.samples(tokenizer, args.samples, seed=args.seed)
    val_samples = reuse_corpus.samples(tokenizer, args.val, seed=args.seed + 10_000)
    val = [(s, teach(model, s, args.max_new, args.device)) for s in tqdm(val_samples, desc="teacher (val)")]
    log: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "val": [], "loss": []}
    before = validate(model, val, args.device)
    log["val"].append({"seen": 0, **asdict(before)})
    print(f"before: val KL {before.kl:.4f}, agreement {before.agree:.1%}", flush=True)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = math.ceil(len(train) / args.accum)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))
        ),
    )
    rng = random.Random(args.seed)
    order = list(range(len(train)))
    rng.shuffle(order)
    t0 = time.time()
    bar = tqdm(order, desc="train", unit="prompt")
    for seen, index in enumerate(bar, 1):
        sample = train[index]
        target = teach(model, sample, args.max_new, args.device)
        model.train()
        loss = kl(target.logprobs.to(args.device), student_logprobs(model, sample, target.reply, args.device))
        (loss / args.accum).backward()
        log["loss"].append(round(loss.item(), 5))
        if seen % args.accum == 0 or seen == len(order):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        recent = log["loss"][-50:]
        bar.set_postfix(kl=f"{sum(recent) / len(recent):.3f}")
        if seen % args.val_every == 0 or seen == len(order):
            check = validate(model, val, args.device)
            log["val"].append({"seen": seen, **asdict(check)})
            print(f"\nseen {seen}: val KL {check.kl:.4f}, agreement {check.agree:.1%}", flush=True)
            model.save_pretrained(str(args.out))
    log["seconds"] = round(time.time() - t0)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out))
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1))
    after = log["val"][-1]
    print(f"after: val KL {after['kl']:.4f} (before {before.kl:.4f}), agreement {after['agree']:.1%}")


if __name__ == "__main__":
    main()
