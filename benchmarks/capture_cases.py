"""The cases of the capture issue, for ``bm_capture_vs_dynamo.py``: each a model of the
capture tests, its input, and what happens to it after the first training step.

Example::

    case = case_models()["residual scale changed"]
    model = case.make().double()
    case.change(model)   # what training code does after convert / compile
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

__all__ = ["Case", "CASES", "case_models"]

Change = Optional[Callable[[nn.Module], None]]


class Case(NamedTuple):
    """One case: the model, its input, what happens after the first step (keyword arguments
    of later calls, ``shape`` of later inputs, a change to the captured model and to its eager
    twin), whether the input requires grad."""

    make: Callable[[], nn.Module]
    shape: Tuple[int, ...]
    after: Dict[str, Any]
    change: Change = None
    eager_change: Change = None
    x_grad: bool = True


def case_models() -> Dict[str, Case]:
    """Every case of the capture issue, by name (models of the capture tests)."""
    from test_capture_checkpoint import Checkpointed
    from test_capture_defaults import Masked
    from test_capture_example_inputs import IndexFirst, ViewFlag
    from test_capture_grad_modes import Gate
    from test_capture_shapes import DropPath, MobileLike, UpSkip
    from test_guards import Net

    def setattr_(path: str, value: Any) -> Change:
        def change(m: nn.Module) -> None:
            owner, _, attr = path.rpartition(".")
            setattr(m.get_submodule(owner), attr, value() if callable(value) else value)
        return change

    def new_conv() -> nn.Module:
        torch.manual_seed(5)  # the same new weights on both sides
        return nn.Conv2d(4, 4, 3, padding=1, bias=False).double()

    def sync(m: nn.Module) -> None:  # convert_sync_batchnorm on children replaces them in place
        for name, child in list(m.named_children()):
            setattr(m, name, nn.SyncBatchNorm.convert_sync_batchnorm(child))

    small = (4, 3, 6, 6)
    return {
        "TF-SAME padding from x.shape": Case(MobileLike, (4, 3, 15, 15), {}),
        "odd-size padding from skip.shape": Case(UpSkip, (2, 2, 7, 9, 7), {}),
        "inline drop-path torch.rand(x.shape[0], ...)": Case(DropPath, (4, 3, 8, 8), {}),
        "with torch.no_grad() in forward": Case(lambda: Gate("no_grad"), small, {}),
        "optional argument at its default": Case(Masked, small, {}),
        "optional argument given after step 1": Case(Masked, small, {"halve": True}),
        "requires_grad set on a view of the input": Case(lambda: ViewFlag("on"), small, {}, x_grad=False),
        "first output without grad": Case(IndexFirst, small, {}),
        "checkpoint (non-reentrant) in forward": Case(lambda: Checkpointed("qualified", False), small, {}),
        "checkpoint (reentrant) in forward": Case(lambda: Checkpointed("qualified", True), small, {}),
        "input shape changed after step 1": Case(Net, small, {"shape": (2, 3, 8, 8)}),
        "residual scale changed": Case(Net, small, {}, setattr_("block1.scale", 0.5)),
        "F.dropout(x, self.p): p changed": Case(Net, small, {}, setattr_("block1.p", 0.3)),
        "flag switching a branch": Case(Net, small, {}, setattr_("block2.squeeze", True)),
        "conv re-initialised (new object)": Case(Net, small, {}, setattr_("block1.conv", new_conv)),
        "BN -> nn.Identity": Case(Net, small, {}, setattr_("block1.bn", nn.Identity)),
        # torch's SyncBatchNorm refuses CPU inputs once a process group exists; over one process it
        # computes what BatchNorm does, so the eager twin keeps its BatchNorms
        "BN -> SyncBatchNorm (1 process)": Case(Net, small, {}, sync, eager_change=lambda m: None),
    }


CASES = list(case_models())
