"""pytest plugin for ``scripts/mutants.py --measure``: records, per test, whether it called
``convbn.convert`` (however imported) or built a ``FusedChain``, and whether it failed.

Loaded with ``-p convert_probe`` (``scripts/`` on ``PYTHONPATH``); writes one JSON line per
test into ``$CONVBN_PROBE_DIR`` (a crashed worker loses nothing already run). It wraps without changing behaviour: ``convert``'s
argument check (called first by every ``convert``) and ``FusedChain.__init__``.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Dict

import pytest

_ROWS: Dict[str, Dict[str, bool]] = {}
_CURRENT: Dict[str, Any] = {"id": None}


def _mark(key: str) -> None:
    nodeid = _CURRENT["id"]
    if nodeid is not None:
        _ROWS.setdefault(nodeid, {"convert": False, "chain": False, "failed": False})[key] = True


def pytest_configure(config: pytest.Config) -> None:
    import convbn.passes.convert.api as conv_mod
    from convbn.nn.chain import FusedChain

    check = conv_mod._check_args

    @functools.wraps(check)
    def _check_args(*args: Any, **kwargs: Any) -> Any:
        _mark("convert")
        return check(*args, **kwargs)

    conv_mod._check_args = _check_args
    init = FusedChain.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _mark("chain")
        init(self, *args, **kwargs)

    FusedChain.__init__ = __init__  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    _CURRENT["id"] = item.nodeid
    _ROWS.setdefault(item.nodeid, {"convert": False, "chain": False, "failed": False})
    try:
        return (yield)
    finally:
        _CURRENT["id"] = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and report.nodeid in _ROWS:
        _ROWS[report.nodeid]["failed"] = True
    out = os.environ.get("CONVBN_PROBE_DIR")
    if out and report.when == "teardown" and report.nodeid in _ROWS:  # one line per test: survives a crash
        with open(os.path.join(out, f"probe-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({report.nodeid: _ROWS[report.nodeid]}) + "\n")


