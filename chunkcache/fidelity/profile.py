"""A fidelity profile: what each reuse configuration kept of full prefill's replies on one model.

`chunkcache calibrate` writes it; an engine with `fidelity_target` reads it at start and picks a
configuration (`choose`). It is keyed by the model identity the chunk tiers bind into their
entries (chunk/tiers/identity.py: weights' names, shapes, dtypes and values sampled, and the
vocabulary), so a profile measured on one checkpoint or dtype is never applied to another.

"kept" is per prompt: where the prompt gives expected answers and full prefill answered it
correctly, the configuration's reply is correct too; where it gives none, the configuration's
greedy reply is identical to full prefill's. Prompts whose answers full prefill got wrong do not
count (there was nothing to keep). `kept_fraction` = kept / counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chunkcache.config import REQUEST_CHUNK_OPTIONS, ReuseOptions

FORMAT = "chunkcache-fidelity-profile-v1"


class ProfileError(ValueError):
    """A profile that cannot be used: unreadable, malformed, or for another model."""


@dataclass(frozen=True)
class Measured:
    """One configuration's numbers over the calibration prompts. A configuration the run did not
    finish (no prompt measured) has `kept_fraction` or `speedup` None and is never chosen."""

    name: str
    options: ReuseOptions  # checked when the profile is read (ReuseOptions.checked)
    prompts: int  # prompts measured
    counted: int  # prompts with something to keep (see the module's docstring)
    kept: int
    kept_fraction: float | None
    identical: float | None  # share of prompts whose greedy reply equals full prefill's
    accuracy: float | None  # share correct among prompts with expected answers (None: none had)
    recomputed_share: float | None  # mean share of document tokens recomputed
    ttft_ratio: float | None  # warm TTFT over full prefill's, summed over the same prompts
    speedup: float | None  # 1 / ttft_ratio

    @property
    def complete(self) -> bool:
        return self.kept_fraction is not None and self.speedup is not None

    def kept_interval(self, z: float = 1.96) -> tuple[float, float] | None:
        """Wilson's 95% interval of the kept share: how far a few prompts let the figure be trusted."""
        n = self.counted
        if n == 0:
            return None
        p = self.kept / n
        center = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return max(0.0, center - half), min(1.0, center + half)

    @property
    def kept_lower(self) -> float:
        """The lower end of the kept share's 95% interval: what the gate and the controller rank
        by, so that 14 of 14 (at least 78%) does not pass a 0.95 target that 400 of 410 (at least
        95.3%) passes. 0 with nothing counted."""
        interval = self.kept_interval()
        return 0.0 if interval is None else interval[0]

    def describe(self) -> str:
        """n, the estimate and its lower bound, as the gate's log line and the table say them."""
        return (
            f"kept {self.kept} of {self.counted} (estimate {100 * (self.kept_fraction or 0):.1f}%, "
            f"95% lower bound {100 * self.kept_lower:.1f}%)"
        )


@dataclass(frozen=True)
class Profile:
    model: str  # the model's name as loaded (for people; the identity is what is checked)
    identity: str
    device: str
    dtype: str
    prompt_set: str
    max_tokens: int
    prompts: int
    full_accuracy: float | None
    full_ttft_ms: float | None
    configurations: tuple[Measured, ...]

    def to_json(self) -> str:
        body = {"format": FORMAT, **asdict(self)}
        for raw, measured in zip(body["configurations"], self.configurations, strict=True):
            raw["options"] = measured.options.to_mapping()  # the options set, flat, as they are read
        return json.dumps(body, indent=1)


def file_name(identity: str) -> str:
    """A profile's file name in a profile folder: the identity, whole."""
    return f"{identity}.json"


def _number(raw: dict[str, Any], key: str, where: str, lo: float, hi: float) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProfileError(f"{where}: {key} must be a number or null, got {value!r}")
    if not lo <= value <= hi:
        raise ProfileError(f"{where}: {key} {value} is outside [{lo}, {hi}]")
    return float(value)


def _measured(raw: Any, where: str) -> Measured:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: expected an object")
    name, options = raw.get("name"), raw.get("options")
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{where}: name must be a non-empty string")
    where = f"{where} ({name})"
    if not isinstance(options, dict):
        raise ProfileError(f"{where}: options must be an object of chunk options")
    unknown = sorted(set(options) - set(REQUEST_CHUNK_OPTIONS))
    if unknown:
        raise ProfileError(f"{where}: unknown chunk options {unknown}")
    try:
        reuse = ReuseOptions.checked(options)
    except ValueError as e:
        raise ProfileError(f"{where}: options: {e}") from None
    counts = {}
    for key in ("prompts", "counted", "kept"):
        value = raw.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ProfileError(f"{where}: {key} must be an integer >= 0, got {value!r}")
        counts[key] = value
    if not counts["kept"] <= counts["counted"] <= counts["prompts"]:
        raise ProfileError(f"{where}: needs kept <= counted <= prompts, got {counts}")
    # The gate ranks by the interval of kept / counted: a kept_fraction saying otherwise is an edit
    # that would mislead the log line and the table.
    kept_fraction = _number(raw, "kept_fraction", where, 0.0, 1.0)
    if kept_fraction is not None and (
        not counts["counted"] or abs(kept_fraction - counts["kept"] / counts["counted"]) > 1e-9
    ):
        raise ProfileError(
            f"{where}: kept_fraction {kept_fraction} is not kept / counted ({counts['kept']} / {counts['counted']})"
        )
    inf = math.inf
    return Measured(
        name,
        reuse,
        **counts,
        kept_fraction=kept_fraction,
        identical=_number(raw, "identical", where, 0.0, 1.0),
        accuracy=_number(raw, "accuracy", where, 0.0, 1.0),
        recomputed_share=_number(raw, "recomputed_share", where, 0.0, 1.0),
        ttft_ratio=_number(raw, "ttft_ratio", where, 0.0, inf),
        speedup=_number(raw, "speedup", where, 0.0, inf),
    )


def parse(text: str, where: str) -> Profile:
    """The profile in `text` (read from `where`), checked field by field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"fidelity_profile {where} is not JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ProfileError(f"fidelity_profile {where} is not a {FORMAT} file (its 'format' field)")
    identity = raw.get("identity")
    if not isinstance(identity, str) or len(identity) != 64:
        raise ProfileError(f"fidelity_profile {where}: identity must be a 64-digit hex string")
    configs = raw.get("configurations")
    if not isinstance(configs, list) or not configs:
        raise ProfileError(f"fidelity_profile {where}: configurations must be a non-empty list")
    measured = tuple(
        _measured(c, f"fidelity_profile {where} configurations[{i}]") for i, c in enumerate(configs)
    )
    try:
        return Profile(
            model=str(raw["model"]),
            identity=identity,
            device=str(raw["device"]),
            dtype=str(raw["dtype"]),
            prompt_set=str(raw["prompt_set"]),
            max_tokens=int(raw["max_tokens"]),
            prompts=int(raw["prompts"]),
            full_accuracy=_number(raw, "full_accuracy", f"fidelity_profile {where}", 0.0, 1.0),
            full_ttft_ms=_number(raw, "full_ttft_ms", f"fidelity_profile {where}", 0.0, math.inf),
            configurations=measured,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"fidelity_profile {where}: missing or malformed field {e}") from None


def find(location: Path, identity: str) -> Path | None:
    """The profile for `identity`: `location` itself if it is a file, else the file named by the
    identity in the folder `location` (None when there is none)."""
    if location.is_file():
        return location
    candidate = location / file_name(identity)
    return candidate if candidate.is_file() else None


def load(path: Path, identity: str) -> Profile:
    """The profile at `path`, refused if it is malformed or measured on another model."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(f"fidelity_profile {path} cannot be read: {e}") from None
    profile = parse(text, str(path))
    if profile.identity != identity:
        raise ProfileError(
            f"fidelity_profile {path} was measured on another model (identity {profile.identity[:16]}..., "
            f"model {profile.model!r}); this engine's model has identity {identity[:16]}...: run "
            "`chunkcache calibrate` with this model, dtype and adapter"
        )
    return profile


@dataclass(frozen=True)
class Choice:
    chosen: Measured
    met: bool  # whether its lower bound meets the target (else it is the most accurate one)
    skipped: tuple[str, ...]  # configurations without measurements
    # Faster configurations whose estimate meets the target but whose lower bound does not: too
    # few prompts to tell (a larger `calibrate --limit` may let them pass).
    unsure: tuple[Measured, ...] = ()

    def reason(self, target: float) -> str:
        c = self.chosen
        speed = f"{c.speedup:.2f}x full prefill's warm TTFT"
        if self.met:
            why = f"the fastest configuration whose 95% lower bound meets the target {target:g}: {c.describe()} at {speed}"
        else:
            why = (
                f"no configuration's 95% lower bound meets the target {target:g}; the most accurate one: "
                f"{c.describe()} at {speed}"
            )
        if self.unsure:
            names = ", ".join(f"{u.name} ({u.describe()})" for u in self.unsure)
            why += f"; faster, meeting it by estimate only (too few prompts): {names}"
        if self.skipped:
            why += f" (not measured, skipped: {', '.join(self.skipped)})"
        return why


def choose(profile: Profile, target: float) -> Choice:
    """The fastest configuration whose kept share's 95% lower bound (Wilson) meets `target` (ties:
    the higher bound, then the one listed first); if none does, the one with the highest bound
    (ties: the faster, then the one listed first). Configurations without measurements are
    skipped. Ranking by the bound, not the estimate, is what keeps a configuration measured on a
    handful of prompts from passing a 95% target by luck."""
    complete = [c for c in profile.configurations if c.complete]
    skipped = tuple(c.name for c in profile.configurations if not c.complete)
    if not complete:
        raise ProfileError(f"fidelity_profile for {profile.model!r} measured no configuration completely")
    order = {c.name: i for i, c in enumerate(complete)}
    meeting = [c for c in complete if c.kept_lower >= target]
    if meeting:
        best = min(meeting, key=lambda c: (-(c.speedup or 0.0), -c.kept_lower, order[c.name]))
    else:
        best = min(complete, key=lambda c: (-c.kept_lower, -(c.speedup or 0.0), order[c.name]))
    unsure = tuple(
        c
        for c in complete
        if (c.kept_fraction or 0.0) >= target
        and c.kept_lower < target
        and (c.speedup or 0.0) > (best.speedup or 0.0)
    )
    return Choice(best, bool(meeting), skipped, unsure)
