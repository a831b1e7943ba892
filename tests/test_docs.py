"""The docs stay true to the tree: every link on a docs/ page (and README.md) resolves to a file of the
repository and, for a Markdown target with ``#anchor``, to one of its headings; every page is in the index;
and no source file cites the design file that lives outside the repository (docs/ is the reference).

Links are Markdown ``[text](target)`` outside code blocks and inline code; web links are not followed.
Anchors are GitHub's heading slugs (lower case, punctuation dropped, spaces to hyphens, ``-1``… for repeats).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")
# Where code and build files live; none of them may point readers at the out-of-repo design file.
CITING_DIRS = ("stage_runtime", "operator", "e2e", "tests", "bench", "docs")
CITING_FILES = ("README.md", "Makefile", "pyproject.toml")
DESIGN_FILE = "DESIGN" + ".md"          # spelled apart so this file does not cite it


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code removed."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, INLINE_CODE.sub("", line)))
    return out


def slug(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)       # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = page.read_text(encoding="utf-8")
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match[2])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Every link on ``page`` whose file or anchor does not exist, as ``page:line target (why)``."""
    problems = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if target.startswith(EXTERNAL):
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(root)}:{number} {target}"
            if not dest.is_relative_to(root.resolve()):
                problems.append(f"{where} (points outside the repository)")
            elif not dest.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(root.resolve())})")
    return problems


def design_citations(root: Path = ROOT) -> list[str]:
    files = [root / name for name in CITING_FILES if (root / name).is_file()]
    for folder in CITING_DIRS:
        files += [p for p in sorted((root / folder).rglob("*")) if p.is_file() and p.suffix in (".py", ".md", ".yaml",
                                                                                              ".toml", ".lua", ".txt")]
    out = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if DESIGN_FILE in line:
                out.append(f"{path.relative_to(root)}:{number}: {line.strip()[:120]}")
    return out


def test_the_docs_exist_and_the_index_lists_every_page():
    assert (DOCS / "README.md").is_file()
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    linked = {t.partition("#")[0] for _, line in prose_lines(index) for t in LINK.findall(line)}
    missing = [p.name for p in DOCS.glob("*.md") if p.name != "README.md" and p.name not in linked]
    assert missing == [], f"docs/README.md does not list: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    assert broken_links(page) == []


def test_no_code_cites_the_out_of_repo_design_file():
    assert design_citations() == [], "cite the docs/ page instead"


def test_a_broken_link_and_a_design_citation_are_named(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# Title\n\n## The `serve` step\n\nsee [b](b.md), [here](#the-serve-step),\n"
                               "[gone](missing.md), [bad](#nope), [c](../c.py) and `[code](x.md)`\n"
                               "```\n[fenced](fenced.md)\n```\n[web](https://example.com)\n")
    (docs / "b.md").write_text("# B\n")
    (tmp_path / "stage_runtime").mkdir()
    (tmp_path / "stage_runtime" / "x.py").write_text(f'"""see {DESIGN_FILE} §3"""\n')
    assert broken_links(docs / "a.md", tmp_path) == [
        "docs/a.md:6 missing.md (no such file)",
        "docs/a.md:6 #nope (no heading with anchor #nope in docs/a.md)",
        "docs/a.md:6 ../c.py (no such file)",
    ]
    assert design_citations(tmp_path) == [f'stage_runtime/x.py:1: """see {DESIGN_FILE} §3"""']


def test_slugs_follow_github():
    assert slug("`serve`: the lifecycle") == "serve-the-lifecycle"
    assert slug("Exit codes and the termination message") == "exit-codes-and-the-termination-message"
    assert slug("Fail-closed restarts") == "fail-closed-restarts"
    page_anchors = anchors(DOCS / "architecture.md")
    assert {"the-control-loop", "the-layers", "parallel-topology"} <= page_anchors


def _table_fields(page: str, heading: str) -> set[str]:
    """The first column's backticked names in the table under ``heading``."""
    text = (DOCS / page).read_text()
    section = text[text.index(heading):]
    section = section[:section.index("\n#", len(heading))] if "\n#" in section[len(heading):] else section
    return {name for line in section.splitlines() if line.startswith("| `")
            for name in re.findall(r"`([a-z_]+)`", line.split("|")[1])}


def test_every_generation_field_is_in_the_http_table():
    """'Any other field is a 400', so the table must name every field the body accepts."""
    from stage_runtime.serve.schemas import ImageGenerationRequest

    documented = _table_fields("http-api.md", "### `POST /v1/images/generations`")
    assert set(ImageGenerationRequest.model_fields) - documented == set()
