"""The fidelity gate: at engine start, the reuse configuration a profile says meets the target.

With `fidelity_target` set, the engine computes its model's identity (the tiers' hash: weights
and vocabulary, chunk/tiers/identity.py), finds the profile (`fidelity_profile`: a file, or a
folder of profiles named by identity; default `envs.fidelity_dir()`), and serves chunked prompts
with the fastest configuration whose measured kept share meets the target by the lower end of its
95% interval (profile.choose: a share measured on few prompts is not trusted to its estimate),
else with the most accurate one. Without a profile it keeps the model's default reuse and says how to make one. A
request's own chunk options still override the chosen configuration.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkcache import envs
from chunkcache.chunk.tiers.identity import model_identity
from chunkcache.config import EngineConfig
from chunkcache.fidelity import profile as profiles

if TYPE_CHECKING:
    from chunkcache.model.loader import LoadedModel

logger = logging.getLogger(__name__)


def identity(model: Any, tokenizer: Any, weights_name: str) -> str:
    """The identity a profile is keyed by: the tiers' identity of the weights under their own name
    (not the served name, which does not change what reuse costs)."""
    return model_identity(model, tokenizer, weights_name)


def profile_location(config: EngineConfig) -> Path:
    return Path(config.fidelity.profile or envs.fidelity_dir()).expanduser()


@dataclass(frozen=True)
class Gated:
    """What the gate decided: the config to serve with, and the profile and configuration it chose
    from (None without a target or a profile), which the controller (controller.py) moves along."""

    config: EngineConfig
    profile: profiles.Profile | None = None
    chosen: str | None = None


def resolve(config: EngineConfig, loaded: LoadedModel) -> Gated:
    """`config` with the chunk options the profile chooses (unchanged without a target or a
    profile); a malformed profile or one of another model raises ProfileError, naming it."""
    target = config.fidelity.target
    if target is None or not config.chunk.enable:
        return Gated(config)
    ident = identity(loaded.model, loaded.tokenizer, loaded.name)
    where = profile_location(config)
    if config.fidelity.profile is not None and not where.exists():
        raise profiles.ProfileError(f"fidelity_profile {where} does not exist")
    path = profiles.find(where, ident)
    if path is None:
        logger.warning(
            "fidelity_target %g: no profile for model %s (identity %s...) in %s; keeping its default "
            "reuse. Make one with `chunkcache calibrate --model %s --dtype %s --out %s`",
            target, loaded.name, ident[:16], where, config.model, config.dtype, where,
        )  # fmt: skip
        return Gated(config)
    profile = profiles.load(path, ident)
    choice = profiles.choose(profile, target)
    try:
        chunk = config.chunk.with_request_options(choice.chosen.options, loaded.spec.num_layers)
    except ValueError as e:
        raise profiles.ProfileError(f"fidelity_profile {path}: {choice.chosen.name}: {e}") from None
    logger.log(
        logging.INFO if choice.met else logging.WARNING,
        "fidelity gate: chunked prompts use %s (%s), from %s (%d prompts, %s)",
        choice.chosen.name, choice.reason(target), path, profile.prompts, profile.prompt_set,
    )  # fmt: skip
    if choice.unsure:
        logger.warning(
            "fidelity gate: %s would meet the target %g by estimate but not by its 95%% lower bound; "
            "`chunkcache calibrate --limit N` with a larger N (it resumes) narrows the interval",
            ", ".join(c.name for c in choice.unsure), target,
        )  # fmt: skip
    return Gated(dataclasses.replace(config, chunk=chunk), profile, choice.chosen.name)
