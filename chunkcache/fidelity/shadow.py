"""Online shadow checks: what reuse costs on live traffic, measured against full prefill.

A chunked request served by the engine's reuse configuration is drawn for a check at admission
(`fidelity_sample_rate`) and, once it has finished, re-run as a plain prefill of the same prompt
tokens: a SHADOW sequence, background work (the scheduler runs it on the token budget requests
leave, and a waiting request takes its KV blocks back), under the request's own cache_salt (its
blocks are hashed, and found, under that salt only). Requests with a JSON schema are not drawn
(their grammar state is the request's own).

- A greedy reply is compared token by token: the shadow decodes greedily up to the served
  reply's length, and the check scores 1 when its tokens are identical, else 0.
- A sampled reply (temperature > 0) has no single reply of full prefill to compare with, so its
  next-token distributions are: the request keeps the raw distribution of each of its first
  k = `fidelity_distribution_steps` tokens, and the shadow, teacher-forced on the served tokens
  (it appends them instead of its own), keeps full prefill's on the same prefixes. Per step the
  total variation TV_i = 1/2 sum |p_i - q_i| is the least chance that a draw from each, coupled
  as closely as can be, differs; the check scores prod (1 - TV_i): the chance that full prefill,
  coupled step by step with the served draws, would have drawn the same first k tokens. (The
  first step's KL(full || served) is logged beside it.)

So a check's score is on one scale either way (1 = what full prefill would have served), and the
rolling agreement is the mean score of a configuration's last `fidelity_window` checks.

At most `MAX_QUEUED` shadows wait or run at once; a request drawn beyond that is dropped and
counted. A check costs a full prefill, so at a fixed rate its share of the CPU grows with reuse's
speed-up (a warm request 10x cheaper than full prefill makes a 1% rate cost ~10%): the engine
reports each step's CPU time (`account`), split between shadows and other work by the tokens each
computed in it, and a request drawn when one more check (costed as the mean of those so far)
would take the shadows' share above `fidelity_max_share` is not checked (counted `over_budget`), so
checks take about that share at most whatever the speed-up (the first check of a run is free to
go over: nothing has measured a check yet). Results are kept per configuration (totals, the
rolling agreement, sampled checks' mean TV per step), reported by `stats()` (the engine's stats
and /metrics) and logged, and handed to the controller (controller.py) where there is one.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from chunkcache.config import FidelityConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.core.sequence import Sequence, SequenceKind
from chunkcache.core.sequence_state import FidelityCheck, PrefixKeys
from chunkcache.fidelity.controller import Controller, Move

logger = logging.getLogger(__name__)

MAX_QUEUED = 16
# The name a configuration is reported under without a profile (no controller): the engine's
# own chunk options.
DEFAULT_CONFIG = "default"


@dataclass
class _Pending:
    name: str  # the configuration that served the request
    reply: list[int]
    served: list[torch.Tensor] | None  # a sampled reply's first steps' log-probs; None: greedy


class ShadowChecks:
    def __init__(
        self,
        config: FidelityConfig,
        seed: int,
        blocks: BlockManager,
        max_model_len: int,
        controller: Controller | None,
    ) -> None:
        self.rate = config.effective_sample_rate
        self.window = config.window
        self.steps = config.distribution_steps
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.controller = controller
        self._random = random.Random(seed)
        self._generator = torch.Generator().manual_seed(seed)
        self._pending: dict[int, _Pending] = {}  # id(shadow) -> what was served
        self._number = 0
        self.checks: dict[str, dict[str, int]] = {}  # configuration -> result -> count
        self.recent: dict[str, deque[float]] = {}  # configuration -> last checks' scores
        self._tv: dict[str, list[float]] = {}  # configuration -> [sum of TV over steps, steps]
        self.dropped = 0  # drawn while MAX_QUEUED shadows were pending
        self.max_share = config.max_share
        self.shadow_cpu = 0.0  # CPU seconds of steps, the shadows' share of each (`account`)
        self.step_cpu = 0.0

    @property
    def current_config(self) -> str:
        return DEFAULT_CONFIG if self.controller is None else self.controller.current.name

    def admitted(self, seq: Sequence) -> None:
        """A request entered the engine: draw it for a check where it is eligible; a sampled one
        drawn starts keeping its first steps' distributions."""
        p, check = seq.params, seq.fidelity
        if (
            self.rate <= 0
            or seq.kind is not SequenceKind.REQUEST
            or check is None
            or p.json_schema is not None
            or self._random.random() >= self.rate
        ):
            return
        check.drawn = True
        if p.temperature > 0:
            check.step_logprobs, check.record_steps = [], self.steps

    def served(self, seq: Sequence) -> Sequence | None:
        """A request finished: if it was drawn, its shadow, for the engine to schedule."""
        check = seq.fidelity
        if check is None or not check.drawn:
            return None
        served, check.step_logprobs = check.step_logprobs, None  # the request keeps no vocab rows
        name = check.config or DEFAULT_CONFIG
        if seq.reply.error is not None or seq.reply.finish_reason not in ("stop", "length"):
            return None
        if not seq.num_output_tokens or (served is not None and not served):
            return None
        if len(self._pending) >= MAX_QUEUED:
            self.dropped += 1
            return None
        if not self.within_budget():
            self._count(name, "over_budget")
            return None
        reply = list(seq.output_token_ids)
        ids = list(seq.prompt_token_ids)
        if len(ids) + len(reply) > self.max_model_len or self.blocks.blocks_for(len(ids) + len(reply)) > (
            self.blocks.num_blocks
        ):
            self._count(name, "skipped")  # a full prefill cannot fit
            return None
        p = seq.params
        # Greedy: up to the served reply's length. Sampled: the recorded steps, teacher-forced.
        length = len(reply) if served is None else len(served)
        params = dataclasses.replace(
            p, temperature=0.0, max_tokens=length, stop=None, logprobs=None, prompt_logprobs=None,
            min_tokens=min(p.min_tokens, length),
        )  # fmt: skip
        self._number += 1  # checks started: their mean cost is shadow_cpu / _number
        shadow = Sequence(
            request_id=f"shadow-{self._number}-of-{seq.request_id}",  # never in the engine's requests
            prompt_token_ids=ids,
            token_ids=list(ids),
            params=params,
            kind=SequenceKind.SHADOW,
            prefix_keys=PrefixKeys(cache_salt=seq.prefix_keys.cache_salt),
        )
        shadow.reply.generator = self._generator
        if served is not None:
            shadow.fidelity = FidelityCheck(
                name, record_steps=length, step_logprobs=[], forced_token_ids=reply[:length]
            )
        self._pending[id(shadow)] = _Pending(name, reply, served)
        return shadow

    @property
    def cpu_share(self) -> float:
        """The shadows' share of the CPU time of the engine's steps so far."""
        return self.shadow_cpu / self.step_cpu if self.step_cpu > 0 else 0.0

    def within_budget(self) -> bool:
        """Whether one more check, costed as the mean of those started so far, keeps the shadows'
        share of the steps' CPU time within `max_share`."""
        cost = self.shadow_cpu / self._number if self._number else 0.0
        return self.shadow_cpu + cost <= self.max_share * (self.step_cpu + cost)

    def account(self, seqs: list[Sequence], tokens: list[int], cpu_seconds: float) -> None:
        """A step ran `seqs`, computing `tokens` each, in `cpu_seconds`: the shadows' part of it by
        tokens (a step's cost is mostly its prefill tokens; a decode row counts one)."""
        if self.rate <= 0:
            return
        self.step_cpu += cpu_seconds
        shadow = sum(n for seq, n in zip(seqs, tokens, strict=True) if seq.kind is SequenceKind.SHADOW)
        if shadow:
            self.shadow_cpu += cpu_seconds * shadow / max(1, sum(tokens))

    def finished(self, shadow: Sequence) -> Move | None:
        """A shadow ended (done, or failed with its batch): compare, count, tell the controller."""
        pending = self._pending.pop(id(shadow))
        name = pending.name
        full = None
        if shadow.fidelity is not None:
            full, shadow.fidelity.step_logprobs = shadow.fidelity.step_logprobs, None
        if shadow.reply.error is not None or (pending.served is not None and not full):
            self._count(name, "error")
            return None
        if pending.served is None:
            score, verdict = self._greedy(shadow.output_token_ids, pending.reply)
            self._count(name, "agree" if score == 1.0 else "disagree")
        else:
            assert full
            score, verdict = self._distributions(name, pending.served, full)
        window = self.recent.setdefault(name, deque(maxlen=self.window))
        window.append(score)
        logger.info(
            "shadow check of %s under %s: %s; rolling agreement %.2f over %d",
            shadow.request_id.split("-of-", 1)[1], name, verdict, sum(window) / len(window), len(window),
        )  # fmt: skip
        return None if self.controller is None else self.controller.observe(name, list(window))

    def _greedy(self, got: list[int], reply: list[int]) -> tuple[float, str]:
        if got == reply:
            return 1.0, "identical to full prefill"
        first = next(
            (i for i, (a, b) in enumerate(zip(got, reply, strict=False)) if a != b), min(len(got), len(reply))
        )
        return 0.0, f"differs from full prefill at token {first}"

    def _distributions(
        self, name: str, served: list[torch.Tensor], full: list[torch.Tensor]
    ) -> tuple[float, str]:
        """A sampled reply's score: prod (1 - TV) over the steps both recorded (module docstring)."""
        steps = min(len(served), len(full))
        tvs = [
            0.5 * float((f.exp() - s.exp()).abs().sum())
            for s, f in zip(served[:steps], full[:steps], strict=True)
        ]
        first, firsts = full[0], served[0]
        kl = float((first.exp() * (first - firsts)).nan_to_num(0.0, posinf=float("inf")).sum())
        total = self._tv.setdefault(name, [0.0, 0])
        total[0] += sum(tvs)
        total[1] += steps
        self._count(name, "distribution")
        score = 1.0
        for tv in tvs:
            score *= max(0.0, 1.0 - tv)
        verdict = (
            f"sampled reply, next-token total variation {' '.join(f'{tv:.3f}' for tv in tvs)} over its first "
            f"{steps} tokens (first token KL(full || served) {kl:.3f}): agreement {score:.3f}"
        )
        return score, verdict

    def _count(self, name: str, result: str) -> None:
        counts = self.checks.setdefault(name, {})
        counts[result] = counts.get(result, 0) + 1

    def stats(self) -> dict[str, Any]:
        """Per configuration: check counts by result (agree, disagree: greedy; distribution: sampled;
        error, skipped, over_budget), the rolling agreement and sampled checks' total variation; the
        current configuration, the controller's moves, shadows pending and dropped, and the
        shadows' share of the steps' CPU time."""
        configs = {
            name: {
                **counts,
                "agreement": sum(self.recent[name]) / len(self.recent[name])
                if self.recent.get(name)
                else None,
                # Sampled replies' checks: the mean next-token total variation per step compared.
                "total_variation": self._tv[name][0] / self._tv[name][1] if self._tv.get(name) else None,
            }
            for name, counts in self.checks.items()
        }
        moves = {m.value: 0 for m in Move} if self.controller is None else {
            m.value: n for m, n in self.controller.moves.items()
        }  # fmt: skip
        return {
            "sample_rate": self.rate,
            "current": self.current_config,
            "configs": configs,
            "moves": moves,
            "pending": len(self._pending),
            "dropped": self.dropped,
            "cpu_share": self.cpu_share,
            "max_share": self.max_share,
        }
