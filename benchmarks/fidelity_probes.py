"""Probes of *where* chunk reuse loses answers, run with transformers on bench_fidelity's questions.

bench_fidelity measures the engine's reuse modes; these probes ask what a mode would have to
repair, by computing idealised variants that the engine does not serve (each would cost a full
prefill or more), so that a recovery method is only built where a probe says it can pay:

- `context:none`: every document's KV computed right after S (its K re-rotated to the
  document's place), the question over it: the engine's `offset` layout with nothing recomputed.
- `context:other`: each document after S and a real document *not in the prompt* (another
  element's text): does a document lose answers because it was encoded "as if first"?
- `context:previous`: each document after S and the document that precedes it in this prompt
  (the one neighbour a cached variant could carry, as Cache-Craft keeps per-prefix variants).
- `deep:K`: in layers < K every document sees only S and itself; from layer K on every token is
  recomputed with full causal attention (hidden states taken from the isolated layers). Costs
  (L - K) / L of a full prefill: does recomputing the deep layers repair the answers?
  (`deep:0` is a full prefill; the early-layer counterpart, every token recomputed before the
  check layer and then only a share, is the engine's blend with a deep check layer, in
  bench_fidelity.)
- `select:k1@R` / `select:oracle@R`: blend's shape (the chosen R of the document tokens
  recomputed through every layer, the others' KV reused) with two selectors: the engine's K
  deviation at layer 1, and an oracle that knows every layer's true KV deviation from a full
  prefill (summed over layers, each layer normalised by its mean KV norm). The oracle is the
  upper bound of any selector that picks tokens: if it keeps no more answers than K deviation,
  no better selector is left to find. `select:prior@R` ranks by the same deviation measured
  once per document in an unrelated context (after another element's document), as a chunk
  entry could store it: what a selector with no request-time cost could reach;
  `select:prior-text@R` measures it after one fixed passage of another domain (CPython's
  documentation) instead, as an engine holding one neutral context for every chunk would.

Greedy, as bench_fidelity. The results are written in bench_fidelity's raw format, so its
`--merge` reports them against the engine's full prefill (kept / lost / gained, bootstrap):

    python benchmarks/fidelity_probes.py --split tune --limit 120 --shard 0/2 --raw p0.json
    python benchmarks/bench_fidelity.py --split tune --merge benchmarks/results/fidelity_answers.json p0.json p1.json
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc_data.topics
import random
import sys
from pathlib import Path
from typing import Any

import fidelity_set
import torch
from bench_fidelity import SEP, render
from tqdm import tqdm

from chunkcache.chunk.parse import parse_chunked_prompt
from chunkcache.core.plan import ChunkedPrompt

CONTEXTS = ("none", "other", "previous")
SCORERS = ("k1", "oracle", "prior", "prior-text")


def _fraction(text: str) -> bool:
    try:
        return 0.0 < float(text) <= 1.0
    except ValueError:
        return False


class Probe:
    """The default model as transformers runs it (float32, SDPA), and the probes over it."""

    def __init__(self, model_path: str, max_tokens: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, name = str(Path(model_path).parent), Path(model_path).name
        self.tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        self.model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.max_tokens = max_tokens
        self.stop = {self.tokenizer.eos_token_id, *self._end_ids()}

    def _end_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        return list(eos) if isinstance(eos, list) else [] if eos is None else [eos]

    def prompt(self, docs: list[str], question: str) -> ChunkedPrompt:
        text = render(self.tokenizer, docs, question)
        parsed = parse_chunked_prompt(text, SEP, self.tokenizer, add_special_tokens=False)
        assert parsed is not None
        return parsed

    def _kv(self, token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cache = self.model(input_ids=torch.tensor([token_ids]), use_cache=True).past_key_values
        return [(layer.keys[0], layer.values[0]) for layer in cache.layers]

    def _moved(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """K [Hk, T, D] rotated by `delta` positions (RoPE is a rotation: R(a + b) = R(b) R(a))."""
        freqs = float(delta) * self.model.model.rotary_emb.inv_freq.float()
        cos, sin = torch.cat((freqs, freqs)).cos(), torch.cat((freqs, freqs)).sin()
        half = k.shape[-1] // 2
        return k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin

    def context(self, p: ChunkedPrompt, contexts: list[list[int]]) -> str:
        """Documents encoded after S + contexts[i] each, assembled at their natural places."""
        from transformers import DynamicCache

        s = list(p.sys_token_ids)
        pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = [self._kv(s)]
        at = len(s)
        for chunk, ctx in zip(p.chunks, contexts, strict=True):
            start = len(s) + len(ctx)
            layers = self._kv(s + ctx + list(chunk))
            pieces.append([(self._moved(k[:, start:], at - start), v[:, start:]) for k, v in layers])
            at += len(chunk)
        cache = DynamicCache(config=self.model.config)
        for i in range(len(pieces[0])):
            k = torch.cat([piece[i][0] for piece in pieces], dim=1)[None]
            v = torch.cat([piece[i][1] for piece in pieces], dim=1)[None]
            cache.update(k, v, i)
        q = list(p.question_token_ids)
        out = self.model(
            input_ids=torch.tensor([q]),
            position_ids=torch.arange(at, at + len(q))[None],
            past_key_values=cache,
            use_cache=True,
        )
        return self._greedy(out.logits[0, -1], out.past_key_values, at + len(q))

    def deep(self, p: ChunkedPrompt, first_full_layer: int) -> str:
        """Documents isolated (S and themselves) below `first_full_layer`, full causal from it."""
        from transformers import DynamicCache

        ids = p.all_token_ids()
        total = len(ids)
        masks = _masks(p)
        positions = torch.arange(total)[None]
        body = self.model.model
        h = body.embed_tokens(torch.tensor([ids]))
        rope = body.rotary_emb(h, position_ids=positions)
        cache = DynamicCache(config=self.model.config)
        for i, layer in enumerate(body.layers):
            h = layer(
                h,
                attention_mask=masks[i >= first_full_layer],
                position_embeddings=rope,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
        logits = self.model.lm_head(body.norm(h[:, -1:]))[0, -1]
        return self._greedy(logits, cache, total)

    def _projections(
        self, ids: list[int], mask: torch.Tensor | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the k_proj and v_proj outputs [T, Hk * D] (K before RoPE) of one pass."""
        out: list[list[torch.Tensor]] = [[] for _ in self.model.model.layers]
        hooks = [
            proj.register_forward_hook(lambda _m, _i, y, i=i: out[i].append(y[0]))
            for i, layer in enumerate(self.model.model.layers)
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj)
        ]
        try:
            self.model(input_ids=torch.tensor([ids]), attention_mask=mask)
        finally:
            for hook in hooks:
                hook.remove()
        return [(k, v) for k, v in out]

    def select(self, p: ChunkedPrompt, scorer: str, ratio: float, unrelated: list[int]) -> str:
        """The chosen `ratio` of the document tokens recomputed in every layer; the others keep
        their isolated KV (S and themselves), as blend serves them. `unrelated`: documents not in
        the prompt, the context the "prior" scorer measures each document's sensitivity in."""
        from transformers import DynamicCache

        ids = p.all_token_ids()
        s = len(p.sys_token_ids)
        end = s + sum(map(len, p.chunks))
        isolated = self._projections(ids, _masks(p)[0])
        if scorer.startswith("prior"):
            # What a chunk entry could store: each document's deviation measured once, in an
            # unrelated context (the first document is exact after S, so it scores 0).
            parts = [torch.zeros(len(p.chunks[0]))]
            sys_ids = list(p.sys_token_ids)
            for chunk in p.chunks[1:]:
                n = len(chunk)
                alone = self._projections(sys_ids + list(chunk), None)
                within = self._projections(sys_ids + unrelated + list(chunk), None)
                parts.append(_deviation(within, alone, (-n, None), (-n, None)))
            score = torch.cat(parts)
        else:
            full = self._projections(ids, None)
            if scorer == "k1":
                score = (full[1][0] - isolated[1][0])[s:end].pow(2).sum(-1)
            else:
                score = _deviation(full, isolated, (s, end), (s, end))
        budget = math.ceil(ratio * (end - s) - 1e-9)
        stale = torch.ones(end - s, dtype=torch.bool)
        stale[torch.topk(score, budget).indices] = False
        rows = stale.nonzero().squeeze(1) + s

        def reuse(i: int, which: int) -> Any:
            def hook(_m: Any, _i: Any, y: torch.Tensor) -> torch.Tensor:
                if y.shape[1] == len(ids):  # the prompt's pass, not a decode step
                    y = y.clone()
                    y[0, rows] = isolated[i][which][rows]
                return y

            return hook

        hooks = [
            proj.register_forward_hook(reuse(i, which))
            for i, layer in enumerate(self.model.model.layers)
            for which, proj in enumerate((layer.self_attn.k_proj, layer.self_attn.v_proj))
        ]
        try:
            cache = DynamicCache(config=self.model.config)
            out = self.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        finally:
            for hook in hooks:
                hook.remove()
        return self._greedy(out.logits[0, -1], out.past_key_values, len(ids))

    def _greedy(self, logits: torch.Tensor, cache: Any, position: int) -> str:
        tokens = [int(logits.argmax())]
        while len(tokens) < self.max_tokens and tokens[-1] not in self.stop:
            out = self.model(
                input_ids=torch.tensor([tokens[-1:]]),
                position_ids=torch.tensor([[position]]),
                past_key_values=cache,
                use_cache=True,
            )
            cache, position = out.past_key_values, position + 1
            tokens.append(int(out.logits[0, -1].argmax()))
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def _deviation(
    fresh: list[tuple[torch.Tensor, torch.Tensor]],
    stale: list[tuple[torch.Tensor, torch.Tensor]],
    fresh_rows: tuple[int, int | None],
    stale_rows: tuple[int, int | None],
) -> torch.Tensor:
    """Per token, the KV deviation summed over layers, each layer's normalised by the mean
    squared norm of its fresh K and V."""
    total = torch.zeros(())
    for (kf, vf), (ks, vs) in zip(fresh, stale, strict=True):
        scale = (kf.pow(2).sum(-1) + vf.pow(2).sum(-1)).mean()
        f, t = slice(*fresh_rows), slice(*stale_rows)
        total = total + ((kf[f] - ks[t]).pow(2).sum(-1) + (vf[f] - vs[t]).pow(2).sum(-1)) / scale
    return total


def _masks(p: ChunkedPrompt) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive [1, 1, T, T] masks over the whole prompt: documents isolated from one another
    (each sees S and itself; the question sees everything), and plain causal."""
    total, s = p.num_tokens, len(p.sys_token_ids)
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    isolated = causal.clone()
    at = s
    for chunk in p.chunks:
        isolated[at : at + len(chunk), s:at] = False
        at += len(chunk)
    low = torch.finfo(torch.float32).min
    return tuple(torch.zeros(total, total).masked_fill(~m, low)[None, None] for m in (isolated, causal))


def contexts_for(
    kind: str, probe: Probe, p: ChunkedPrompt, q: fidelity_set.Question, elements: dict
) -> list[list[int]]:
    """The context each document is encoded after (besides S); the first document keeps none
    (after S it is exact in every variant)."""
    if kind == "none":
        return [[] for _ in p.chunks]
    if kind == "previous":
        return [[]] + [list(c) for c in p.chunks[:-1]]
    ctx = unrelated_document(probe, q, elements)
    return [[]] + [ctx for _ in p.chunks[1:]]


def unrelated_document(probe: Probe, q: fidelity_set.Question, elements: dict) -> list[int]:
    """The tokens of one element's document that is not in the question's prompt (per question)."""
    others = [n for n in elements if n not in q.doc_ids]
    other = elements[random.Random(q.qid).choice(others)].document()
    return list(probe.tokenizer.encode(SEP + other, add_special_tokens=False))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--split", choices=["all", "tune", "heldout"], default="tune")
    parser.add_argument("--limit", type=int, default=0, help="first N questions of the split (0 = all)")
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th question from the I-th")
    parser.add_argument(
        "--probes",
        nargs="+",
        default=["context:none", "context:other", "context:previous", "deep:10", "deep:20"],
        help=f"context:{'|'.join(CONTEXTS)}, deep:K, select:{'|'.join(SCORERS)}@R",
    )
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--raw", type=Path, required=True, help="results in bench_fidelity's raw format")
    args = parser.parse_args(argv)
    for name in args.probes:
        kind, _, arg = name.partition(":")
        scorer, _, ratio = arg.partition("@")
        if not (
            (kind == "context" and arg in CONTEXTS)
            or (kind == "deep" and arg.isdigit())
            or (kind == "select" and scorer in SCORERS and _fraction(ratio))
        ):
            parser.error(
                f"unknown probe {name!r}: context:{'|'.join(CONTEXTS)}, deep:K or select:{'|'.join(SCORERS)}@R"
            )
    torch.set_num_threads(args.threads)
    from chunkcache.model.loader import model_path

    probe = Probe(model_path("smollm2"), args.max_tokens)
    num_layers = probe.model.config.num_hidden_layers
    elements = fidelity_set.load_elements()
    # `prior-text`'s context: one fixed passage of another domain (CPython's documentation), the
    # kind of neutral text an engine could hold for every chunk.
    passage = " ".join(pydoc_data.topics.topics[min(pydoc_data.topics.topics)].split()[:120])
    foreign = list(probe.tokenizer.encode(SEP + passage, add_special_tokens=False))
    questions = fidelity_set.load()
    if args.split != "all":
        questions = [q for q in questions if q.split == args.split]
    questions = questions[: args.limit or None]
    index, count = (int(x) for x in args.shard.split("/"))
    results: dict[str, dict[str, dict]] = {
        f"probe:{n}": {"correct": {}, "replies": {}, "recomputed": {}, "ttft": {}} for n in args.probes
    }
    with torch.inference_mode():
        for q in tqdm(questions[index::count], desc="questions", unit="q"):
            p = probe.prompt([elements[n].document() for n in q.doc_ids], q.question)
            for name in args.probes:
                kind, _, arg = name.partition(":")
                if kind == "deep":
                    reply, share = probe.deep(p, int(arg)), (num_layers - int(arg)) / num_layers
                elif kind == "select":
                    scorer, _, ratio = arg.partition("@")
                    unrelated = unrelated_document(probe, q, elements) if scorer == "prior" else foreign
                    reply, share = probe.select(p, scorer, float(ratio), unrelated), float(ratio)
                else:
                    reply, share = probe.context(p, contexts_for(arg, probe, p, q, elements)), 0.0
                res = results[f"probe:{name}"]
                res["correct"][q.qid] = fidelity_set.correct(reply, q.answers)
                res["replies"][q.qid] = reply
                res["recomputed"][q.qid] = share
            args.raw.write_text(json.dumps(results))
    n = len(questions[index::count])
    acc = " ".join(f"{m}={sum(r['correct'].values())}/{n}" for m, r in results.items())
    print(f"SUMMARY fidelity_probes split={args.split} shard={args.shard} correct: {acc}")


if __name__ == "__main__":
    sys.exit(main())
