"""Torch's log of a failed fake run, dropped where convert's own shape trace made the run.

Note: [a fake run that fails is not the user's error]
A trace with real inputs computes each traced value's fake tensor as the trace goes
(:mod:`~convbn.passes.graph.shape_capture`). Where that fake run raises (a value the trace
cannot know: a Python list filled in an earlier call, a cache read by shape), the capture
treats the value as unknown and goes on, exactly as a symbolic trace would, and convert
decides what runs as for any trace that fails. ``FakeTensorMode`` however first writes the
failure, with its whole traceback, to its logger at ERROR level: a user saw pages of ERROR
tracebacks from a ``convert`` that succeeded. :func:`fake_errors_quiet` drops those records,
and only those: records of that logger written by the thread that is inside convbn's fake run
(a depth counter per thread), at any level, while that run lasts. Every other thread's, and
everything torch logs outside the capture, reaches the user as before.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

from ..._compat import FAKE_TENSOR_LOGGER

__all__ = ["fake_errors_quiet"]


class _InsideCapture(logging.Filter):
    """Drops a record written by a thread that is inside :func:`fake_errors_quiet`."""

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(self.local, "depth", 0) == 0


_FILTER = _InsideCapture()


@contextlib.contextmanager
def fake_errors_quiet() -> Iterator[None]:
    """Within: what ``FakeTensorMode`` logs from this thread is dropped (Note: [a fake run that
    fails is not the user's error]). The filter is attached to torch's logger on first use, never
    on ``import convbn``."""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    local = _FILTER.local
    local.depth = getattr(local, "depth", 0) + 1
    try:
        yield
    finally:
        local.depth -= 1
