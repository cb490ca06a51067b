"""Functions a reader can hold: none in ``src/convbn`` over :data:`LIMIT` lines (docstring
included) without a reason written beside its ``def`` (a comment on the ``def`` line)."""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path
from typing import Dict

SRC = Path(__file__).resolve().parents[1] / "src" / "convbn"
LIMIT = 60

#: Long functions being rewritten elsewhere, by ``path::name``: this list only shrinks.
KNOWN = {
    "passes/convert/api.py::convert",
}


def _long_functions() -> Dict[str, bool]:
    """``path::name`` of every function over :data:`LIMIT` lines -> whether its ``def`` line
    carries a comment."""
    found: Dict[str, bool] = {}
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                    if tok.type == tokenize.COMMENT}
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > LIMIT:
                found[f"{path.relative_to(SRC).as_posix()}::{node.name}"] = node.lineno in comments
    return found


def test_long_functions_say_why() -> None:
    silent = sorted(name for name, why in _long_functions().items() if not why and name not in KNOWN)
    assert not silent, (f"functions over {LIMIT} lines with no reason beside the def (split them, or write "
                        "'# over 60 lines: ...' on the def line):\n" + "\n".join(silent))


def test_known_list_only_shrinks() -> None:
    long = _long_functions()
    stale = sorted(name for name in KNOWN if name not in long or long[name])
    assert not stale, "these are no longer long (or now say why); delete them from KNOWN:\n" + "\n".join(stale)
