"""Which captures of a module ran since the report last looked: the first capture, a variant
captured for another kind of call, or the module's own forward.

Note: [a report says what ran, call by call]
A converted module called unlike its capture runs a variant captured for that call
(``convert/variants.py``): another value of an optional argument can put an op between a
convolution and its norm, so a norm fused in the first capture runs as a module in the
variant. The report must then not keep the first capture's outcome. A module's installed
forward with variants counts each call by what ran (``GraphForward.count_call``: itself, a
variant's forward, or ``None`` for its own forward); the live report reads those counts, the
calls *since it last read them* (:func:`calls_seen`), and says for each fused layer what ran
in them: ``fused`` where every kind of call fused it, ``fallback: ...`` where none did, and
``fused in some calls: ...`` naming both kinds otherwise. Reading takes the counts and keeps
them as the module's last reading, so two reads with no call between them agree, and a read
after no call at all says what the last one said (before any call: what ``convert`` decided).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..graph.graph_module import GraphForward
from ..graph.shape_capture import Guards, ShapeGuard
from ..graph.specialize import Defaults

__all__ = ["calls_seen", "describe_guard", "route_label"]


def describe_guard(guard: Any) -> str:
    """What a guard (``GraphForward.defaults``) specialises on, as text for the report.

    Example:
        >>> describe_guard(None)
        'any call'
    """
    if isinstance(guard, Guards):
        return "; ".join(describe_guard(g) for g in guard.guards)
    if isinstance(guard, Defaults):
        return guard.describe()
    if isinstance(guard, ShapeGuard):
        return guard.describe()
    return "any call"


def calls_seen(main: GraphForward) -> Optional[Dict[Optional[GraphForward], int]]:
    """What ran in the calls of ``main``'s module since the last read (the counts taken now and
    kept as the last reading), or the last reading where no call came since; ``None`` before
    any counted call (Note: [a report says what ran, call by call])."""
    ran = main.__dict__.get("ran")
    if ran:
        main.__dict__["seen"] = dict(ran)
        ran.clear()
    return main.__dict__.get("seen")


def route_label(route: Optional[GraphForward], main: GraphForward) -> str:
    """The kind of call that ran ``route`` (of ``main``'s module), as text: ``"calls with inject=None"``."""
    if route is None:
        last = f"; the last changes {main.off_call}" if main.off_call else ""
        return f"calls unlike every capture (no variant{last})"
    return f"calls with {describe_guard(route.defaults)}"
