"""Whether a traced module's graph depends on its mode, answered once per conversion made once.

Note: [a mode dependence answered once]
To know whether a traced graph holds in the other mode (code that branches on
``self.training``), :func:`~convbn.passes.tracing.trace.trace` traces the module a second time
with every ``training`` flag flipped and compares the generated code. On a model of many
modules that second trace is about half of tracing (HRNet-style, 293 BatchNorms: about 2 of
the 4 s a re-convert spent tracing), and a re-convert after a resume
(``convert(..., plan=saved)``, Note: [a conversion made once]) paid it again for the answer it
had already found. Inside :func:`mode_answers` each answer is recorded under a digest of the
module's class and the code of its graph as just traced (in the mode it was traced in); the
answers a reused plan carries are taken where that digest is the same, so a graph traced
differently is asked again. Like the plan's check results, an answer is reused on the plan's
fingerprint (structure, shapes, dtypes, options, torch and convbn versions): code changed
between the two conversions outside what the traced graph shows (the other mode's branch
alone) is not seen; convert without ``plan=`` to have everything asked again.
"""
from __future__ import annotations

import contextlib
import hashlib
from contextvars import ContextVar
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple

from torch import nn

__all__ = ["mode_answers", "mode_dependent_once"]

#: (answers to reuse, answers given in this scope) of the innermost :func:`mode_answers` of this thread
_SCOPE: ContextVar[Optional[Tuple[Mapping[str, bool], Dict[str, bool]]]] = ContextVar("convbn_mode_answers",
                                                                                      default=None)


@contextlib.contextmanager
def mode_answers(known: Mapping[str, bool]) -> Iterator[Dict[str, bool]]:
    """Within the block, :func:`mode_dependent_once` takes the answers ``known`` has for the same
    digest; yields the answers given in the block (reused ones included), by digest."""
    given: Dict[str, bool] = {}
    token = _SCOPE.set((dict(known), given))
    try:
        yield given
    finally:
        _SCOPE.reset(token)


def mode_dependent_once(module: nn.Module, code: str, ask: Callable[[], bool]) -> bool:
    """``ask()``, or the answer :func:`mode_answers` holds for ``module``'s class traced to ``code``
    in its current mode (Note: [a mode dependence answered once])."""
    scope = _SCOPE.get()
    if scope is None:
        return ask()
    cls = type(module)
    key = hashlib.sha256(f"{cls.__module__}.{cls.__qualname__}\n{int(module.training)}\n{code}".encode()).hexdigest()[:32]
    known, given = scope
    answer = known[key] if key in known else ask()
    given[key] = answer
    return answer
