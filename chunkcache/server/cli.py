"""`chunkcache serve`: command-line flags and the server's main.

Engine flags come from `engine_args` (generated from the config tree), so a new engine option
becomes a `serve` flag without touching this file.
"""

from __future__ import annotations

import argparse
import logging

from chunkcache.config import EngineConfig
from chunkcache.engine_args import MODEL_HELP, add_engine_arguments, engine_options

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 256


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `chunkcache serve`'s flags to `parser` and return it."""
    server = parser.add_argument_group("server")
    server.add_argument(
        "--model",
        default=None,
        help=MODEL_HELP,
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

    # served_model_name is an engine option: its flag comes with the engine's.
    return add_engine_arguments(parser)


def run_serve(args: argparse.Namespace) -> None:
    """Load the engine and serve until SIGINT/SIGTERM; in-flight requests are drained first."""
    import uvicorn

    from chunkcache.engine.engine import LLMEngine
    from chunkcache.model.loader import default_model
    from chunkcache.server.app import build_app

    logging.basicConfig(level=args.log_level.upper() if args.log_level != "trace" else "DEBUG")
    config = EngineConfig.from_options(args.model or default_model(), **engine_options(args))
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
