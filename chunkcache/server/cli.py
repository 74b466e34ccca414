"""`chunkcache serve`: command-line flags and the server's main.

Engine flags are generated from `config.option_names()` and the config dataclasses' field types,
so a new engine option becomes a flag without touching this file. Every generated flag defaults to
None, meaning "not given": `EngineConfig.from_options` then applies the environment and the
config's own default, in that order.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing
from typing import Any

from chunkcache import config as config_module
from chunkcache.config import EngineConfig, option_names

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 256


def _engine_option_specs() -> dict[str, tuple[Any, Any]]:
    """Flat option name -> (its type with Optional removed, its config default)."""
    # config.py keeps the flat-name -> (section, field) table private; reading it here keeps one
    # source of truth instead of a second copy of the mapping.
    sections: dict[str, type] = config_module._SECTIONS
    flat_to_section: dict[str, tuple[str, str]] = config_module._FLAT_TO_SECTION
    specs: dict[str, tuple[Any, Any]] = {}
    for name in option_names():
        if name in flat_to_section:
            section, field_name = flat_to_section[name]
            cls = sections[section]
        else:
            cls, field_name = EngineConfig, name
        field = {f.name: f for f in dataclasses.fields(cls)}[field_name]
        specs[name] = (_strip_optional(typing.get_type_hints(cls)[field_name]), _default_of(field))
    return specs


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `chunkcache serve`'s flags to `parser` and return it."""
    server = parser.add_argument_group("server")
    server.add_argument(
        "--model", required=True, help="model directory (or a hub id where a hub is reachable)"
    )
    server.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default: %(default)s)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind (default: %(default)s)")
    server.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1/* and /tokenize"
    )
    server.add_argument(
        "--max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUE,
        help="requests allowed to wait for their first token; more get HTTP 503 (default: %(default)s)",
    )
    server.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="on SIGTERM, seconds to let in-flight requests finish before aborting them (default: no limit)",
    )
    server.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"]
    )

    engine = parser.add_argument_group("engine")
    for name, (tp, default) in _engine_option_specs().items():
        flag = "--" + name.replace("_", "-")
        help_text = f"engine option {name} (default: {default!r})"
        if tp is bool:
            engine.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif typing.get_origin(tp) in (list, tuple):
            item = typing.get_args(tp)[0] if typing.get_args(tp) else str
            engine.add_argument(flag, dest=name, type=item, nargs="+", default=None, help=help_text)
        elif tp in (int, float, str):
            engine.add_argument(flag, dest=name, type=tp, default=None, help=help_text)
        else:
            raise TypeError(f"engine option {name} has type {tp!r}, which has no command-line form")
    return parser


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (None = not given)."""
    return {name: getattr(args, name) for name in option_names() if getattr(args, name, None) is not None}


def run_serve(args: argparse.Namespace) -> None:
    """Load the engine and serve until SIGINT/SIGTERM; in-flight requests are drained first."""
    import uvicorn

    from chunkcache.engine.engine import LLMEngine
    from chunkcache.server.app import build_app

    logging.basicConfig(level=args.log_level.upper() if args.log_level != "trace" else "DEBUG")
    config = EngineConfig.from_options(args.model, **engine_options(args))
    engine = LLMEngine(config)
    app = build_app(
        engine,
        api_key=args.api_key,
        max_queue=args.max_queue,
        served_model_name=config.served_model_name,
        drain_timeout=args.drain_timeout,
    )
    logger.info("serving %s on http://%s:%d", engine.model_name, args.host, args.port)
    # uvicorn's own graceful shutdown stops accepting connections and waits for open requests to
    # complete; the app's lifespan then drains the engine and closes it.
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.drain_timeout,
            access_log=args.log_level in ("debug", "trace"),
        )
    )
    server.run()


def main(argv: list[str] | None = None) -> None:
    """`python -m chunkcache.server.cli ...`: the same as `chunkcache serve ...`."""
    parser = argparse.ArgumentParser(
        prog="chunkcache serve", description="OpenAI-compatible chunkcache server"
    )
    add_serve_arguments(parser)
    run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    main()
