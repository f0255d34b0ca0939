"""The documents stay true to the repository: every path they name exists, no document states a
number the code can compute (test counts, line counts), and every MYCCL_* variable they name is
one the code knows.

The documents are README.md and docs/*.md. What counts as a path a document names:

* the target of a Markdown link `[text](target)`: relative to the document's folder; it must
  exist, and an `#anchor` into a Markdown file must be one of its headings (GitHub's slugs). Links out of the repository (a scheme such as `https:`) are
  refused: nothing in the project links outside it;
* an inline code span (outside fenced blocks) that is one token of path characters
  (letters, digits, `_ . - / * +`), once a `::test` suffix is dropped:
  - with a `/` and a first component that is a top-level entry of the repository (`src/...`,
    `docs/...`): relative to the repository root; `*` globs must match something;
  - with a `/` and another first component, ending in a known extension (`.py .cpp .hpp .md
    .sh .c .txt .toml .ini .png`): some path in the repository must end with it
    (`backend/Engines.cpp`), unless the first component is a tree outside the repository
    (`torch/`, `horovod/`, ...);
  - without a `/`, ending in a known extension: some file in the repository has that name;
  everything else (module names, `/dev/shm`, `bench_out/`, placeholders with `<...>`) is not a
  repository path;
* in fenced code blocks, every whitespace-separated token with a `/` whose first component is a
  top-level entry of the repository (the commands' scripts);
* in docs/DESIGN.md's "Layout" block, every entry: file and folder names at the start of a line
  (before the description column), nested by indentation, relative to the repository root.

docs/WHOLEMEMORY.md is left out of the path check for now: it is being rewritten elsewhere.

Source files (code, scripts, CI) that name a `docs/...` path must name one that exists too.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re

import pytest

from harness import ROOT

DOCS = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                              if f.endswith(".md"))
EXTENSIONS = (".py", ".cpp", ".hpp", ".md", ".sh", ".c", ".txt", ".toml", ".ini", ".png")
OUTSIDE_TREES = {"torch", "c10", "ATen", "horovod", "pylibwholegraph", "cpp", "python", "nccl", "cuda"}
IGNORED_DIRS = {".git", "build", "dist", "bench_out", "wheelhouse", "prebuilt", "__pycache__", ".pytest_cache"}


def _walk() -> list[str]:
    out = []
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if x not in IGNORED_DIRS and not x.startswith(".venv")
                   and not x.endswith(".egg-info") and not (d == ROOT and x.startswith(".") and x != ".ci")]
        rel = os.path.relpath(d, ROOT)
        for name in dirs + files:
            out.append(name if rel == "." else os.path.join(rel, name))
    return out


ALL_PATHS = _walk()
TOP = {p for p in ALL_PATHS if "/" not in p}
BASENAMES = {os.path.basename(p) for p in ALL_PATHS}


def _text(doc: str) -> str:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


def _split_fences(text: str) -> tuple[str, list[str]]:
    """The text outside fenced blocks (fences blanked, so line numbers stay), and the blocks."""
    prose, blocks, cur = [], [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if cur is None:
                cur = []
            else:
                blocks.append("\n".join(cur))
                cur = None
            prose.append("")
        elif cur is not None:
            cur.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def _anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        prose, _ = _split_fences(f.read())
    out = set()
    for h in re.findall(r"^#+\s+(.*)$", prose, re.M):
        slug = re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def _exists(rel: str) -> bool:
    if any(c in rel for c in "*?["):
        return bool(glob.glob(os.path.join(ROOT, rel)))
    return os.path.exists(os.path.join(ROOT, rel))


def _code_span_problem(tok: str) -> str | None:
    tok = tok.split("::", 1)[0]
    if not re.fullmatch(r"[A-Za-z0-9_.\-/*+]+", tok) or tok.startswith("/") or ".." in tok:
        return None
    if "/" in tok:
        first = tok.split("/", 1)[0]
        if first in TOP:
            return None if _exists(tok) else f"`{tok}` does not exist"
        if first in OUTSIDE_TREES or not tok.endswith(EXTENSIONS):
            return None
        suffix = "/" + tok.rstrip("/")
        if any(fnmatch.fnmatch("/" + p, "*" + suffix) for p in ALL_PATHS):
            return None
        return f"`{tok}` is the end of no path in the repository"
    if tok.endswith(EXTENSIONS) and not tok.startswith("."):
        if any(c in tok for c in "*?["):
            return None if any(fnmatch.fnmatch(b, tok) for b in BASENAMES) else f"`{tok}` matches no file"
        return None if tok in BASENAMES else f"no file in the repository is called `{tok}`"
    return None


def _expand(name: str) -> list[str]:
    """"Streams.cpp/.hpp" names two files."""
    stem, sep, ext = name.rpartition("/.")
    return [stem, stem.rsplit(".", 1)[0] + "." + ext] if sep and "/" not in ext else [name]


def _layout_entries(text: str) -> list[str]:
    """docs/DESIGN.md's layout block as paths. An entry line starts left of the description column
    (where the first line's description starts); its names end where two spaces begin its
    description, and lines indented to the description column continue it. Entries nest by
    indentation under a line that names one folder. In a folder's description, file names with a
    known extension are files of that folder; anywhere, a name with a `/` whose first component
    is a top-level entry is relative to the repository root."""
    m = re.search(r"^## Layout\n(.*?)^```\n(.*?)^```", text, re.S | re.M)
    assert m, "docs/DESIGN.md has no fenced block under '## Layout'"
    block = m.group(2).splitlines()
    col = re.search(r"\S\s{2,}(\S)", block[0]).start(1)
    entries: list[tuple[int, str, str]] = []  # (indent, names, description)
    for line in block:
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent >= col and entries:
            i, names, desc = entries[-1]
            entries[-1] = (i, names, desc + " " + line.strip())
            continue
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        head, desc = parts[0], (parts[1] if len(parts) > 1 else "")
        entries.append((indent, head, desc))
    parents: list[tuple[int, str]] = []  # (indent, folder)
    paths = []
    for indent, head, desc in entries:
        while parents and parents[-1][0] >= indent:
            parents.pop()
        base = parents[-1][1] if parents else ""
        names = [n.strip() for n in re.split(r",|;|\s\+\s", re.sub(r"\([^)]*\)?", "", head)) if n.strip()]
        names = [n for n in names if re.fullmatch(r"[A-Za-z0-9_.\-/]+", n)]
        for name in names:
            paths += [base + n for n in _expand(name)]
        folder = base + names[0] if len(names) == 1 and names[0].endswith("/") else None
        for tok in re.findall(r"[A-Za-z0-9_.\-/]+", desc):
            tok = tok.rstrip(".")
            if "/" in tok.rstrip("/") and tok.split("/", 1)[0] in TOP:
                paths.append(tok)
            elif folder and tok.endswith(EXTENSIONS) and "/" not in tok.replace("/.", ""):
                paths += [folder + n for n in _expand(tok)]
        if folder:
            parents.append((indent, folder))
    return paths


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_document_names_exists(doc):
    text = _text(doc)
    prose, blocks = _split_fences(text)
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            problems.append(f"link out of the repository: {target}")
            continue
        path, _, anchor = target.partition("#")
        full = os.path.join(ROOT, os.path.dirname(doc), path) if path else os.path.join(ROOT, doc)
        if not os.path.exists(full):
            problems.append(f"link to a missing file: {target}")
        elif anchor and full.endswith(".md") and anchor not in _anchors(full):
            problems.append(f"link to a missing heading: {target}")
    for span in re.findall(r"`([^`\n]+)`", prose):
        p = _code_span_problem(span.strip())
        if p:
            problems.append(p)
    for block in blocks:
        for tok in re.findall(r"[A-Za-z0-9_.\-/*]+", block):
            if "/" in tok and tok.split("/", 1)[0] in TOP and not _exists(tok.rstrip(".,;:")):
                problems.append(f"`{tok}` (in a code block) does not exist")
    if doc == "docs/DESIGN.md":
        problems += [f"layout: {p} does not exist" for p in _layout_entries(text) if not _exists(p)]
    assert not problems, f"{doc}:\n  " + "\n  ".join(sorted(set(problems)))


# A number the code can compute goes stale in prose: how many tests there are or passed, how long a
# file is. The size rule ("about 700 lines") is a limit, not a count.
COUNT = re.compile(r"(?<![\w.=])\d[\d,]*[ ]+(?:[A-Za-z-]+[ ]+)?(?:tests?|passed|skipped|lines)\b")
ALLOWED_COUNTS = {"700 lines"}


@pytest.mark.parametrize("doc", DOCS)
def test_no_document_states_a_test_or_line_count(doc):
    found = [m.group(0) for m in COUNT.finditer(_text(doc)) if m.group(0) not in ALLOWED_COUNTS]
    assert not found, f"{doc} states counts the code can compute: {found}"


def _known_variables() -> set[str]:
    from c10d_ext.config import VARS

    known = {v.name for v in VARS}
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:  # the build's own switches
        known |= set(re.findall(r"environ(?:\.get\(|\[)\s*\"(MYCCL_[A-Z0-9_]+)\"", f.read()))
    for p in ALL_PATHS:  # C++ macros (MYCCL_CONFIG_FIELDS)
        if p.startswith(("include/", "src/")) and p.endswith((".hpp", ".cpp")):
            with open(os.path.join(ROOT, p), encoding="utf-8") as f:
                known |= set(re.findall(r"#define\s+(MYCCL_[A-Z0-9_]+)", f.read()))
    return known


def test_every_variable_a_document_names_is_in_the_configuration_table():
    known = _known_variables()
    unknown = {}
    for doc in DOCS:
        for name in set(re.findall(r"\bMYCCL_[A-Z0-9_]*[A-Z0-9]\b", _text(doc))) - known:
            unknown.setdefault(name, []).append(doc)
    assert not unknown, f"MYCCL_* variables no code knows (not in c10d_ext/config.py's VARS): {unknown}"


def test_code_names_only_documents_that_exist():
    missing = []
    for p in ALL_PATHS:
        if not (p.endswith((".py", ".cpp", ".hpp", ".c", ".sh", ".toml")) or p in ("Makefile", ".ci/run")):
            continue
        if not os.path.isfile(os.path.join(ROOT, p)):
            continue
        with open(os.path.join(ROOT, p), encoding="utf-8", errors="replace") as f:
            for ref in set(re.findall(r"\bdocs/[A-Za-z0-9_./-]*[A-Za-z0-9_/]", f.read())):
                if not _exists(ref):
                    missing.append(f"{p}: {ref}")
    assert not missing, "files name documents that do not exist:\n  " + "\n  ".join(sorted(missing))


# The layout names every file of these folders, so a file added or moved shows here. A folder in
# WHOLE is described as a whole; a subpackage's __init__.py / __main__.py goes with its folder.
LAYOUT_COVERS = ("src/", "c10d_ext/", "scripts/", "benchmarks/", "examples/", "tests/cpp/")
WHOLE = ("src/cuda/double/",)


def test_the_layout_names_every_file():
    listed = {p.rstrip("/") for p in _layout_entries(_text("docs/DESIGN.md"))}
    missing = []
    for p in ALL_PATHS:
        if not p.startswith(LAYOUT_COVERS) or p.startswith(WHOLE) or not os.path.isfile(os.path.join(ROOT, p)):
            continue
        name = os.path.basename(p)
        if name.endswith((".so", ".pyc")) or (name in ("__init__.py", "__main__.py") and p != "c10d_ext/__init__.py"):
            continue
        if p not in listed:
            missing.append(p)
    assert not missing, "docs/DESIGN.md's layout does not name:\n  " + "\n  ".join(sorted(missing))
