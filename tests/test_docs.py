"""The documents the code, the README and docs/ point at exist, and the README's layout matches
the tree."""

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
    # te_on_tape/ holds a stand-in with TransformerEngine's own package layout, not ours
    packages = [p.parent.name for p in (ROOT / "mhc_cg").rglob("*/__init__.py")
                if "te_on_tape" not in p.parent.parent.parts]
    assert packages
    missing = [name for name in packages if f"{name}/" not in layout]
    assert not missing, f"README layout does not mention {missing}"


# ---- the README and docs/ name only things that exist ------------------------------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGE_ROOTS = ("mhc_cg", "megatron_integration")
README_MAX_LINES = 250


def _named(pattern: str) -> dict[str, str]:
    """``{match: first document naming it}`` over the README and docs/*.md."""
    found: dict[str, str] = {}
    for doc in DOCS:
        for match in re.finditer(pattern, doc.read_text()):
            found.setdefault(match.group(1), str(doc.relative_to(ROOT)))
    return found


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md does not link {missing}"


def test_every_docs_page_starts_with_a_title_and_a_summary():
    for doc in DOCS[1:]:
        lines = [line for line in doc.read_text().splitlines() if line.strip()]
        assert lines[0].startswith("# "), f"{doc.name}: first line is not a title"
        assert not lines[1].startswith(("#", "```", "|", "-", "*")), f"{doc.name}: no summary line"


def test_every_module_path_named_exists():
    paths = _named(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/])" % "|".join(PACKAGE_ROOTS))
    assert paths
    missing = {path: doc for path, doc in paths.items() if not (ROOT / path).exists()}
    assert not missing, f"named but missing: {missing}"


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _defines(source: str, name: str) -> bool:
    """``name`` is a function, class, assignment, import or lazy export (``_EXPORTS``) of ``source``."""
    patterns = (rf"^\s*(?:async\s+)?def {name}\b", rf"^\s*class {name}\b", rf"^\s*{name}\s*[:=]",
                rf"^\s*(?:from\s+\S+\s+)?import\s[^\n]*\b{name}\b", rf'^\s*"{name}":\s*"')
    if any(re.search(p, source, re.MULTILINE) for p in patterns):
        return True
    # a name inside a parenthesised ``from x import (a, b)``
    return any(re.search(rf"\b{name}\b", block)
               for block in re.findall(r"^from\s+\S+\s+import\s+\(([^)]*)\)", source, re.MULTILINE))


def test_every_dotted_module_name_resolves():
    names = _named(r"(?<![\w./-])((?:%s)(?:\.\w+)+)" % "|".join(PACKAGE_ROOTS))
    assert names
    unresolved = {}
    for name, doc in names.items():
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            module = _module_file(parts[:k])
            if module is not None:
                break
        source = module.read_text() if module is not None else ""
        rest = [part for part in parts[k:] if not _defines(source, part)]
        if module is None or rest:
            unresolved[name] = doc
    assert not unresolved, f"dotted names that name no module or attribute: {unresolved}"


def test_every_mhc_cg_command_named_exists():
    from mhc_cg.cli import COMMANDS

    commands = _named(r"\bmhc-cg ([a-z][\w-]*)")
    assert commands
    unknown = {command: doc for command, doc in commands.items() if command not in COMMANDS}
    assert not unknown, f"not subcommands of mhc-cg ({sorted(COMMANDS)}): {unknown}"


def _expand(path: str) -> list[str]:
    """Glob patterns for a named path: ``{a,b}`` expanded, ``<placeholder>`` and ``*`` as ``*``."""
    path = re.sub(r"<[^>]*>", "*", path)
    brace = re.search(r"\{([^}]*)\}", path)
    if brace is None:
        return [path]
    return [p for option in brace.group(1).split(",")
            for p in _expand(path[:brace.start()] + option + path[brace.end():])]


def test_every_repository_file_named_exists():
    paths = _named(r"(?<![\w./-])((?:configs|docs|bench|profiles|tests)/[\w./<>{},*-]*[\w/}>*])")
    assert paths
    missing = {}
    for path, doc in paths.items():
        for pattern in _expand(path):
            if not (list(ROOT.glob(pattern)) if "*" in pattern else (ROOT / pattern).exists()):
                missing[pattern] = doc
    assert not missing, f"named but missing: {missing}"


def test_every_relative_link_resolves():
    missing = {}
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not re.match(r"\w+://", target) and not (doc.parent / target).exists():
                missing[target] = str(doc.relative_to(ROOT))
    assert not missing, f"links to missing files: {missing}"


# ---- the figures the README and docs/ quote are the commands' output -----------------------------

def test_generated_blocks_are_what_the_commands_make_now():
    """README's modelled and measured tables, and docs/cost.md's costed output, frontier and
    back-test, equal what ``python -m mhc_cg.cost.doc_tables write`` makes at this code (run it
    after a change that moves a figure)."""
    from mhc_cg.cost import doc_tables

    reports = doc_tables.Reports()
    readme = (ROOT / "README.md").read_text()
    assert {"modelled", "measured"} <= set(doc_tables.blocks_of(readme))
    for doc in doc_tables.DOCS:
        text = doc.read_text()
        made = doc_tables.blocks_of(doc_tables.regenerate(text, reports))
        stale = [key for key, body in doc_tables.blocks_of(text).items() if made[key] != body]
        assert not stale, f"{doc.relative_to(ROOT)}: stale {stale}; python -m mhc_cg.cost.doc_tables write"
    # the step is a band until the fused kernels are measured at this code, then one figure
    row = next(line for line in doc_tables.blocks_of(readme)["modelled"].splitlines()
               if line.startswith("| `eager_none`"))
    step = row.split("|")[4].strip()
    banded = not reports(doc_tables.BENCH)["gpu"]["one_figure"]
    assert re.fullmatch(r"[\d.]+-[\d.]+ ms" if banded else r"[\d.]+ ms", step), step
