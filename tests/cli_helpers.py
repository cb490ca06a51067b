"""Running ``convbn``'s command line in-process and checking that a mistake is one line."""
from __future__ import annotations

from typing import Any, Tuple

from convbn.cli import main


def run_cli(argv: Any, capsys: Any) -> Tuple[Any, str, str]:
    """``main(argv)``: its exit code (also from ``SystemExit``), stdout and stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_exit_2(code: Any, out: str, err: str, *must: str) -> str:
    """Exit status 2, one line on stderr naming each of ``must``, no traceback; returns stderr."""
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for text in must:
        assert text in err, (text, err)
    return err
