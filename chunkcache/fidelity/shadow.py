"""Online shadow checks: what reuse costs on live traffic, measured against full prefill.

A sampled chunked request (served by the engine's reuse configuration, greedy) is re-run, once it
has finished, as a plain prefill of the same prompt tokens: a SHADOW sequence, background work
(the scheduler runs it on the token budget requests leave, and a waiting request takes its KV
blocks back), under the request's own cache_salt (its blocks are hashed, and found, under that
salt only), with the request's sampling params up to the served reply's length. The served reply
"agrees" when the shadow's tokens are identical. Only greedy requests are sampled: a sampled
reply has no single reply of full prefill to compare with (the first-token KL and the greedy
continuation of a sampled prefix are not built). Requests with a JSON schema are not sampled
either (their grammar state is the request's own).

At most `MAX_QUEUED` shadows wait or run at once; a sampled request beyond that is dropped and
counted. Results are kept per configuration (totals, and the last `fidelity_window` for the
rolling agreement), reported by `stats()` (the engine's stats and /metrics) and logged, and
handed to the controller (controller.py) where there is one.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from chunkcache.config import FidelityConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.core.sequence import Sequence, SequenceKind
from chunkcache.fidelity.controller import Controller, Move

logger = logging.getLogger(__name__)

MAX_QUEUED = 16
# The name a configuration is reported under without a profile (no controller): the engine's
# own chunk options.
DEFAULT_CONFIG = "default"


class ShadowChecks:
    def __init__(
        self,
        config: FidelityConfig,
        seed: int,
        blocks: BlockManager,
        max_model_len: int,
        schedule: Callable[[Sequence], None],
        controller: Controller | None,
    ) -> None:
        self.rate = config.effective_sample_rate
        self.window = config.window
        self.blocks = blocks
        self.max_model_len = max_model_len
        self._schedule = schedule
        self.controller = controller
        self._random = random.Random(seed)
        self._generator = torch.Generator().manual_seed(seed)
        self._pending: dict[int, tuple[Sequence, str, list[int]]] = {}  # id(shadow) -> served
        self._number = 0
        self.checks: dict[str, dict[str, int]] = {}  # configuration -> result -> count
        self.recent: dict[str, deque[bool]] = {}
        self.dropped = 0  # sampled while MAX_QUEUED shadows were pending

    @property
    def current_config(self) -> str:
        return DEFAULT_CONFIG if self.controller is None else self.controller.current.name

    def served(self, seq: Sequence) -> None:
        """A request finished: sample it for a shadow check where it is eligible."""
        if not self._eligible(seq) or self._random.random() >= self.rate:
            return
        if len(self._pending) >= MAX_QUEUED:
            self.dropped += 1
            return
        reply = list(seq.output_token_ids)
        ids = list(seq.prompt_token_ids)
        if len(ids) + len(reply) > self.max_model_len or self.blocks.blocks_for(len(ids) + len(reply)) > (
            self.blocks.num_blocks
        ):
            self._count(seq.fidelity_config or DEFAULT_CONFIG, "skipped")  # a full prefill cannot fit
            return
        p = seq.params
        params = dataclasses.replace(
            p, max_tokens=len(reply), stop=None, logprobs=None, prompt_logprobs=None,
            min_tokens=min(p.min_tokens, len(reply)),
        )  # fmt: skip
        self._number += 1
        shadow = Sequence(
            request_id=f"shadow-{self._number}-of-{seq.request_id}",  # never in the engine's requests
            prompt_token_ids=ids,
            token_ids=list(ids),
            params=params,
            kind=SequenceKind.SHADOW,
            cache_salt=seq.cache_salt,
        )
        shadow.generator = self._generator
        self._pending[id(shadow)] = (shadow, seq.fidelity_config or DEFAULT_CONFIG, reply)
        self._schedule(shadow)

    def _eligible(self, seq: Sequence) -> bool:
        p = seq.params
        return (
            self.rate > 0
            and seq.kind is SequenceKind.REQUEST
            and seq.fidelity_config is not None
            and seq.error is None
            and seq.finish_reason in ("stop", "length")
            and seq.num_output_tokens > 0
            and p.temperature == 0
            and p.json_schema is None
        )

    def finished(self, shadow: Sequence) -> Move | None:
        """A shadow ended (done, or failed with its batch): compare, count, tell the controller."""
        _, name, reply = self._pending.pop(id(shadow))
        if shadow.error is not None:
            self._count(name, "error")
            return None
        got = shadow.output_token_ids
        agreed = got == reply
        self._count(name, "agree" if agreed else "disagree")
        window = self.recent.setdefault(name, deque(maxlen=self.window))
        window.append(agreed)
        first = next(
            (i for i, (a, b) in enumerate(zip(got, reply, strict=False)) if a != b), min(len(got), len(reply))
        )
        logger.info(
            "shadow check of %s under %s: %s; rolling agreement %.2f over %d",
            shadow.request_id.split("-of-", 1)[1], name,
            "identical to full prefill" if agreed else f"differs from full prefill at token {first}",
            sum(window) / len(window), len(window),
        )  # fmt: skip
        return None if self.controller is None else self.controller.observe(name, list(window))

    def _count(self, name: str, result: str) -> None:
        counts = self.checks.setdefault(name, {})
        counts[result] = counts.get(result, 0) + 1

    def stats(self) -> dict[str, Any]:
        """Per configuration: check counts by result and the rolling agreement; the current
        configuration, the controller's moves, shadows pending and dropped."""
        configs = {
            name: {
                **counts,
                "agreement": sum(self.recent[name]) / len(self.recent[name])
                if self.recent.get(name)
                else None,
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
        }
