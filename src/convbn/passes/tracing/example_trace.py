"""A module traced with the real inputs of one call, its optional arguments as that call passes them.

Note: [a trace with real inputs is specialised to their call]
Where symbolic tracing fails (shapes read in Python, ``torch.is_tensor`` on an argument), a
pass traces a module again with the inputs it runs on in an eager run of the example
(:mod:`convbn.passes.graph.shape_capture`), guarded on those inputs. Its optional arguments
must be those of the same call: a wrapper calling ``unet(sample, t, return_dict=False)``
traced as the signature has it (``return_dict=True``) gives a graph for calls nobody makes,
so convert's own check on the example inputs ran the module's unfused forward (a call off the
traced values), the report said ``fallback`` for every chain inside, and only the first
training step captured a variant for the real call and ran fused. Traced here with the
call's values first (:meth:`Defaults.for_call`), the graph is the one the example and
the training steps like it run; where the code needs an optional argument as a value (``x +
residual`` with ``residual=None``), traced as the signature has it, as before.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from torch import nn

from ..graph.specialize import constant_defaults, none_used_as_value
from .trace import LayerTracer, Traced, trace

__all__ = ["trace_example_call"]


def trace_example_call(module: nn.Module, example: Tuple[Tuple[Any, ...], Dict[str, Any]],
                       training: Optional[bool] = None) -> Traced:
    """``module`` traced with the real inputs of ``example`` (``(args, kwargs)``), its optional
    arguments at the values that call passes (Note: [a trace with real inputs is specialised to
    their call]); where that trace fails or uses a ``None`` as a value, with the signature's.

    Raises:
        Exception: whatever tracing raised where ``module`` does not trace even with real inputs.
    """
    defaults = constant_defaults(module)
    if defaults.names:
        try:
            traced = trace(module, LayerTracer, training=training, example=example,
                           defaults=defaults.for_call(*example))
            if not none_used_as_value(traced.graph):
                return traced
        except Exception:  # noqa: BLE001 - traced below as the signature has it
            pass
    return trace(module, LayerTracer, training=training, example=example)
