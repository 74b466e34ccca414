"""bench_serve's figures: one request's timings, a run's percentiles, goodput at an SLO, tables.

As vLLM's `bench serve` reports them, from the client's clock:
- TTFT: request sent to first streamed text;
- TPOT: (end - TTFT) / (output tokens - 1), per request (none for a one-token answer);
- ITL: every gap between two streamed text events, over all requests;
- throughput: ok requests and their output tokens over the run's wall time (first send to last
  answer, summed over its rounds);
- goodput: ok requests per second that met both `slo_ttft` and `slo_tpot` (a request without a
  TPOT meets that part);
- cached: prompt tokens the side reports as served from its caches (usage.prompt_tokens_details.
  cached_tokens: chunkcache's prefix and chunk caches; llama-server's tokens reused from a slot's
  KV, by prefix, by `--cache-reuse` shifting, or restored from its RAM prompt cache).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), 0 <= q <= 100."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(values: list[float]) -> tuple[float, float, float]:
    """(mean, p50, p99); NaNs for none."""
    if not values:
        return float("nan"), float("nan"), float("nan")
    return statistics.fmean(values), percentile(values, 50), percentile(values, 99)


def meets_slo(r: RequestResult, slo_ttft: float, slo_tpot: float) -> bool:
    tpot = r.tpot
    return r.ok and r.ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot)


def run_figures(
    results: list[RequestResult], duration: float, slo_ttft: float, slo_tpot: float
) -> dict[str, float]:
    """A run's figures (seconds, per second, counts); NaN where no request was ok."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    figures = {f"ttft_p{q}": percentile(ttfts, q) for q in PERCENTILES}
    figures["ttft_mean"] = statistics.fmean(ttfts) if ttfts else float("nan")
    for name, values in (
        ("tpot", [t for r in ok if (t := r.tpot) is not None]),
        ("itl", [x for r in ok for x in r.itls]),
    ):
        figures[f"{name}_mean"], figures[f"{name}_p50"], figures[f"{name}_p99"] = summarize(values)
    met = sum(meets_slo(r, slo_ttft, slo_tpot) for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_s = 1 / duration if duration > 0 else float("nan")
    figures.update(
        requests=len(results),
        ok=len(ok),
        errors=len(results) - len(ok),
        duration_s=duration,
        req_per_s=len(ok) * per_s,
        out_tok_per_s=sum(r.output_tokens for r in ok) * per_s,
        slo_met=met,
        goodput=met * per_s,
        prompt_tokens=prompt,
        cached_tokens=cached,
        cached_share=cached / prompt if prompt else 0.0,
    )
    return figures


def slo_note(figures: dict[str, float], slo_ttft: float, slo_tpot: float) -> str:
    """A line where no ok request met the SLO (goodput 0 is reported, not an error)."""
    if figures["ok"] and not figures["slo_met"]:
        return (
            f"no request met the SLO (TTFT <= {slo_ttft:g}s and TPOT <= {slo_tpot:g}s): goodput 0; "
            f"its TTFT p50 was {figures['ttft_p50']:.2f}s"
        )
    return ""


def ms(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x * 1e3:.0f}"


COLUMNS = (
    ("side", 15), ("ok", 7), ("TTFT p50", 9), ("p90", 8), ("p99", 8), ("TPOT", 7), ("ITL", 7),
    ("ITL p50", 8), ("ITL p99", 8), ("out tok/s", 10), ("req/s", 7), ("goodput", 8), ("cached", 7),
)  # fmt: skip


def table(setting: str, rows: dict[str, dict[str, float]]) -> str:
    """One run setting's table, a row per side (times in ms; TPOT and ITL means)."""
    head = "".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w) in enumerate(COLUMNS))
    lines = [f"--- {setting} (ms; TPOT/ITL: mean) ---", head]
    for side, f in rows.items():
        cells = [
            f"{int(f['ok'])}/{int(f['requests'])}", ms(f["ttft_p50"]), ms(f["ttft_p90"]),
            ms(f["ttft_p99"]), ms(f["tpot_mean"]), ms(f["itl_mean"]), ms(f["itl_p50"]), ms(f["itl_p99"]),
            f"{f['out_tok_per_s']:.1f}", f"{f['req_per_s']:.3f}", f"{f['goodput']:.3f}",
            f"{f['cached_share']:.0%}",
        ]  # fmt: skip
        lines.append(
            f"{side:<{COLUMNS[0][1]}}"
            + "".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS[1:], strict=True))
        )
    return "\n".join(lines)


def ratio(a: float, b: float) -> str:
    """a / b as "1.23x"; "inf" / "nan" where b is 0 or either is missing."""
    if math.isnan(a) or math.isnan(b):
        return "nan"
    if b == 0:
        return "nan" if a == 0 else "inf"
    return f"{a / b:.2f}x"
