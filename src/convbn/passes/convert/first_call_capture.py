"""A module whose code reads shapes, converted without ``example_inputs``: captured on its first call.

Note: [captured on the first call]
``torch.fx`` cannot trace Python code on shapes (TF-"SAME" padding, ``zip(skip.shape[2:],
x.shape[2:])``, ``torch.rand(x.shape[0], 1, 1, 1)``); with ``example_inputs`` such a module is
traced again with the real shapes (``shape_capture.py``). Without them, ``convert`` gives the
module a :class:`CaptureOnFirstCall` forward: its first call captures the module with that
call's real inputs through ``convert``'s own pipeline (trace with real shapes, match,
rewrite, guards), the new forward checking itself against the module's own on that very
call as every forward ``convert`` installs without ``example_inputs`` does; later calls with
other shapes capture variants (``variants.py``). Where the capture fails too, the module's
children are converted one by one, as ``convert`` would have done, and its own forward runs.
The report lists the module as not traced until its first call, then as ``convert`` would have.
"""
from __future__ import annotations

import types
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from ..graph.bypassed import watched_call
from ..graph.graph_module import installed
from ..graph.meta import meta_tensor
from ..report.convert_report import ConvertReport

__all__ = ["CaptureOnFirstCall", "CaptureWhenMaterialised"]

#: (module, prefix, args, kwargs, report, strategy, chain, count, why) -> None: capture the module
Capture = Callable[[nn.Module, str, Tuple[Any, ...], Dict[str, Any], ConvertReport, str, bool, int, str], None]


class CaptureOnFirstCall:
    """An instance ``forward`` that captures its module on its first call (Note: [captured on the
    first call]), then runs what was installed (or the module's own forward).

    Args:
        owner: the module.
        prefix: its qualified name plus ``"."`` (``""`` at the root).
        report: the converted model's report (updated in place when the capture is done).
        strategy, chain: as given to ``convert``.
        count: how many times the module was captured again before.
        why: why the symbolic trace failed (the report says it where the capture fails too).
        capture: ``convert``'s pipeline for one module and one call
            (:func:`convbn.passes.convert.pipeline.capture_on_call`).
    """

    #: read by the report (``report/live.py``): this module is converted on its first call
    captures_on_first_call = True

    def __init__(self, owner: nn.Module, prefix: str, report: ConvertReport, strategy: str, chain: bool,
                 count: int, why: str, capture: Capture) -> None:
        self.owner = owner
        self.prefix = prefix
        self.report = report
        self.strategy = strategy
        self.chain = chain
        self.count = count
        self.why = why
        self.capture = capture
        self.previous: Optional[Any] = owner.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner
        if torch.compiler.is_compiling():  # no capture inside a compiled frame: the module's own forward
            return (self.previous or types.MethodType(type(owner).forward, owner))(*args, **kwargs)
        if owner.__dict__.get("forward") is self:
            self._restore()
            self.capture(owner, self.prefix, args, kwargs, self.report, self.strategy, self.chain, self.count,
                         self.why)
            if installed(owner) is None:  # not captured: its own forward, on the children converted alone
                with watched_call(owner):  # Note: [a container its parent does not call]
                    return owner.forward(*args, **kwargs)
        return owner.forward(*args, **kwargs)

    def _restore(self) -> None:
        if self.previous is not None:
            self.owner.__dict__["forward"] = self.previous
        else:
            del self.owner.__dict__["forward"]

    def __repr__(self) -> str:
        return f"CaptureOnFirstCall({type(self.owner).__name__})"


class CaptureWhenMaterialised(CaptureOnFirstCall):
    """A :class:`CaptureOnFirstCall` for a model converted while on the meta device.

    Note: [a model converted on the meta device]
    A model built on the meta device has no values to trace BatchNorm statistics from or to
    check a rewrite against. ``convert`` (without ``example_inputs``) gives the root this
    forward: while any parameter or buffer is still on the meta device it runs the model's
    own forward (a shape-only meta call captures nothing); its first call once materialised
    (``model.to_empty(device=...)`` and an initialisation or ``load_state_dict``) converts the
    model with that call's real inputs, checked on that call, as ``convert`` without
    ``example_inputs`` does for any module.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self.owner
        if meta_tensor(owner) is not None:
            return (self.previous or types.MethodType(type(owner).forward, owner))(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def __repr__(self) -> str:
        return f"CaptureWhenMaterialised({type(self.owner).__name__})"
