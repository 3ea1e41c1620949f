"""The documents the code and the README point at exist, and the README's layout matches the tree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("mhc_cg", "megatron_integration") for p in (ROOT / d).rglob("*.py")]


def test_every_cited_document_exists():
    cited = {}
    for path in SOURCES + [ROOT / "README.md"]:
        for match in re.finditer(r"\b((?:docs|bench|profiles|configs)/[\w./-]+\.(?:md|yaml|sh|py))",
                                 path.read_text()):
            cited.setdefault(match.group(1), path.relative_to(ROOT))
    assert "docs/design.md" in cited
    missing = {doc: str(where) for doc, where in cited.items() if not (ROOT / doc).exists()}
    assert not missing, f"cited but missing: {missing}"


def test_no_project_history_in_code():
    pattern = re.compile(r"\bseeds? 00\d|\bissue \d+\b", re.IGNORECASE)
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in SOURCES
            for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits


def test_readme_layout_names_every_package():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    packages = [p.parent.name for p in (ROOT / "mhc_cg").rglob("*/__init__.py")]
    assert packages
    missing = [name for name in packages if f"{name}/" not in layout]
    assert not missing, f"README layout does not mention {missing}"
