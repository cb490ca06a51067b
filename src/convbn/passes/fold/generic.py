"""Whether a module's graph traced with real shapes folds anything its children cannot fold alone.

Note: [fold prefers the shape-generic graph]
A module whose own code reads shapes (MONAI's ``UpCat`` compares its skip's spatial size with its
upsampled map's to choose a pad) does not trace symbolically; traced with the real inputs of the
sample run it does, but its graph is *specialised*: the pad widths are constants and the graph
is guarded on the traced shapes. Installed by :func:`convbn.fold`, that guard is what
``torch.export`` / ONNX with a dynamic batch or spatial size then traces, and the export fails
("your code specialized it to be a constant"). Where each BatchNorm of such a graph meets its
neighbours inside one child of the module (``UpCat``'s BatchNorms sit in its ``convs``, next to
their convolutions), folding the children one by one folds the same BatchNorms and leaves the
module's own code as the user wrote it, shape-generic. So fold takes the specialised graph only
where the module's own code joins a BatchNorm to something (the BatchNorm called by the
module's forward, or reading or feeding a node outside its child); otherwise it folds part by
part and says so in the report.
"""
from __future__ import annotations

from typing import Optional

import torch.fx as fx
from torch import nn

from .match import FoldSite, match_bn

__all__ = ["own_code_joins_a_batchnorm"]


def _child_of(node: fx.Node) -> Optional[str]:
    """The child of the traced module that ``node`` computes in (its first path component), or
    ``None`` for a node of the module's own code (an input, an op of its forward)."""
    if node.op in ("call_module", "get_attr"):
        path = str(node.target)
    else:
        stack = node.meta.get("nn_module_stack") or {}
        first = next(iter(stack.values()), None)
        path = first[0] if isinstance(first, tuple) and first and isinstance(first[0], str) else ""
    return path.split(".")[0] or None


def own_code_joins_a_batchnorm(gm: fx.GraphModule, root: nn.Module, prefix: str) -> bool:
    """Whether some BatchNorm that could fold in ``gm`` (traced from ``root``, qualified name
    ``prefix``) is called by ``root``'s own code or exchanges a value with a node outside its own
    child (Note: [fold prefers the shape-generic graph]); ``False`` where folding ``root``'s
    children one by one reaches every such BatchNorm with the same neighbours."""
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function") or not isinstance(match_bn(node, gm, prefix, root), FoldSite):
            continue
        child = _child_of(node)
        if child is None:
            return True
        if any(_child_of(n) != child for n in list(node.all_input_nodes) + list(node.users)):
            return True
    return False
