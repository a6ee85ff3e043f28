"""Every relative link in docs/ and bench/ Markdown names a file of the repo, and no doc names the
retired docs/DESIGN.md (its content lives in docs/ARCHITECTURE.md and the topic docs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("bench/**/*.md")])
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file(doc: Path):
    text = doc.read_text(encoding="utf-8")
    missing = [t for t in LINK.findall(text) if "://" not in t and not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to {missing}, which are not in the repo"


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_points_at_the_retired_design_doc(doc: Path):
    assert "docs/DESIGN.md" not in doc.read_text(encoding="utf-8").replace("a7b3055:docs/DESIGN.md", "")
