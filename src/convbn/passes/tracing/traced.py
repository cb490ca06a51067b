"""The result of a trace: :class:`Traced` (the graph, what was left opaque, hooked or not inlined
and why, the modes and arguments it was traced with, and the guard a call must meet for the
graph to apply). Made by :func:`convbn.passes.tracing.trace.trace`, which re-exports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch.fx as fx
from torch import nn

from ...functional.norms import row_of_module
from ..graph.layers import LAYER_MODULES
from ..graph.shape_capture import Guards, ShapeGuard
from ..graph.specialize import Defaults, EmptyVarargs

__all__ = ["Traced"]


@dataclass
class Traced:
    """Result of :func:`trace`.

    Attributes:
        gm: a GraphModule of the trace (holding only what the graph uses).
        graph: its graph.
        opaque: submodules rolled back to leaves, with the reason (failed or misleading trace).
        hooked: submodules kept as leaves because they have hooks, with the hooks.
        norm_act: BatchNorm subclasses with their own forward left as leaves, with why.
        wrapped: helper functions recorded as single calls (their trace failed inside).
        mode_dependent: the graph differs when traced with ``training`` flipped.
        modes: every module's ``training`` flag when traced.
        defaults: arguments traced at their default value (:mod:`.specialize`): the
            rewritten forward applies only to calls that keep them.
        shapes: for a trace with real shapes (:mod:`.shape_capture`), the input shapes it
            assumed; ``None`` for a symbolic trace.

    Method ``guard()``: what a call must satisfy for the graph to apply (``None``: anything).
    """

    gm: fx.GraphModule
    graph: fx.Graph
    opaque: Dict[str, str] = field(default_factory=dict)
    hooked: Dict[str, str] = field(default_factory=dict)
    norm_act: Dict[str, str] = field(default_factory=dict)
    wrapped: List[str] = field(default_factory=list)
    mode_dependent: bool = False
    modes: List[Tuple[nn.Module, bool]] = field(default_factory=list, repr=False)
    defaults: Defaults = field(default_factory=lambda: Defaults((), (), ()))
    shapes: Optional[ShapeGuard] = None
    varargs: Optional[EmptyVarargs] = None

    def guard(self) -> Any:
        """The guard of calls the graph applies to (``hold(args, kwargs)``), or ``None``."""
        guards = [g for g in (self.defaults if self.defaults.names else None, self.shapes, self.varargs)
                  if g is not None]
        return None if not guards else guards[0] if len(guards) == 1 else Guards(guards)

    def opaque_layers(self, module: nn.Module) -> List[str]:
        """The conv / linear layers of ``module`` (subclasses with their own forward) left opaque
        because their code did not trace: a BatchNorm after one cannot pair with it."""
        return [name for name, why in self.opaque.items()
                if why != "asked to be a leaf" and isinstance(module.get_submodule(name), LAYER_MODULES)]

    def opaque_norms(self, module: nn.Module) -> List[str]:
        """The submodules of ``module`` left opaque because their code did not trace that have the
        shape of a hand-written norm: a forward of their own, parameters of their own and none
        below them (a channel LayerNorm's gain, and bias). ``eps = 1e-5 if x.dtype == torch.float32
        else 1e-3`` is control flow on a traced value symbolically; a trace with real inputs answers
        it (Note: [opaque children traced again with real shapes] in ``convert/pipeline.py``)."""
        return [name for name, why in self.opaque.items()
                if why != "asked to be a leaf" and _norm_shaped(module.get_submodule(name))]

    def opaque_to_retrace(self, module: nn.Module) -> List[str]:
        """:meth:`opaque_layers` and :meth:`opaque_norms` together: what a trace with real inputs may open."""
        return self.opaque_layers(module) + [n for n in self.opaque_norms(module) if n not in self.opaque_layers(module)]

    def descend(self) -> Dict[str, str]:
        """Leaves the caller should work inside on their own (opaque and hooked), outermost first."""
        both = {**self.hooked, **self.opaque}
        names = sorted(both, key=lambda n: n.count("."))
        kept: Dict[str, str] = {}
        for n in names:  # a leaf inside another leaf is reached through the outer one
            if n and not any(n.startswith(k + ".") for k in kept if k):
                kept[n] = both[n]
        return kept


def _norm_shaped(module: nn.Module) -> bool:
    """Whether ``module`` looks like a hand-written norm: its own ``forward``, its own parameters,
    and no submodule holding any (a block with layers inside is not one); not a module of a norm
    table row (matched as one call even where its own code does not trace)."""
    return (type(module).forward is not nn.Module.forward and bool(module._parameters)
            and not any(m._parameters for m in module.modules() if m is not module)
            and row_of_module(module) is None)  # a norm-table row is matched as the call it is
