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


# ---- every Note [name] is one search away ------------------------------------------------------

# a note's name may hold one level of brackets: Note [x[mask] = scalar is a masked fill]
NOTE = re.compile(r"Note \[((?:[^\[\]\n]|\[[^\[\]\n]*\])+)\]")
# ``Note`` at a line's end (a string or comment broken there), its ``[`` on the next line
NOTE_BROKEN_BEFORE_NAME = re.compile(r"\bNote[\"']?[ \t]*\n[ \t]*(?:#[ \t]*|[\"'])?\[")


def split_notes(text: str) -> list[int]:
    """The lines of ``text`` where a note's name is not on one line with its ``Note [``."""
    lines = [n for n, line in enumerate(text.splitlines(), 1)
             for m in re.finditer(r"Note \[", line) if not NOTE.match(line, m.start())]
    return lines + [text.count("\n", 0, m.start()) + 1
                    for m in NOTE_BROKEN_BEFORE_NAME.finditer(text)]


def test_every_note_name_sits_on_one_line():
    """``git grep "Note \\[name\\]"`` finds every place a note is kept or cited: no name is broken
    across lines (or across a string break) in the code or the docs."""
    split = [f"{path.relative_to(ROOT)}:{n}" for path in SOURCES + DOCS
             for n in split_notes(path.read_text())]
    assert not split, f"note names broken across lines: {split}"


def test_the_split_note_check_sees_a_broken_name():
    samples = {
        "one line": "x = 1  # Note [x[mask] = scalar is a masked fill], then more\n",
        "inside the name": '"""Note [the step is a band until the\n    kernels are measured]."""\n',
        "at a string break": '("add (Note [grads accumulated inside "\n "the graph])")\n',
        "after Note": '"""captured (Note\n    [recompute graphs in the sublayer pool])."""\n',
        "after Note, a comment": "# see Note\n# [forward scratch]\n"}
    assert {label: split_notes(text) for label, text in samples.items()} == {
        "one line": [], "inside the name": [1], "at a string break": [1], "after Note": [1],
        "after Note, a comment": [1]}


def test_every_note_in_the_code_is_cited_by_a_doc():
    """Each ``Note [name]`` the code keeps or cites is named in README.md or a page of docs/
    (as ``[name]``, line breaks read as spaces), so a reader of the docs can find it."""
    names = {}
    for path in SOURCES:
        for name in NOTE.findall(path.read_text()):
            names.setdefault(name, str(path.relative_to(ROOT)))
    assert "one concept, one home" in names
    docs = " ".join(re.sub(r"\s+", " ", doc.read_text()) for doc in DOCS)
    uncited = {name: where for name, where in names.items() if f"[{name}]" not in docs}
    assert not uncited, f"notes no doc cites: {uncited}"


# ---- the figures the README and docs/ quote are the commands' output -----------------------------

def test_generated_blocks_are_what_the_commands_make_now():
    """README's modelled and measured tables, and docs/cost.md's costed output, frontier and
    back-test, equal what ``python -m mhc_cg.lab.cost.doc_tables write`` makes at this code (run it
    after a change that moves a figure)."""
    from mhc_cg.lab.cost import doc_tables

    reports = doc_tables.Reports()
    readme = (ROOT / "README.md").read_text()
    assert {"modelled", "measured"} <= set(doc_tables.blocks_of(readme))
    for doc in doc_tables.DOCS:
        text = doc.read_text()
        made = doc_tables.blocks_of(doc_tables.regenerate(text, reports))
        stale = [key for key, body in doc_tables.blocks_of(text).items() if made[key] != body]
        assert not stale, f"{doc.relative_to(ROOT)}: stale {stale}; python -m mhc_cg.lab.cost.doc_tables write"
    # the step is a band until the fused kernels are measured at this code, then one figure
    row = next(line for line in doc_tables.blocks_of(readme)["modelled"].splitlines()
               if line.startswith("| `eager_none`"))
    step = row.split("|")[4].strip()
    banded = not reports(doc_tables.BENCH)["gpu"]["one_figure"]
    assert re.fullmatch(r"[\d.]+-[\d.]+ ms" if banded else r"[\d.]+ ms", step), step


# ---- the first screen, and the outputs the docs quote ---------------------------------------------

README_FIRST_SCREEN_LINES = 40


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _columns(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def _quoted(text: str, command: str) -> list[str]:
    """The lines a fenced block quotes after ``$ command``."""
    lines = text.splitlines()
    start = lines.index(f"$ {command}") + 1
    return lines[start:lines.index("```", start)]


def test_readme_opens_with_the_two_commands():
    lines = _readme().splitlines()
    at = lines.index("## Two commands") + 1
    assert at <= README_FIRST_SCREEN_LINES, f"'## Two commands' at line {at}"
    block = lines[at:lines.index("```", lines.index("```bash", at) + 1)]
    assert any(line.startswith("make demo") for line in block)
    assert any(line.startswith("make test") for line in block)


def test_readme_quotes_the_table_make_demo_prints():
    """The README's excerpt of ``make demo``: the header ``mhc-cg train --compare`` prints on the
    CPU, and rows (mode, losses, verdict) as docs/configuration.md quotes the whole run."""
    from mhc_cg.lab.compare.modes import format_table

    header = _columns(format_table({}, cpu=True).splitlines()[0])
    lines = _readme().splitlines()
    at = next(n for n, line in enumerate(lines) if _columns(line) == header)
    rows = [_columns(line)[:3] for line in lines[at + 2:lines.index("```", at)]]
    assert rows and all(row[2] in ("(reference)", "bit-identical") for row in rows)
    whole = _quoted((ROOT / "docs" / "configuration.md").read_text(),
                    "mhc-cg train --config configs/tiny_cpu.yaml --compare")
    assert _columns(whole[1]) == header
    assert all(row in [_columns(line)[:3] for line in whole] for row in rows), rows


def test_readme_states_modelled_figures_only_in_its_generated_blocks():
    from mhc_cg.lab.cost import doc_tables

    prose = doc_tables.BLOCK.sub("", _readme())
    figures = re.findall(r"\d[\d.]*\s?(?:ms|GiB|TB/s|TFLOP/s|%)", prose)
    assert not figures, f"README figures outside generated blocks: {figures}"


def test_pipeline_doc_quotes_what_the_pipeline_compare_prints():
    """docs/pipeline.md's run: the step table's header and the verdict as the code prints them,
    every step equal."""
    from types import SimpleNamespace

    from mhc_cg.lab.compare import pipeline

    quoted = _quoted((ROOT / "docs" / "pipeline.md").read_text(),
                     "mhc-cg train --config configs/tiny_pp2_vpp2.yaml --compare")
    run = SimpleNamespace(losses=[1.0], grad_norms=[1.0])
    header = _columns(pipeline.format_steps(run, run).splitlines()[0])
    at = next(n for n, line in enumerate(quoted) if _columns(line) == header)
    steps = [_columns(line) for line in quoted[at + 2:] if line[:1].isdigit()]
    assert steps and all(step[-1] == "yes" for step in steps)
    verdict = (f"per-step losses equal to pp_size 1 bit for bit, grad norms within "
               f"{pipeline.NORM_RTOL:g}: yes")
    assert quoted[-1] == verdict


def test_pipeline_doc_quotes_the_schedule_sweep_as_it_prints_now(capsys):
    import runpy

    runpy.run_path(str(ROOT / "profiles" / "schedule" / "sweep_microbatches.py"), run_name="__main__")
    printed = capsys.readouterr().out.splitlines()
    assert _quoted((ROOT / "docs" / "pipeline.md").read_text(),
                   "python profiles/schedule/sweep_microbatches.py") == printed


# ---- what to set in Megatron: said once (docs/megatron.md), the configs' comments agree ----------

_SETTING_FIELDS = ("mhc_num_residual_streams", "num_residual_streams", "mhc_recompute_layer_num",
                   "recompute_granularity", "recompute_modules", "cuda_graph_impl",
                   "cuda_graph_modules")


def _comment_setting(path: Path) -> tuple[dict, set[str], bool]:
    """``({field: value}, fields said absent, recompute_graphs)`` from a config's comment
    ``In X's TransformerConfig (...): a, b: v, no c, ...; and make_te_graph_helper(...)``."""
    import yaml

    comment = " ".join(line.lstrip("# ").rstrip() for line in path.read_text().splitlines()
                       if line.startswith("#"))
    body = comment[comment.index("TransformerConfig (docs/megatron.md"):]
    body, rest = body[body.index("):") + 2:].split("; and ", 1)
    fields, absent = {}, set()
    for item in (part.strip() for part in body.split(", ")):
        if item.startswith("no "):
            absent.add(item[3:])
        elif ":" in item:
            name, value = item.split(":", 1)
            fields[name] = yaml.safe_load(value)
        else:
            fields[item] = True
    return fields, absent, rest.startswith("make_te_graph_helper(..., recompute_graphs=True)")


def test_megatron_configs_comments_state_the_setting_the_runs_use():
    from megatron_integration.config.field_map import megatron_config_kwargs
    from mhc_cg.config import load_config
    from mhc_cg.lab.megatron_harness.runs import OURS, run_kwargs

    doc = (ROOT / "docs" / "megatron.md").read_text()
    what_to_set = doc[doc.index("## What to set"):doc.index("\n## ", doc.index("## What to set") + 1)]
    for name, branch in (("megatron_main_mhc.yaml", "main"), ("megatron_dev_tp2_pp2.yaml", "dev")):
        path = ROOT / "configs" / name
        kwargs, recompute_graphs = megatron_config_kwargs(load_config(str(path)), branch)
        kwargs = run_kwargs(kwargs, OURS, branch)
        fields, absent, helper_call = _comment_setting(path)
        assert {k: kwargs.get(k) for k in fields} == fields, name
        assert not absent & set(kwargs), name
        assert recompute_graphs and helper_call, name
        for field in set(fields) & set(_SETTING_FIELDS):
            value = fields[field]
            said = f"[{', '.join(value)}]" if isinstance(value, list) else str(value)
            assert f"`{field}: {said}`" in what_to_set, (name, field)
    assert "on by default (`mhc_te_graph_helper`, `make_te_graph_helper`" in what_to_set
    readme = _readme()
    assert "docs/megatron.md#what-to-set" in readme and "recompute_modules:" not in readme
