"""What torch's own loggers print at WARNING during a block (Dynamo, inductor, checkpoint
advisories), for tests that assert a compiled converted model logs nothing of convbn's."""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator, List


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def torch_warnings() -> Iterator[List[str]]:
    """The messages torch logs at WARNING inside the block, its one-time warnings made fresh
    first (torch prints each once per process: one an earlier test spent would not show)."""
    from torch._logging._internal import warning_once

    warning_once.cache_clear()
    records = _Records()
    root = logging.getLogger("torch")
    root.addHandler(records)
    try:
        yield records.messages
    finally:
        root.removeHandler(records)
