"""Progress of long work on stderr: one line per stage, quiet unless stderr is a terminal.

Long calls (:func:`convbn.convert` with ``example_inputs``, :func:`convbn.max_batch`,
:func:`convbn.explain`, ``convbn explain --memory``, ``convbn bench``) take a
``progress`` argument: ``None`` (default) prints where stderr is a terminal, ``True``
prints anyway, ``False`` never. A call opens a scope with :func:`progress_scope`; code
below it reports with :func:`stage`, which costs one context-variable read when no scope
prints. The scope is a :class:`contextvars.ContextVar`, not process-global state: threads
and nested calls each see their own. A call made inside another's scope with
``progress=None`` reports under it (indented); ``False`` silences it there.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> with progress_scope("demo", True, stream=out):
    ...     stage("first part")
    >>> out.getvalue().splitlines()[0].endswith("demo: first part")
    True
"""
from __future__ import annotations

import contextlib
import sys
import time
from contextvars import ContextVar
from typing import IO, Any, Iterator, Optional

__all__ = ["Progress", "progress_scope", "stage", "check_progress", "active"]


class Progress:
    """Where and how one scope prints: a title (``"convert"``), its depth under enclosing
    scopes, the stream (``None``: :data:`sys.stderr` at each print, so a redirected stderr is
    honoured) and the time it started."""

    def __init__(self, title: str, stream: Optional[IO[str]] = None, depth: int = 0,
                 start: Optional[float] = None) -> None:
        self.title = title
        self.stream = stream
        self.depth = depth
        self.start = time.perf_counter() if start is None else start

    def line(self, text: str) -> None:
        """Print ``[convbn  12.3s] <indent>title: text`` and flush."""
        stream = self.stream if self.stream is not None else sys.stderr
        elapsed = time.perf_counter() - self.start
        print(f"[convbn {elapsed:6.1f}s] {'  ' * self.depth}{self.title}: {text}", file=stream, flush=True)


#: the scope that prints now; ``None``: nothing prints (no scope, or one that is quiet)
_CURRENT: ContextVar[Optional[Progress]] = ContextVar("convbn_progress", default=None)
#: whether a scope is open at all (a quiet one included): a nested ``progress=None`` follows it
_OPEN: ContextVar[bool] = ContextVar("convbn_progress_open", default=False)


def check_progress(progress: Any) -> None:
    """Raise ``TypeError`` unless ``progress`` is ``None``, ``True`` or ``False``."""
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be None (on where stderr is a terminal), True or False, "
                        f"but got {progress!r}")


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


@contextlib.contextmanager
def progress_scope(title: str, progress: Optional[bool] = None,
                   stream: Optional[IO[str]] = None) -> Iterator[Optional[Progress]]:
    """Open a scope that prints ``title``'s stages.

    Args:
        title: what the scope is doing, e.g. ``"convert"``.
        progress: ``None``: print where an enclosing scope prints (indented under it), and
            with no enclosing scope where stderr is a terminal; ``True``: print; ``False``:
            print nothing here, nested scopes included unless they ask.
        stream: where to print (default: ``sys.stderr`` at each line).

    Yields:
        The :class:`Progress` printing, or ``None`` when quiet.
    """
    check_progress(progress)
    outer = _CURRENT.get()
    if progress is None:
        if _OPEN.get():
            on = outer is not None
        else:
            on = _is_tty(stream if stream is not None else sys.stderr)
    else:
        on = progress
    scope: Optional[Progress] = None
    if on:
        if outer is not None:
            scope = Progress(title, stream if stream is not None else outer.stream, outer.depth + 1, outer.start)
        else:
            scope = Progress(title, stream)
    token, token_open = _CURRENT.set(scope), _OPEN.set(True)
    try:
        yield scope
    finally:
        _CURRENT.reset(token)
        _OPEN.reset(token_open)


def active() -> Optional[Progress]:
    """The scope printing now, or ``None``."""
    return _CURRENT.get()


def stage(text: str) -> None:
    """Mark the start of a stage of the current scope: print ``text`` (nothing, at the cost
    of one lookup, when no scope prints)."""
    scope = _CURRENT.get()
    if scope is not None:
        scope.line(text)
