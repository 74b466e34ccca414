"""The fidelity controller: moves the engine's reuse configuration along its profile as shadow
checks (shadow.py) report how much of full prefill's replies it keeps on live traffic.

The profile's configurations form a ladder, fastest first, each rung more accurate (by the lower
bound of the calibration's kept share, as the gate ranks them) than every faster one; configurations that are slower and no more
accurate than a faster one are left out, as no move would ever want them. The engine starts on
the gate's choice. After each move the controller waits for `fidelity_window` (K) checks of the
new configuration; then, judged on its last K checks, it climbs one rung when their agreement is
below the target, steps one rung back towards speed when it is at least target + margin, else
stays. So no two moves come less than K checks apart, and it never leaves the ladder.

Requests that give their own chunk options are served with them: they are neither moved nor
sampled (nothing they show is about the engine's configuration).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from chunkcache.config import ChunkConfig, FidelityConfig
from chunkcache.fidelity.profile import Measured, Profile, ProfileError

logger = logging.getLogger(__name__)


class Move(enum.Enum):
    UP = "up"  # towards accuracy
    DOWN = "down"  # towards speed


@dataclass(frozen=True)
class Rung:
    name: str
    chunk: ChunkConfig  # the engine's chunk config with this configuration's options
    kept_fraction: float  # the calibration's, for the log lines
    speedup: float


def ladder(profile: Profile) -> list[Measured]:
    """The complete configurations, fastest first, each more accurate than all faster ones by the
    lower bound of its kept share (ties in speed: the higher bound, then the one listed first, as
    the gate ranks them, so that the gate's choice is always a rung)."""
    complete = [c for c in profile.configurations if c.complete]
    order = {c.name: i for i, c in enumerate(complete)}
    ranked = sorted(complete, key=lambda c: (-(c.speedup or 0.0), -c.kept_lower, order[c.name]))
    rungs: list[Measured] = []
    for c in ranked:
        if not rungs or c.kept_lower > rungs[-1].kept_lower:
            rungs.append(c)
    return rungs


class Controller:
    def __init__(
        self, profile: Profile, start: str, base: ChunkConfig, config: FidelityConfig, num_layers: int
    ) -> None:
        assert config.target is not None
        self.target = config.target
        self.window = config.window
        self.margin = config.margin
        self.rungs: list[Rung] = []
        for c in ladder(profile):
            try:
                chunk = base.with_request_options(c.options, num_layers)
            except ValueError as e:
                raise ProfileError(f"fidelity_profile: {c.name}: {e}") from None
            self.rungs.append(Rung(c.name, chunk, c.kept_fraction or 0.0, c.speedup or 0.0))
        names = [r.name for r in self.rungs]
        # The gate's choice is on the ladder (both prefer speed, then accuracy, then order).
        self.index = names.index(start) if start in names else 0
        self.since_move = 0  # checks of the current configuration since it became current
        self.moves = {Move.UP: 0, Move.DOWN: 0}
        logger.info(
            "fidelity controller: ladder %s (fastest first), starting at %s, window %d checks",
            " < ".join(names), self.current.name, self.window,
        )  # fmt: skip

    @property
    def current(self) -> Rung:
        return self.rungs[self.index]

    def observe(self, name: str, window: list[float]) -> Move | None:
        """A check of configuration `name` ended; `window` is its last checks' scores in [0, 1]
        (shadow.py: 1 = what full prefill would have served; newest last). Returns
        the move made, if any. Checks of another configuration (one the engine has left; requests
        served before a move) are not counted."""
        if name != self.current.name:
            return None
        self.since_move += 1
        if self.since_move < self.window:
            return None
        recent = window[-self.window :]
        agreement = sum(recent) / len(recent)
        if agreement < self.target and self.index + 1 < len(self.rungs):
            move = Move.UP
        elif agreement >= min(1.0, self.target + self.margin) and self.index > 0:
            move = Move.DOWN
        else:
            return None
        old = self.current
        self.index += 1 if move is Move.UP else -1
        self.since_move = 0
        self.moves[move] += 1
        logger.warning(
            "fidelity controller: %s kept %.0f%% of full prefill's replies over its last %d checks "
            "(target %.0f%%): moving %s to %s",
            old.name, 100 * agreement, len(recent), 100 * self.target,
            "up (more accurate)" if move is Move.UP else "down (faster)", self.current.name,
        )  # fmt: skip
        return move
