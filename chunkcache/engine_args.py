"""Engine options as command-line flags, generated from the config tree.

Every flag defaults to None ("not given"), so `EngineConfig.from_options` applies the environment
and then the config's own default, in that order; a new config field becomes a flag by itself.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any

from chunkcache.config import option_names, option_specs

MODEL_HELP = (
    "a known model's short name (qwen2.5-coder-1.5b, the default; smollm2; see `chunkcache models`), "
    "a checkpoint directory (config.json + safetensors), a .gguf file or a directory holding one, "
    "or a hub id where a hub is reachable"
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("engine")
    for name, (tp, default) in option_specs().items():
        flag = "--" + name.replace("_", "-")
        help_text = f"engine option {name} (default: {default!r})"
        if tp is bool:
            group.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif typing.get_origin(tp) in (list, tuple):
            item = typing.get_args(tp)[0] if typing.get_args(tp) else str
            group.add_argument(flag, dest=name, type=item, nargs="+", default=None, help=help_text)
        elif tp in (int, float, str):
            group.add_argument(flag, dest=name, type=tp, default=None, help=help_text)
        else:
            raise TypeError(f"engine option {name} has type {tp!r}, which has no command-line form")
    return parser


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line."""
    return {name: getattr(args, name) for name in option_names() if getattr(args, name, None) is not None}
