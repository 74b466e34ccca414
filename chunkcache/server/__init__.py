"""The OpenAI-compatible HTTP server (`chunkcache serve`).

Names are imported lazily: `server.app` pulls in the engine and torch, and a module that needs only
`server.cli`'s flags (the `chunkcache` command line parsing `route`) must not pay for that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chunkcache.server.app import build_app
    from chunkcache.server.cli import add_serve_arguments, run_serve

__all__ = ["add_serve_arguments", "build_app", "run_serve"]


def __getattr__(name: str) -> object:
    if name == "build_app":
        from chunkcache.server.app import build_app

        return build_app
    if name in ("add_serve_arguments", "run_serve"):
        from chunkcache.server import cli

        return getattr(cli, name)
    raise AttributeError(f"module 'chunkcache.server' has no attribute {name!r}")
