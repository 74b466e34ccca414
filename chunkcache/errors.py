"""Errors a client can cause, and how a command line reports them. Each message names the offending
value; the engine keeps serving."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


class InvalidRequestError(ValueError):
    """A request the engine will not run (HTTP 400). `param` names the request field to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt, or prompt plus max_tokens, exceeds max_model_len (HTTP 400
    `context_length_exceeded`, as OpenAI and vLLM answer it; 413 is a body over the size cap)."""


class ModelLoadError(ValueError):
    """A checkpoint the engine cannot load: unknown architecture, unsupported feature, missing tensor."""


class KernelsUnavailableError(RuntimeError):
    """`require_kernels` and the C kernels cannot be built or loaded (model/kernels/build.py): the engine
    refuses to start rather than serve slower than what was measured."""


class UsageError(Exception):
    """A mistake on the command line: a bad option value, a missing file, an unknown name.

    The command prints it on one line and exits 2, as argparse does for a malformed flag."""


# Exceptions a command line run reports as the user's mistake (one line, exit 2) instead of a
# traceback: what was asked for does not exist or was refused. Anything else is a bug and keeps
# its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    UsageError,
    ModelLoadError,
    KernelsUnavailableError,
    InvalidRequestError,
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


def add_debug_argument(parser: argparse.ArgumentParser, sub_command: bool = False) -> None:
    """`--debug`: show the traceback of a user error. On a sub-command it defaults to SUPPRESS, so
    that `chunkcache --debug serve` and `chunkcache serve --debug` both work."""
    parser.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS if sub_command else False,
        help="show the full traceback of an error instead of one line",
    )


def run_command(prog: str, run: Callable[[], int | None], debug: bool) -> int:
    """`run()`'s exit status; a user error becomes `prog: error: message` and status 2."""
    try:
        return int(run() or 0)
    except USER_ERRORS as e:
        if debug:
            raise
        message = str(e) if not isinstance(e, OSError) or not e.filename else f"{e.strerror}: {e.filename}"
        print(f"{prog}: error: {' '.join(message.splitlines())}", file=sys.stderr)
        return 2
