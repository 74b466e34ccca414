"""The packages' import directions (docs/design.md, code map): chunk/ never reaches into the
engine, config into chunk/, and core/ (Sequence, KV blocks and slots) only into what is below
both; model/ stays beneath them all. Read from the source with ast, so a new import that breaks
a direction fails here before it grows into a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "chunkcache"


def _imports(path: Path, type_checking: bool) -> set[str]:
    """The chunkcache modules `path` imports; those under `if TYPE_CHECKING:` only if asked."""
    tree = ast.parse(path.read_text(), str(path))
    skipped: set[int] = set()
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(n) for child in node.body for n in ast.walk(child))
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "chunkcache" or n.startswith("chunkcache.")}


def _offending(folder: str, forbidden: tuple[str, ...], type_checking: bool) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / folder).rglob("*.py") if folder else [PACKAGE]):
        for name in _imports(path, type_checking):
            if name.startswith(forbidden):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return bad


@pytest.mark.parametrize(
    ("folder", "forbidden", "type_checking"),
    [
        # chunk/ is bookkeeping over core/: no engine, server or router, not even for a type.
        ("chunk", ("chunkcache.engine", "chunkcache.server", "chunkcache.router", "chunkcache.llm"), True),
        # core/ sits below chunk/ and engine/: it names their types in annotations only.
        ("core", ("chunkcache.chunk", "chunkcache.engine", "chunkcache.server", "chunkcache.router"), False),
        ("model", ("chunkcache.chunk", "chunkcache.engine", "chunkcache.core", "chunkcache.server"), True),
    ],
)
def test_package_import_directions(folder: str, forbidden: tuple[str, ...], type_checking: bool) -> None:
    assert _offending(folder, forbidden, type_checking) == []


def test_config_imports_no_package_above_it() -> None:
    names = _imports(PACKAGE / "config.py", type_checking=True)
    assert not {
        n for n in names if n.startswith(("chunkcache.chunk", "chunkcache.engine", "chunkcache.core"))
    }


def test_the_checker_sees_an_import() -> None:
    """The walk finds what it looks for (a test that could not fail would prove nothing)."""
    assert "chunkcache.core.sequence" in _imports(PACKAGE / "chunk" / "manager.py", type_checking=False)
    assert _offending("engine", ("chunkcache.chunk",), True) != []
