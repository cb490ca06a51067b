"""The documentation users read: the site builds in strict mode, every Python example in the
README and the docs pages runs, the README stays a short front page, and the docstrings the
API reference renders speak to users (no internal note names, file paths or issue numbers)."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))

#: a Python block the tests do not run says why on the line before it; only for what needs a
#: GPU, the network or a third-party trainer (the recipes of docs/guides/)
NO_RUN = re.compile(r"<!--\s*no-run:\s*(?P<why>\S.*?)\s*-->")
FENCE = re.compile(r"^```(?P<lang>\S*)[^\n]*\n(?P<body>.*?)^```\s*$", re.S | re.M)
MAX_NO_RUN = 8


def code_blocks(text: str) -> Iterator[Tuple[int, str, str, str]]:
    """``(line, language, body, why-not-run or "")`` for each fenced block of a Markdown text."""
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip().splitlines()
        marker = NO_RUN.fullmatch(before[-1].strip()) if before else None
        yield text.count("\n", 0, m.start()) + 1, m.group("lang"), m.group("body"), marker.group("why") if marker else ""


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --------------------------------------------------------------------------- the examples run


def runnable(page: Path) -> List[Tuple[int, str]]:
    return [(line, body) for line, lang, body, why in code_blocks(page.read_text()) if lang == "python" and not why]


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=_page_id)
def test_every_python_block_of_the_page_runs(page: Path, tmp_path, monkeypatch):
    """The page's ```python blocks run in order in one namespace (as a reader pastes them),
    in an empty folder, except those marked ``<!-- no-run: why -->``."""
    blocks = runnable(page)
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace = {"__name__": "__docs__"}
    for line, body in blocks:
        code = compile(body, f"{_page_id(page)}:{line}", "exec")
        exec(code, namespace)  # noqa: S102 - the documentation's own examples


def test_blocks_left_unrun_say_why_and_are_few():
    unrun = [(page, line, why) for page in PAGES for line, lang, _, why in code_blocks(page.read_text())
             if lang == "python" and why]
    assert len(unrun) <= MAX_NO_RUN, unrun
    for page, line, why in unrun:
        assert re.search(r"\bneeds\b", why), f"{_page_id(page)}:{line}: say what the block needs ({why!r})"
    # every ```python block is either run or marked: a typo in the marker would leave one unrun silently
    for page in PAGES:
        text = page.read_text()
        assert text.count("<!-- no-run") == sum(1 for *_, why in code_blocks(text) if why), _page_id(page)


def test_the_block_parser_sees_markers_and_languages():
    text = "intro\n\n```python\nx = 1\n```\n\n<!-- no-run: needs a GPU -->\n```python\ny = 2\n```\n```bash\nls\n```\n"
    blocks = list(code_blocks(text))
    assert [(lang, why) for _, lang, _, why in blocks] == [("python", ""), ("python", "needs a GPU"), ("bash", "")]
    assert blocks[0][2] == "x = 1\n"


# --------------------------------------------------------------------------- the README is a front page

README_MAX_LINES = 150


def test_readme_is_a_short_front_page():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    history = re.findall(r"\b(?:issue|issues)\s+#?\d+|\bbefore issue\b", text, re.I)
    assert not history, f"project history in README.md: {history}"
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text
    assert any(lang == "python" and not why for _, lang, _, why in code_blocks(text)), "the example must run"


def test_readme_and_pages_link_to_files_that_exist():
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    for page in PAGES:
        for target in link.findall(page.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            assert (page.parent / target).exists(), f"{_page_id(page)} links to {target}, which does not exist"


# --------------------------------------------------------------------------- the API reference

def test_the_api_reference_renders_every_public_name():
    import convbn

    page = (DOCS / "reference" / "convbn.md").read_text()
    rendered = set(re.findall(r"^::: convbn\.(\w+)$", page, re.M))
    assert rendered == set(convbn.__all__), set(convbn.__all__) ^ rendered


PUBLIC_MODULES = ["convbn", "convbn.memory", "convbn.nn", "convbn.integrations", "convbn.reference", "convbn.deploy"]
INTERNAL = re.compile(
    r"Note:\s*\[|\[[a-z][^\]]*\]\s+in\s+`*\w"      # a developer note's name ("Note: [x] in ...")
    r"|(?:[\w.-]+/)+[\w.-]+\.py"                   # a file path in the source tree
    r"|\bissue\s+#?\d+"                            # project history
    r"|\bREADME\b|\bARCHITECTURE\b|\bSPEC\s*§"     # documents a user of the API reference does not have open
)
CONSTANT = re.compile(r"\b_?[A-Z][A-Z0-9]*_[A-Z0-9_]+\b")


def _public_docstrings() -> List[Tuple[str, str]]:
    out: List[Tuple[str, str]] = []
    for name in PUBLIC_MODULES:
        if name == "convbn.integrations.lightning" and importlib.util.find_spec("lightning") is None:
            continue
        module = importlib.import_module(name)
        out.append((name, inspect.getdoc(module) or ""))
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            out.append((f"{name}.{attr}", inspect.getdoc(obj) or ""))
            if inspect.isclass(obj):
                for key, value in vars(obj).items():
                    if key.startswith("_") and key != "__init__":
                        continue
                    fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                    if callable(fn) and getattr(fn, "__doc__", None):
                        out.append((f"{name}.{attr}.{key}", inspect.cleandoc(fn.__doc__)))
    return out


def _public_names() -> set:
    names = set()
    for name in PUBLIC_MODULES:
        names.update(getattr(importlib.import_module(name), "__all__", []))
    return names


def test_public_docstrings_speak_to_users():
    """What the API reference renders names no developer note, source file, issue or private constant."""
    public = _public_names()
    found = []
    for where, doc in _public_docstrings():
        found += [f"{where}: {m.group(0)!r}" for m in INTERNAL.finditer(doc)]
        found += [f"{where}: constant {c!r}" for c in CONSTANT.findall(doc)
                  if c not in public and not c.startswith("CONVBN_")]  # environment variables are for users
    assert not found, "\n".join(found)


def test_the_docstring_check_catches_what_it_is_for():
    for bad in ["see Note: [a step's peak]", "[saved bytes or peak] in ``passes/auto_plan.py``", "since issue 24",
                "(README \"Use it\")"]:
        assert INTERNAL.search(bad), bad
    assert CONSTANT.findall("within 8 % (``PEAK_TOLERANCE``)") == ["PEAK_TOLERANCE"]
    assert not INTERNAL.search("the step's peak, weight gradients counted; see convbn.memory.timeline")


def test_sphinx_roles_show_as_code_in_the_api_reference():
    spec = importlib.util.spec_from_file_location("sphinx_roles", DOCS / "_ext" / "sphinx_roles.py")
    if importlib.util.find_spec("griffe") is None:
        pytest.skip("griffe is not installed: pip install '.[docs]'")
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)
    assert roles.plain("see :func:`convert` and :class:`~convbn.BNOutcome`; :data:`convbn.ACTIVATIONS`.") == (
        "see `convert` and `BNOutcome`; `convbn.ACTIVATIONS`.")


# --------------------------------------------------------------------------- the site builds

def test_the_site_builds_in_strict_mode(tmp_path):
    """``mkdocs build --strict``: a broken link, a page missing from the nav or a reference the
    API pages cannot resolve fails the build (scripts/setup.sh installs the ``docs`` extra)."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install '.[docs]' (scripts/setup.sh does)")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(site)], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    api = (site / "reference" / "convbn" / "index.html").read_text()
    for anchor in ("convbn.convert", "convbn.fold", "convbn.explain", "convbn.max_batch"):
        assert f'id="{anchor}"' in api, anchor
