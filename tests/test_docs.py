"""The documentation's links resolve in a clone: every relative link in README.md and docs/ names a
file of the repository (and a heading of it, where it gives an anchor), and nothing points outside
the repository, as the old `../shared/DESIGN.md` did."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a file's headings: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", _FENCE.sub("", markdown), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    text = _FENCE.sub("", doc.read_text())
    for target in _LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.is_relative_to(ROOT), f"{doc.name}: {target} points outside the repository"
        assert file.exists(), f"{doc.name}: {target} does not exist"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file.read_text()), f"{doc.name}: no heading for #{anchor} in {path}"


def test_nothing_refers_to_the_shared_folder() -> None:
    suffixes = {".py", ".md", ".toml", ".sh", ".txt", ".cfg"}
    offenders = [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*")
        if p.suffix in suffixes
        and ".git" not in p.parts
        and ".venv" not in p.parts
        and p != Path(__file__).resolve()
        and ("../shared" in (text := p.read_text(errors="replace")) or "DESIGN.md" in text)
    ]
    assert not offenders, f"references to the design outside the repository: {offenders}"


def test_the_options_page_is_generated_from_the_config() -> None:
    from chunkcache.engine_args import options_markdown

    assert (ROOT / "docs" / "options.md").read_text() == options_markdown(), (
        "docs/options.md is stale: run `python -m chunkcache.engine_args > docs/options.md`"
    )
