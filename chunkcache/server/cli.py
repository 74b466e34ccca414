"""`chunkcache serve`: command-line flags and the server's main.

Engine flags come from `engine_args` (generated from the config tree), so a new engine option
becomes a `serve` flag without touching this file.
"""

from __future__ import annotations

import argparse
import logging
from types import FrameType

from chunkcache.engine_args import MODEL_HELP, add_engine_arguments, engine_config
from chunkcache.errors import UsageError, add_debug_argument, run_command
from chunkcache.http_limits import DEFAULT_MAX_REQUEST_BYTES
from chunkcache.server.text_limits import DEFAULT_MAX_PREWARM_TOKENS

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 256
# A hung request must not keep a SIGTERMed server alive for ever (a supervisor would SIGKILL it).
DEFAULT_DRAIN_TIMEOUT = 30.0
# Seconds the HTTP server waits, past the drain timeout, for the error responses of the requests
# the drain ended to be written, before it cancels them (which would send a bare 500).
DRAIN_GRACE_S = 5.0


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `chunkcache serve`'s flags to `parser` and return it."""
    server = parser.add_argument_group("HTTP server")
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
        "--max-prewarm-tokens",
        type=int,
        default=DEFAULT_MAX_PREWARM_TOKENS,
        help="tokens one POST /v1/chunk_cache/prewarm may compute (system and documents together); "
        "larger ones get HTTP 400 naming the field (default: %(default)s)",
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
    config = engine_config(args.model or default_model(), args)
    try:
        engine = LLMEngine(config)
    except ValueError as e:  # a checkpoint it cannot load, an option the model refuses
        raise UsageError(str(e)) from e
    app = build_app(
        engine,
        api_key=args.api_key,
        max_queue=args.max_queue,
        served_model_name=config.served_model_name,
        drain_timeout=args.drain_timeout,
        max_request_bytes=args.max_request_bytes,
        max_prewarm_tokens=args.max_prewarm_tokens,
        metrics_without_api_key=args.metrics_without_api_key,
    )
    logger.info("serving %s on http://%s:%d", engine.model_name, args.host, args.port)
    # uvicorn's own graceful shutdown stops accepting connections and waits for open requests to
    # complete; the app's lifespan then drains the engine and closes it.
    engine_loop = app.state.engine_loop

    class DrainingServer(uvicorn.Server):
        """uvicorn, telling the engine loop to drain as soon as a stop signal arrives."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            engine_loop.begin_drain(args.drain_timeout)

    server = DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.drain_timeout + DRAIN_GRACE_S,
            access_log=args.log_level in ("debug", "trace"),
        )
    )

    def on_engine_death(error: BaseException) -> None:
        logger.critical("the engine thread died (%s): shutting the server down", type(error).__name__)
        server.should_exit = True

    engine_loop.on_death = on_engine_death
    server.run()
    if engine_loop.dead is not None:
        # Non-zero, so that a supervisor (systemd, Kubernetes) restarts the server.
        raise SystemExit(f"chunkcache serve: the engine died: {engine_loop.dead!r}")


def main(argv: list[str] | None = None) -> int:
    """`python -m chunkcache.server.cli ...`: the same as `chunkcache serve ...`."""
    parser = argparse.ArgumentParser(
        prog="chunkcache serve", description="OpenAI-compatible chunkcache server"
    )
    add_serve_arguments(parser)
    add_debug_argument(parser)
    args = parser.parse_args(argv)
    return run_command(parser.prog, lambda: run_serve(args), args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
