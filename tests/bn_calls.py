"""Count the BatchNorm calls that run in eager form during a forward: what a report's
"fused" / "folded" must equal when subtracted from eager's own count.

Every eager batch norm goes through ``torch.nn.functional.batch_norm`` (``nn.BatchNorm*``'s
forward, norm-act subclasses, a model's functional call, a rewritten graph's inlined call);
convbn's fused kernels (``convbn/autograd``, ``convbn/functional``) are not eager form and are
not counted.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, List

import torch
import torch.nn.functional as F
from torch import nn

import convbn

__all__ = ["counting_bn_calls", "eager_bn_calls", "assert_report_matches_calls"]

_FUSED_DIRS = tuple(os.path.join(os.path.dirname(os.path.abspath(convbn.__file__)), d) + os.sep
                    for d in ("autograd", "functional"))


@contextlib.contextmanager
def counting_bn_calls() -> Iterator[List[str]]:
    """Within the block, every eager batch norm call appends its caller's file to the list."""
    calls: List[str] = []
    real = F.batch_norm

    def counted(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_code.co_filename
        if not caller.startswith(_FUSED_DIRS):
            calls.append(caller)
        return real(*args, **kwargs)

    F.batch_norm = counted
    try:
        yield calls
    finally:
        F.batch_norm = real


def eager_bn_calls(model: nn.Module, *args: Any, backward: bool = False) -> int:
    """How many batch norms run in eager form in one forward of ``model`` (and a backward)."""
    with counting_bn_calls() as calls:
        out = model(*args)
        if backward:
            leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            sum(t.float().sum() for t in leaves).backward()
    return len(calls)


def assert_report_matches_calls(eager_calls: int, model: nn.Module, *args: Any, result: str = "fused",
                                backward: bool = False) -> int:
    """The report of ``model`` (``convbn_report``) lists as ``result`` exactly the BatchNorm calls
    that left its forward: eager's count minus what still runs in eager form. Returns that number."""
    left_calls = eager_bn_calls(model, *args, backward=backward)
    report = model.convbn_report
    listed = sum(1 for o in report.outcomes if o.result == result)
    gone = eager_calls - left_calls
    assert listed == gone, (f"the report lists {listed} BatchNorms {result}, but {gone} of {eager_calls} eager "
                            f"batch norm calls left the forward ({left_calls} still run):\n{report}")
    return gone
