"""The docs stay true to the tree: every link on a docs/ page (and README.md) resolves to a file of the
repository and, for a Markdown target with ``#anchor``, to one of its headings; every page is in the index;
and no source file cites the design file that lives outside the repository (docs/ is the reference).

Links are Markdown ``[text](target)`` outside code blocks and inline code; web links are not followed.
Anchors are GitHub's heading slugs (lower case, punctuation dropped, spaces to hyphens, ``-1``… for repeats).

Every repository path the pages mention exists too, and every ``path.py:Symbol`` names a module-level name or
a ``Class.member`` of that file (read with ``ast``; ``path:12`` a line it has). A mention is a word of inline
code that ends in a source or doc suffix (``.py``, ``.md``, ``.lua``, ``.toml``) or holds a ``/`` after a
folder of the tree, or, in a code block, such a ``folder/…`` word (``.yaml`` too: the samples) or a
``name.py:Symbol`` (the diagrams). Every ``make TARGET`` in code is a target of the Makefile. A short form is
tried from the page's folder, the repository root, then ``stage_runtime/``, ``operator/stage_operator/``,
``e2e/`` and ``tests/`` (so ``models/families/sd.py``, ``builders/pod.py``, ``local/demo.py`` resolve); ``{a,b}`` is
expanded and ``*`` globbed. Words with a placeholder (``<kind>``, ``…``, ``$VAR``), absolute or hidden paths
(``/dev/shm``, ``.cluster/logs``) and words whose first folder is no folder of the tree (``diffstage.io/stage``,
``nvidia.com/gpu``) are not paths of the repository.
"""

from __future__ import annotations

import ast
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
# Where a short path may start (after the page's own folder), and what a mention looks like.
SEARCH = ("", "stage_runtime", "operator/stage_operator", "e2e", "tests")
SUFFIXES = (".py", ".md", ".lua", ".toml")
SPAN = re.compile(r"`([^`]+)`")
FENCED_PATH = re.compile(r"(?<![\w./<$-])(?:(?:[\w-]+/)+[\w.-]+\.(?:py|md|yaml|lua|toml)(?::[\w.-]*\w)?|[\w-]+\.py:\w[\w.]*\w)")
MAKE = re.compile(r"(?<![\w-])make ([a-z][\w-]*)")
NOT_A_REPO_PATH = re.compile(r"[<>…$%=@~]|\.\.\.|://|^[/.-]")
LINES = re.compile(r"\d+(?:-\d+)?")


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


def expand(word: str) -> list[str]:
    """The shell's brace expansion: ``test_{a,b}.py`` is ``test_a.py`` and ``test_b.py``."""
    match = re.search(r"\{([^{}]*)\}", word)
    if not match:
        return [word]
    return [w for part in match[1].split(",") for w in expand(word[:match.start()] + part + word[match.end():])]


def is_mention(word: str, root: Path) -> bool:
    """A word of inline code that names a path of the repository (the rule of this module's docstring)."""
    path = word.partition(":")[0]
    if not path or NOT_A_REPO_PATH.search(path):
        return False
    if path.endswith(SUFFIXES):
        return True
    first = path.split("/")[0]
    return "/" in path and any((root / base / part).is_dir() for base in SEARCH for part in expand(first))


def mentions(text: str, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line number, word) for every repository path ``text`` mentions, in inline code and in code blocks."""
    out, fenced, prose = [], False, []
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            line = ""
        elif fenced:
            out += [(number, word) for word in FENCED_PATH.findall(line) if is_mention(word, root)]
            line = ""
        prose.append(line)
    joined = "\n".join(prose)                      # inline code may wrap onto the next line
    for span in SPAN.finditer(joined):
        number = joined.count("\n", 0, span.start()) + 1
        words = (w.strip("'\"()[],;").rstrip(".:") for w in span[1].split())
        out += [(number, word) for word in words if is_mention(word, root)]
    return sorted(out, key=lambda mention: mention[0])


def defined(body: list[ast.stmt]) -> dict[str, list[ast.stmt]]:
    """The names a module or class body defines (a class's own body, for its members), also under if/try."""
    names: dict[str, list[ast.stmt]] = {}
    for node in body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = node.body
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = []
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({n.id: [] for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: [] for a in node.names})
        elif isinstance(node, (ast.If, ast.Try)):
            for part in (node.body, node.orelse, getattr(node, "finalbody", []),
                         *(h.body for h in getattr(node, "handlers", []))):
                names.update(defined(part))
    return names


def symbol_problem(file: Path, symbol: str, root: Path) -> str | None:
    where = file.relative_to(root)
    if LINES.fullmatch(symbol):
        count = len(file.read_text(encoding="utf-8").splitlines())
        return None if int(symbol.split("-")[-1]) <= count else f"{where} has {count} lines"
    if file.suffix != ".py":
        return f"only a line number can follow {where}"
    body = ast.parse(file.read_text(encoding="utf-8")).body
    for part in symbol.split("."):
        names = defined(body)
        if part not in names:
            return f"no {symbol} in {where}"
        body = names[part]
    return None


def stale(word: str, page: Path, root: Path) -> str | None:
    """Why ``word`` (a path, maybe with ``:Symbol``) does not hold, or None."""
    path, _, symbol = word.partition(":")
    bases = [page.parent] + [root / base for base in SEARCH]
    for one in expand(path):
        found = [hit for base in bases for hit in (sorted(base.glob(one)) if "*" in one else [base / one])
                 if hit.exists()]
        if not found:
            return "no such file or folder"
        if symbol and (why := symbol_problem(found[0], symbol, root)):
            return why
    return None


def stale_paths(page: Path, root: Path = ROOT) -> list[str]:
    """Every repository path or ``path.py:Symbol`` on ``page`` that does not exist, as ``page:line word (why)``."""
    return [f"{page.relative_to(root)}:{number} {word} ({why})"
            for number, word in mentions(page.read_text(encoding="utf-8"), root)
            if (why := stale(word, page, root))]


def unknown_make_targets(page: Path, root: Path = ROOT) -> list[str]:
    """Every ``make TARGET`` in the code of ``page`` (inline or a block) that the Makefile does not define."""
    targets = set(re.findall(r"^([\w-]+):", (root / "Makefile").read_text(encoding="utf-8"), re.M))
    blocks, fenced, prose = [], False, []
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        else:
            (blocks if fenced else prose).append(line.partition("#")[0] if fenced else line)   # not comments
    code = blocks + SPAN.findall("\n".join(prose))
    return sorted({f"{page.relative_to(root)}: make {name}" for chunk in code for name in MAKE.findall(chunk)
                   if name not in targets})


def test_the_docs_exist_and_the_index_lists_every_page():
    assert (DOCS / "README.md").is_file()
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    linked = {t.partition("#")[0] for _, line in prose_lines(index) for t in LINK.findall(line)}
    missing = [p.name for p in DOCS.glob("*.md") if p.name != "README.md" and p.name not in linked]
    assert missing == [], f"docs/README.md does not list: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_symbol_mentioned_exists(page):
    assert stale_paths(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_make_target_mentioned_exists(page):
    assert unknown_make_targets(page) == []


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


def test_a_stale_path_or_symbol_is_named_and_other_words_are_not_paths(tmp_path):
    (tmp_path / "stage_runtime" / "engine").mkdir(parents=True)
    (tmp_path / "stage_runtime" / "engine" / "engine.py").write_text(
        "import os\nLIMIT: int = 3\n\n\nclass DiffusionEngine:\n    def add_request(self): ...\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "a.md"
    page.write_text("# A\n\n`engine/engine.py:DiffusionEngine.add_request`, `stage_runtime/engine/engine.py:LIMIT`,\n"
                    "`engine/engine.py:6`, `engine/engine.py:9`, `engine/gone.py`, `engine/engine.py:DiffusionEngine.step`,\n"
                    "`stage_runtime/sched/`, `tests/test_{a,b}.py`, `tests/test_*.py`, `a.md`, `docs/a.md:Title`,\n"
                    "not paths: `diffstage.io/stage`, `/dev/shm`, `stage.yaml`, `.cluster/logs`, `models/<kind>.py`,\n"
                    "`kubectl apply -f engine/x.yaml` and a wrapped `stage_runtime/\nengine/old.py`\n"
                    "```\nserve/app.py → engine/engine.py:DiffusionEngine.add_request, /usr/lib/x/y.py, engine.py:go.\n"
                    "make demo; kubectl apply -f tests/gone.yaml -f $PWD/x/y.yaml  # make sense of it\n```\n"
                    "`make nope`, `make test`, and to make sense of it all\n")
    (tmp_path / "Makefile").write_text("demo: venv\n\tpython -m demo\ntest:\n")
    assert stale_paths(page, tmp_path) == [
        "docs/a.md:4 engine/engine.py:9 (stage_runtime/engine/engine.py has 6 lines)",
        "docs/a.md:4 engine/gone.py (no such file or folder)",
        "docs/a.md:4 engine/engine.py:DiffusionEngine.step (no DiffusionEngine.step in stage_runtime/engine/engine.py)",
        "docs/a.md:5 stage_runtime/sched/ (no such file or folder)",
        "docs/a.md:5 tests/test_{a,b}.py (no such file or folder)",
        "docs/a.md:5 docs/a.md:Title (only a line number can follow docs/a.md)",
        "docs/a.md:7 engine/x.yaml (no such file or folder)",
        "docs/a.md:7 engine/old.py (no such file or folder)",
        "docs/a.md:10 serve/app.py (no such file or folder)",
        "docs/a.md:10 engine.py:go (no such file or folder)",
        "docs/a.md:11 tests/gone.yaml (no such file or folder)",
    ]
    assert unknown_make_targets(page, tmp_path) == ["docs/a.md: make nope"]


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
