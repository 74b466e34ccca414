"""`chunkcache serve`: command-line flags and the server's main.

Engine flags come from `engine_args` (generated from the config tree), so a new engine option
becomes a `serve` flag without touching this file.
"""

from __future__ import annotations

import argparse
import logging

from chunkcache.config import EngineConfig
from chunkcache.engine_args import MODEL_HELP, add_engine_arguments, engine_options
from chunkcache.errors import ModelLoadError
from chunkcache.server.limits import DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 256
# A hung request must not keep a SIGTERMed server alive for ever (a supervisor would SIGKILL it).
DEFAULT_DRAIN_TIMEOUT = 30.0


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
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on every route but /health (see --metrics-without-api-key)",
    )
    server.add_argument(
        "--metrics-without-api-key",
        action="store_true",
        help="leave /metrics open for scrapers when --api-key is set",
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
        default=DEFAULT_DRAIN_TIMEOUT,
        help="on SIGTERM, seconds to let in-flight requests finish before aborting them (default: %(default)s)",
    )
    server.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get HTTP 413 before they are read (default: %(default)s)",
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
        max_request_bytes=args.max_request_bytes,
        metrics_without_api_key=args.metrics_without_api_key,
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
    engine_loop = app.state.engine_loop

    def on_engine_death(error: BaseException) -> None:
        logger.critical("the engine thread died (%s): shutting the server down", type(error).__name__)
        server.should_exit = True

    engine_loop.on_death = on_engine_death
    server.run()
    if engine_loop.dead is not None:
        # Non-zero, so that a supervisor (systemd, Kubernetes) restarts the server.
        raise SystemExit(f"chunkcache serve: the engine died: {engine_loop.dead!r}")


def main(argv: list[str] | None = None) -> None:
    """`python -m chunkcache.server.cli ...`: the same as `chunkcache serve ...`."""
    parser = argparse.ArgumentParser(
        prog="chunkcache serve", description="OpenAI-compatible chunkcache server"
    )
    add_serve_arguments(parser)
    try:
        run_serve(parser.parse_args(argv))
    except ModelLoadError as e:  # a missing or bad model: one line, no traceback
        raise SystemExit(f"chunkcache serve: error: {e}") from None


if __name__ == "__main__":
    main()
