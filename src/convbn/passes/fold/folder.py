"""What the graph folder works in: the traced GraphModule, the module it was traced from,
its qualified name and the whole fold's context (report, ranks seen in the sample run),
with the weight installer for that graph. The stages that fold in it are
:mod:`convbn.passes.fold.stages`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Set, Tuple, Union

import torch.fx as fx
from torch import nn

from ..report.fold_report import FoldReport
from .install import WeightInstaller
from .match import FoldLayer, match_layer, qualified

__all__ = ["FoldContext", "GraphFolder"]


@dataclass
class FoldContext:
    report: FoldReport
    inplace: bool
    bn_input_ranks: Dict[int, Set[int]]   # id(BN module) -> ranks of its inputs (sample run)
    linear_out_ranks: Dict[int, Set[int]]  # id(Linear module) -> ranks of its outputs
    #: id(module) -> (args, kwargs) of its first call in a sample run (shape capture), when known
    called: Optional[Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any]]]] = None


class GraphFolder:
    """Folds the BatchNorms of one traced GraphModule (``prefix``: its qualified name)."""

    def __init__(self, gm: fx.GraphModule, root: nn.Module, prefix: str, ctx: FoldContext) -> None:
        self.gm = gm
        self.root = root  # the traced module (gm only holds the parts the graph uses)
        self.prefix = prefix
        self.ctx = ctx
        self.installer = WeightInstaller(gm, prefix, ctx.inplace)

    @property
    def changed(self) -> bool:
        """Whether a BatchNorm was folded (the graph changed)."""
        return self.installer.changed

    def qual(self, target: str) -> str:
        return qualified(self.prefix, target)

    def layer(self, node: Any) -> Union[FoldLayer, str]:
        """The conv/linear applied by ``node``, or a reason string why it is none."""
        return match_layer(node, self.gm, self.prefix)
