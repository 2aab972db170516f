"""The package's comments, docstrings and user-facing text cite docs/*.md or state the decision, never a spec section
or an issue number a user cannot look up."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "raycurate"
# "SPEC §4", "SPEC's", "issue #26", "issue 13", "(#25)", "RESULTS.md, #25)", "#26 item 3"
FORBIDDEN = re.compile(r"\bSPEC\b|\b[Ii]ssues? ?#?\d|\(#\d+\)|, #\d+\)|#\d+ item")


def test_forbidden_pattern_catches_each_form():
    for text in ("(SPEC §6)", "SPEC's N-scaled", "(issue #26)", "(issue 13, optional)", "order (#25).",
                 "(benchmarks/RESULTS.md, #25)", "until #26 item 3", "Issues #3"):
        assert FORBIDDEN.search(text), text
    for text in ("SPECIAL_TOKENS", "(docs/bilevel.md)", "#### 5", "color:#a12", "paper §4.2"):
        assert not FORBIDDEN.search(text), text


def test_no_spec_sections_or_issue_numbers_in_the_package():
    hits = [f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
            for path in sorted(PACKAGE.rglob("*")) if path.suffix in (".py", ".yaml", ".md", ".txt")
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if FORBIDDEN.search(line)]
    assert not hits, "cite docs/*.md (or state the decision) instead of:\n" + "\n".join(hits)


def test_no_spec_sections_or_issue_numbers_in_the_jobs_sweeps_docs_and_readme():
    root = PACKAGE.parent
    paths = [root / "README.md", *sorted((root / "jobs").glob("*.yaml")), *sorted((root / "tune").glob("*")),
             *sorted((root / "docs").glob("*.md"))]
    hits = [f"{path.relative_to(root)}:{number}: {line.strip()}" for path in paths if path.is_file()
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if FORBIDDEN.search(line)]
    assert not hits, "cite docs/*.md (or state the decision) instead of:\n" + "\n".join(hits)
