"""Running streams keep a share of their idle decode rate while long prefills run beside them.

A step's cost grows with its tokens. On a GPU a decode step is bound by reading the weights, and
a piece of a long prefill added to it costs little; on a CPU every token costs its FLOPs, and a
step that carries a 256-token piece takes ~20 decode steps' time (SmolLM2, one thread), so a
stream decoding beside a long prompt fell to 5% of its idle rate (bench_mixed_load). The guard
measures it: decode steps' time when nothing else runs (the idle rate), the time of steps that run
more, and, over the recent steps that served decodes, tokens per second. A step may add long
prefill pieces or background work only if that rate, counting such a step, stays at least
`min_decode_share` of the idle rate; otherwise it serves the decodes and short prompts alone. Where pieces are cheap (a GPU) the rate never drops and nothing
is held back; where they are not, prefills get the time the streams can spare and take longer.
"""

from __future__ import annotations

# Steps the decaying sums hold at least (weight of the past 1 - 1/50 per step). The window must
# also hold the decode steps that pay for one guarded step: with decode steps of d seconds and a
# guarded step of b, the streams keep share s over k decode steps and that step only if
# k >= (s * b / d - 1) / (1 - s). A fixed 50-step window held too few once b > ~52 d (the 1.5B
# on a CPU: a blend piece of the budget costs ~250 decode steps): the guard let one such step
# through and then none while any stream decoded, and the prefill starved until they all ended.
_MIN_WINDOW = 50.0


class DecodeGuard:
    def __init__(self, min_decode_share: float) -> None:
        self.min_decode_share = min_decode_share
        self._idle_step: float | None = None  # seconds of a decode-only step (moving average)
        self._busy_step = 0.0  # seconds of a step that ran what the guard holds back (moving average)
        self._time = 0.0  # decaying sums over steps that served decodes: their seconds
        self._steps = 0.0  # and their count (each gave every stream one token)

    def allows_prefill(self, decodes: bool) -> bool:
        """Whether a step serving decodes (`decodes`) may add long prefills or background work:
        whether the streams' rate, that step included, stays at the share of the idle rate."""
        if not decodes or self.min_decode_share <= 0 or self._idle_step is None:
            return True
        if self._time + self._busy_step <= 0:
            return True  # nothing measured since the streams started
        rate = (self._steps + 1) / (self._time + self._busy_step)
        return rate >= self.min_decode_share / self._idle_step

    def record(self, decodes: bool, only_decodes: bool, guarded: bool, seconds: float) -> None:
        """A step ran: whether it served decodes, whether it ran nothing else, whether it ran what
        the guard holds back (long prefills, background work), and how long it took. Only such
        steps tell what letting one more through costs: steps with short prompts cost less."""
        if not decodes:
            self._time = self._steps = 0.0  # nobody decodes: the window starts afresh
            return
        if only_decodes:
            last = self._idle_step
            self._idle_step = seconds if last is None else 0.8 * last + 0.2 * seconds
        elif guarded:
            self._busy_step = seconds if not self._busy_step else 0.8 * self._busy_step + 0.2 * seconds
        decay = 1.0 - 1.0 / self._window()
        self._time = decay * self._time + seconds
        self._steps = decay * self._steps + 1.0

    def _window(self) -> float:
        """Steps the sums hold: twice the decode steps one guarded step needs beside it, so that
        one always fits (at least _MIN_WINDOW)."""
        if not self._idle_step or not self._busy_step:
            return _MIN_WINDOW
        share = self.min_decode_share
        return max(_MIN_WINDOW, 2.0 * share * (self._busy_step / self._idle_step) / (1.0 - share))
