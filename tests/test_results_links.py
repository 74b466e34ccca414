"""benchmarks/RESULTS.md's references hold (issue 59 moved its older runs to the history): its
index's links resolve to its sections, every section a *History:* line quotes is found in
benchmarks/history/RESULTS-narrative.md, and every `RESULTS.md "section"` the code and the docs
cite is a section of RESULTS.md. (Links from the README and docs/: tests/test_docs.py.)"""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_docs import _anchors

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
HISTORY = ROOT / "benchmarks" / "history" / "RESULTS-narrative.md"
# `RESULTS.md "bench_x"`, `RESULTS.md, "bench_x"`, `RESULTS.md` "bench_x": the first name quoted.
CITATION = re.compile(r'RESULTS\.md`?,? "([^"]+)"')


def test_the_index_and_links_of_results_resolve() -> None:
    text = RESULTS.read_text()
    links = re.findall(r"\]\(([^)\s]*)\)", text)
    assert len(links) > 30
    for target in links:
        path, _, anchor = target.partition("#")
        file = (RESULTS.parent / path).resolve() if path else RESULTS
        assert file.exists(), target
        if anchor:
            assert anchor in _anchors(file.read_text()), target


def _history_names() -> list[str]:
    """The quoted names in RESULTS.md's *History:* bullets (a bullet's wrapped lines joined)."""
    names = []
    for bullet in re.findall(r"^- \*History:\*(.*(?:\n  .*)*)", RESULTS.read_text(), re.M):
        names += re.findall(r'"([^"]+)"', " ".join(bullet.split()))
    return names


def test_history_lines_name_sections_that_exist() -> None:
    names = _history_names()
    assert len(names) > 30
    history = " ".join(HISTORY.read_text().split())
    missing = []
    for name in names:  # "A ... B": A, then B
        pattern = ".*?".join(re.escape(part.strip()) for part in name.split("..."))
        if not re.search(pattern, history):
            missing.append(name)
    assert missing == []


def test_the_sections_the_code_and_docs_cite_exist() -> None:
    headings = set(re.findall(r"^#{2,3} (.+?)\s*$", RESULTS.read_text(), re.M))
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "chunkcache").rglob("*.py")]
    files += [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tests").glob("*.py"), ROOT / "pyproject.toml"]
    cited = {
        (path.relative_to(ROOT).as_posix(), name)
        for path in files
        if path != Path(__file__).resolve()
        for name in CITATION.findall(" ".join(path.read_text().split()).replace("# ", ""))
    }
    assert len(cited) > 20
    assert sorted((path, name) for path, name in cited if name not in headings) == []
