"""The OpenAI-compatible HTTP server (`chunkcache serve`)."""

from chunkcache.server.app import build_app
from chunkcache.server.cli import add_serve_arguments, run_serve

__all__ = ["add_serve_arguments", "build_app", "run_serve"]
