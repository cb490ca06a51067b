"""``torch.utils.checkpoint`` calls inside a traced forward stay calls.

Traced through, ``checkpoint(self.block, x)`` vanishes from the graph: the block's ops are
recorded inline, and what checkpointing does at run time is lost -- the recompute in backward,
which (with the block's BatchNorms in training mode) updates their running statistics and
``num_batches_tracked`` a second time in eager. A rewrite tracing through it is then one
update behind on every such BatchNorm from its first step, running means drifting.

So the checkpoint functions are recorded as single calls (``torch.fx``'s autowrap), and the
modules passed to them are worked on *on their own* (each a leaf of the trace, rewritten in
its own forward), so the checkpoint runs them -- fused -- as eager runs them, recompute
included.
"""
from __future__ import annotations

from typing import Dict

import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint

__all__ = ["CHECKPOINT_FUNCTIONS", "keep_checkpoint_calls", "checkpointed_modules"]

CHECKPOINT_FUNCTIONS = (torch_checkpoint.checkpoint, torch_checkpoint.checkpoint_sequential)


def keep_checkpoint_calls(tracer: fx.Tracer) -> None:
    """Make ``tracer`` record the checkpoint functions as single calls, however the model's code
    names them (``checkpoint(...)`` imported, or ``torch.utils.checkpoint.checkpoint(...)``)."""
    tracer._autowrap_function_ids.update(id(f) for f in CHECKPOINT_FUNCTIONS)  # type: ignore[attr-defined]
    if torch_checkpoint not in tracer._autowrap_search:  # type: ignore[attr-defined]
        tracer._autowrap_search.append(torch_checkpoint)  # type: ignore[attr-defined]


def checkpointed_modules(graph: fx.Graph, root: "torch.nn.Module") -> Dict[str, str]:  # noqa: F821
    """Qualified name -> reason, for each submodule of ``root`` a checkpoint call in ``graph`` runs.

    The calls lose ``torch.fx``'s autowrap mark: generated code would otherwise register the
    dotted name ``torch.utils.checkpoint.checkpoint`` with ``torch.fx.wrap``, which every later
    trace in the process then fails to look up."""
    found: Dict[str, str] = {}
    modules = dict(root.named_modules())

    def visit(arg: object) -> None:
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and str(arg.target) in modules:
            found[str(arg.target)] = "run by torch.utils.checkpoint (converted on its own, recompute included)"

    for node in graph.nodes:
        if node.op == "call_function" and node.target in CHECKPOINT_FUNCTIONS:
            node.meta.pop("is_wrapped", None)
            fx.node.map_arg((node.args, node.kwargs), visit)
    return found
