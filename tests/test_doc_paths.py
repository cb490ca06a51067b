"""Every file path the documentation names exists: the README, docs/, ARCHITECTURE.md and the
source (docstrings and comments of src/, tests/, scripts/, benchmarks/, examples/) send readers
to files by path, and a path left behind by a move sends them nowhere.

A path counts as found when it names a file relative to the repository root (or, in a
Markdown page, relative to the page), or is the tail
of one at a folder boundary (``tracing/trace.py`` for ``src/convbn/passes/tracing/trace.py``, as
ARCHITECTURE.md writes paths inside ``passes/``); ``*`` matches as in a shell glob.
BENCHMARKS.md is a dated record of runs (it names the files of its day) and is not checked."""
from __future__ import annotations

import fnmatch
import importlib.util
import re
from pathlib import Path
from typing import Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "site", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis"}
PATH = re.compile(r"(?<![\w./*-])((?:[\w.*-]+/)+[\w.*-]+\.(?:py|md|sh|png|toml|txt|yml|yaml|json|cfg))(?![\w/])")


def _files() -> List[str]:
    out = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if p.is_file() and not SKIP_DIRS.intersection(rel.parts) and not any(s.endswith(".egg-info") for s in rel.parts):
            out.append(rel.as_posix())
    return out


#: the checks themselves, whose examples name stale paths on purpose, and tests that name the
#: files they write into a temporary folder
CHECKS = {"tests/test_doc_paths.py", "tests/test_docs.py", "tests/test_cli_errors.py"}
#: a placeholder in an example (``path/to/file.py:build``), not a file of this repository
PLACEHOLDER = re.compile(r"^path/")


def documents() -> List[Path]:
    docs = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]
    code = [p for d in ("src", "tests", "scripts", "benchmarks", "examples") for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in docs + code if p.exists() and not SKIP_DIRS.intersection(p.relative_to(ROOT).parts)
            and p.relative_to(ROOT).as_posix() not in CHECKS]


def named_paths(text: str) -> Iterator[Tuple[int, str]]:
    for number, line in enumerate(text.splitlines(), 1):
        for m in PATH.finditer(line):
            yield number, m.group(1)


def found(path: str, files: List[str]) -> bool:
    path = path[2:] if path.startswith("./") else path
    if "*" in path:
        return any(fnmatch.fnmatch(f, path) or fnmatch.fnmatch(f, "*/" + path) for f in files)
    return any(f == path or f.endswith("/" + path) for f in files)


def external(path: str) -> bool:
    """A path inside another installed package (``torch/__init__.py``), not this repository."""
    top = path.split("/", 1)[0]
    return not (ROOT / top).exists() and top.isidentifier() and top != "convbn" and importlib.util.find_spec(top) is not None


def stale_paths() -> List[str]:
    files = _files()
    stale = []
    for doc in documents():
        for number, path in named_paths(doc.read_text(encoding="utf-8")):
            beside = (doc.parent / path).resolve()  # a Markdown link relative to its page
            if not (found(path, files) or external(path) or beside.exists() or PLACEHOLDER.match(path)):
                stale.append(f"{doc.relative_to(ROOT)}:{number}: {path}")
    return stale


def test_every_path_named_in_docs_and_source_exists():
    stale = stale_paths()
    assert not stale, "paths that name no file in the repository:\n" + "\n".join(stale)


def test_the_path_check_finds_paths_and_tells_stale_from_present():
    text = "see passes/tracing/trace.py and ``passes/auto_plan.py``; tests/test_integration_*.py; x/y, not a file"
    assert [p for _, p in named_paths(text)] == ["passes/tracing/trace.py", "passes/auto_plan.py",
                                                  "tests/test_integration_*.py"]
    files = _files()
    assert found("passes/tracing/trace.py", files) and found("tracing/trace.py", files)
    assert found("tests/test_integration_*.py", files)
    assert not found("passes/auto_plan.py", files) and not found("raph/trace.py", files)
    assert external("torch/__init__.py") and not external("passes/auto_plan.py")
