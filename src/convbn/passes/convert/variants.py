"""A converted module called unlike its capture runs a variant captured for that call.

Note: [a variant per kind of call]
A rewritten forward applies to calls like the one it was captured for: optional arguments at
the values traced (``labels=None``, ``attention_mask=None``) and, for a capture with real
shapes, those input shapes (``GraphForward.defaults``). Like ``torch.compile``'s cache of
graphs per frame, a call that does not match captures the module again *for that call* (the
arguments it passes: a tensor traced as an input, ``None`` / ``bool`` / ``str`` as the
constant given; its shapes where the code reads shapes) through ``convert``'s own pipeline
(trace, match, rewrite), and keeps the result among the module's variants, each guarded on
what it was specialised on. Later calls run the first variant whose guard holds. A new
variant checks itself against the module's own forward on its first call, as ``convert``
without ``example_inputs`` does. Past :data:`MAX_VARIANTS` per module, further kinds of call
run the module's own forward (unfused), with a one-time message; so does a call whose
variant cannot be captured or fuses nothing (remembered, not tried again).

A variant's chains are unregistered attributes of the module next to the first capture's
(``GraphForward.added`` lists them); :attr:`ConvertReport.variants` says what each variant was
specialised on, and the report's outcomes what each kind of call ran (a norm a variant does not
fuse is not reported fused for its calls: Note: [a report says what ran, call by call] in
report/calls_seen.py).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..graph.graph_module import GraphForward
from ..graph.shape_capture import Guards, ShapeGuard
from ..report.calls_seen import describe_guard
from ..graph.specialize import constant_defaults
from ..report.convert_report import ConvertReport
from ..tracing.trace import short_reason

__all__ = ["MAX_VARIANTS", "Variants", "describe_guard"]

#: how many variants one module keeps before other kinds of call run its own forward
MAX_VARIANTS = 8

#: (module, prefix, args, kwargs, variants) -> the new variant's forward, or None (nothing fused)
Capture = Callable[[nn.Module, str, Tuple[Any, ...], Dict[str, Any], "Variants"], Optional[GraphForward]]


class Variants:
    """The variants of one converted module (Note: [a variant per kind of call]).

    Args:
        report: the converted model's report (its ``variants`` list is filled).
        prefix: the module's qualified name plus ``"."`` (``""`` at the root).
        strategy, chain: as given to ``convert``.
        count: how many times the module was captured again before (for the re-capture limit).
        capture: captures the module for one call (``convert``'s pipeline run again:
            :func:`convbn.passes.convert.pipeline.capture_variant`).
    """

    def __init__(self, report: ConvertReport, prefix: str, strategy: str, chain: bool, count: int,
                 capture: Capture) -> None:
        self.report = report
        self.prefix = prefix
        self.strategy = strategy
        self.chain = chain
        self.count = count
        self.capture = capture
        #: (guard, forward or ``None``: the module's own forward runs for such calls)
        self.entries: List[Tuple[Any, Optional[GraphForward]]] = []
        self.full = False

    def __len__(self) -> int:
        return sum(1 for _, f in self.entries if f is not None)

    def lookup(self, main: GraphForward, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[GraphForward]:
        """The variant for this call, captured now if none holds; ``None``: run the module's own forward."""
        for guard, fwd in self.entries:
            if guard.hold(args, kwargs):
                return fwd
        if len(self) >= MAX_VARIANTS:
            self._limit(main, args, kwargs)
            return None
        owner = main.owner
        why = "it does not trace for such calls, or nothing in it fuses"
        try:
            fwd = self.capture(owner, self.prefix, args, kwargs, self)
        except Exception as exc:  # noqa: BLE001 - not capturable for this call: its own forward runs for such calls
            fwd, why = None, short_reason(exc, 120)
        guard = fwd.defaults if fwd is not None and fwd.defaults is not None else Guards(
            [constant_defaults(owner).for_call(args, kwargs), ShapeGuard(args, kwargs)])
        self.entries.append((guard, fwd))
        label = self.prefix.rstrip(".") or type(owner).__name__
        if fwd is not None:
            n = sum(1 for t in fwd.added if t.rpartition(".")[2].startswith("convbn_chain"))
            self.report.variants.append(f"{label}: {describe_guard(guard)} ({n} chain{'s' if n != 1 else ''})")
        else:
            self.report.changes.append(f"{label} called with {describe_guard(guard)}: no variant captured ({why}); "
                                       "such calls run its original (unfused) forward")
        return fwd

    def _limit(self, main: GraphForward, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if self.full or torch.compiler.is_compiling():
            return
        self.full = True
        label = self.prefix.rstrip(".") or type(main.owner).__name__
        message = (f"{label} was called in more than {MAX_VARIANTS} different ways (arguments off the traced "
                   f"values or other input shapes: this call changes {main.defaults.differing(args, kwargs)}); "
                   "further kinds of call run its original (unfused) forward")
        self.report.changes.append(message)
        warnings.warn(f"convbn: {message}", RuntimeWarning, stacklevel=5)

    def forwards(self) -> List[GraphForward]:
        """The variants' forwards, in the order they were captured."""
        return [f for _, f in self.entries if f is not None]
