"""A griffe extension for the API reference: the docstrings use Sphinx cross-reference roles
(``:func:`convert```, ``:class:`~convbn.BNOutcome```), which Markdown would print as they
are. Each role becomes inline code of the name it refers to (``~`` keeps the last part), as
Sphinx would display it."""
from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`<]+?)(?:\s*<[^>]+>)?`")


def plain(text: str) -> str:
    """``:func:`~a.b.c``` -> ```c```; ``:class:`a.B``` -> ```a.B```."""
    return ROLE.sub(lambda m: "`" + (m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)) + "`", text)


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring griffe loads."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
