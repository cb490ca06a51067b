"""What a pass did with one BatchNorm: the record both reports list, one per BatchNorm.

:func:`convbn.convert` fuses a BatchNorm into a chain, :func:`convbn.fold` folds it into a
neighbouring layer; either pass may leave it as it was, and then says why. Both reports
(:class:`~convbn.passes.report.convert_report.ConvertReport` and
:class:`~convbn.passes.report.fold_report.FoldReport`) expose the same list of
:class:`BNOutcome` records as ``outcomes``: one per BatchNorm module or ``batch_norm``
call the pass found, and one per BatchNorm module it never reached. Convert lists a
BatchNorm module once however often it is called (a shared one is left: its running
statistics would be updated per call); fold lists each call, since a module applied twice
is an affine map that may fold into two different layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Literal, Optional, Sequence, Tuple, get_args

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..bn.frozen import frozen_bn_ranks, frozen_bn_reason
from ..bn.ghost import ghost_bn_reason

__all__ = ["BNOutcome", "Direction", "OutcomeResult", "OUTCOME_RESULTS", "DIRECTIONS", "bn_module_names", "norm_module_names", "unreached", "frozen_lookalikes",
           "explain_ghost_loops"]

#: what can happen to a BatchNorm: fused (convert), folded (fold), left as it was (either)
OutcomeResult = Literal["fused", "folded", "left"]
OUTCOME_RESULTS: Tuple[OutcomeResult, ...] = get_args(OutcomeResult)
#: where the layer sits: ``"preceding"`` -- it runs before the BatchNorm (Conv -> BN);
#: ``"following"`` -- it reads the BatchNorm's output (BN [-> act] -> Conv: fold into the
#: next conv, or convert's pre-activation head)
Direction = Literal["preceding", "following"]
DIRECTIONS: Tuple[Direction, ...] = get_args(Direction)


@dataclass(frozen=True)
class BNOutcome:
    """What happened to one BatchNorm (a module, or a functional ``batch_norm`` call).

    Attributes:
        batchnorm: qualified name of the BatchNorm module in the input model, or a
            description of a functional ``batch_norm`` call.
        result: ``"fused"`` (convert: in a fused chain), ``"folded"`` (fold: absorbed by a
            conv / linear) or ``"left"`` (either pass: computed as before).
        layer: qualified name of the conv / linear it was fused or folded with; for a
            BatchNorm left as it was, the layer the pass considered, if it got that far.
        direction: ``"preceding"`` or ``"following"`` (see :data:`DIRECTIONS`); ``None``
            when left.
        reason: why it was left; for a fused or folded one an optional note (e.g. fold made
            a fresh copy of a layer that is also used elsewhere).

    Example:
        >>> o = BNOutcome("bn1", "folded", "conv1", "preceding")
        >>> o.folded, o.left
        (True, False)
    """

    batchnorm: str
    result: OutcomeResult
    layer: Optional[str] = None
    direction: Optional[Direction] = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.result not in OUTCOME_RESULTS:
            raise ValueError(f"result must be one of {OUTCOME_RESULTS}, but got result={self.result!r}")
        if self.direction is not None and self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS} or None, but got direction={self.direction!r}")
        if self.result == "left" and not self.reason:
            raise ValueError(f"a BatchNorm left as it was needs the reason why ({self.batchnorm})")

    @property
    def left(self) -> bool:
        """The BatchNorm still computes as before."""
        return self.result == "left"

    @property
    def folded(self) -> bool:
        """Folded away by :func:`convbn.fold` (the field fold's reports always had)."""
        return self.result == "folded"

    # the names convert's skipped-BatchNorm lines had, so ``report.skipped`` reads as before
    @property
    def bn(self) -> str:
        """Same as :attr:`batchnorm`."""
        return self.batchnorm

    @property
    def conv(self) -> Optional[str]:
        """Same as :attr:`layer`."""
        return self.layer


def bn_module_names(model: nn.Module) -> List[List[str]]:
    """The qualified names of each BatchNorm module of ``model`` (a ``_BatchNorm`` or a frozen
    BatchNorm), all its names where it is registered more than once, in
    ``model.named_modules()`` order.

    Example:
        >>> bn = nn.BatchNorm2d(4)
        >>> bn_module_names(nn.Sequential(nn.Conv2d(3, 4, 1), bn, bn))
        [['1', '2']]
    """
    names: Dict[int, List[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, _BatchNorm) or frozen_bn_ranks(m):
            names.setdefault(id(m), []).append(name)
    return list(names.values())


def norm_module_names(model: nn.Module) -> List[List[str]]:
    """:func:`bn_module_names` for every norm :func:`convbn.convert` fuses: BatchNorm modules
    and the per-sample norms of a norm-table row (``GroupNorm``, ``InstanceNorm*``), all names of each, in ``model.named_modules()`` order. Convert's report
    ends with :func:`unreached` over these, so a per-sample norm the pass never reached (a lone
    child of a module that could not be traced) is listed ``left`` as a BatchNorm is. A plain
    ``nn.LayerNorm`` is not listed: most normalise tokens, not a convolution's channels, and a
    channel LayerNorm is reported where its permutes are matched.

    Example:
        >>> gn = nn.GroupNorm(2, 4)
        >>> norm_module_names(nn.Sequential(nn.Conv2d(3, 4, 1), gn, nn.BatchNorm2d(4)))
        [['1'], ['2']]
    """
    from ...functional.norms import row_of_module  # the table imports nothing of the passes

    names: Dict[int, List[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if (isinstance(m, _BatchNorm) or row_of_module(m) is not None
                or frozen_bn_ranks(m)):
            names.setdefault(id(m), []).append(name)
    return list(names.values())


def unreached(bn_names: Sequence[Sequence[str]], outcomes: Sequence[BNOutcome], untraced: Iterable[str],
              traced: Iterable[str] = (), errors: Optional[Dict[str, str]] = None) -> List[BNOutcome]:
    """A ``"left"`` outcome for every BatchNorm module that ``outcomes`` name under none of its
    names: the pass never reached it, either inside a module it could not trace or because
    the traced forward never calls it. Both passes end with this, so every BatchNorm module
    has an outcome.

    Args:
        bn_names: every BatchNorm module's names (:func:`bn_module_names` of the model the
            pass was given, taken before the pass changed it).
        outcomes: the outcomes the pass recorded.
        untraced: qualified names of modules that could not be traced as a whole (``""``:
            the model itself).
        traced: qualified names of modules traced whole, where the pass records them.
        errors: why each untraced module could not be traced (its trace error, shortened),
            where the pass records it; the reason then says it.

    Returns:
        The outcomes to add, in the order of ``bn_names``.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
        >>> [o.batchnorm for o in unreached(bn_module_names(net), [], untraced=[""])]
        ['1']
    """
    seen = {o.batchnorm for o in outcomes}
    whole = {m: True for m in traced}
    whole.update({m: False for m in untraced})
    left = []
    for aliases in bn_names:
        if seen.intersection(aliases):
            continue
        name = aliases[0]
        # the deepest enclosing module the pass tried to trace ("" is the model)
        owner = max((o for o in whole if o == "" or name.startswith(o + ".")), key=len, default="")
        where = owner or "<root>"
        if whole.get(owner) is False:
            err = (errors or {}).get(owner)
            why = f" ({err})" if err else ""
            reason = f"it is called from '{where}', which could not be traced as a whole{why}; left as is"
        else:
            reason = (f"it is not called in the traced forward pass of '{where}' (unused, or only reached in a way "
                      "tracing cannot see); left as is")
        left.append(BNOutcome(name, "left", reason=reason))
    return left


def frozen_lookalikes(model: nn.Module, outcomes: Sequence[BNOutcome] = ()) -> List[BNOutcome]:
    """A ``"left"`` outcome for every module that holds a frozen BatchNorm's four buffers but
    is not recognised as one (what it computes is not a batch norm, or its eps cannot be
    read), unless ``outcomes`` already name it: the report lists it with the reason.

    Args:
        model: the model the pass was given (before the pass changed it).
        outcomes: the outcomes the pass recorded.

    Returns:
        The outcomes to add, in ``model.named_modules()`` order.

    Example:
        >>> frozen_lookalikes(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
        []
    """
    seen = {o.batchnorm for o in outcomes}
    left = []
    for name, m in model.named_modules():
        if name in seen:
            continue
        reason = frozen_bn_reason(m)
        if reason is not None:
            left.append(BNOutcome(name or "<root>", "left", reason=reason))
    return left


def _called_more_than_once(reason: str) -> bool:
    """A BatchNorm left for being called several times: a ghost loop a trace with real shapes unrolled."""
    return reason.startswith("the BatchNorm module is called ") and "times" in reason


def explain_ghost_loops(model: nn.Module, outcomes: Sequence[BNOutcome]) -> List[BNOutcome]:
    """``outcomes`` with the reason of each BatchNorm left inside a module that could not be
    traced (or that a trace with real shapes unrolled, the BatchNorm then called once per piece)
    replaced by a precise one where that module's ``forward`` is a ghost BatchNorm loop (:func:`~convbn.passes.bn.ghost.ghost_bn_reason`).

    Args:
        model: the model the pass was given, whose qualified names the outcomes use.
        outcomes: the outcomes the pass recorded.

    Returns:
        The outcomes, in the same order.

    Example:
        >>> explain_ghost_loops(nn.Sequential(nn.BatchNorm2d(4)), [BNOutcome("0", "left", reason="r")])[0].reason
        'r'
    """
    out = []
    for o in outcomes:
        owner_path, _, attr = o.batchnorm.rpartition(".")
        if o.result == "left" and ("could not be traced" in o.reason or _called_more_than_once(o.reason)):
            try:
                owner = model.get_submodule(owner_path)
            except AttributeError:
                owner = None
            why = ghost_bn_reason(owner, attr) if owner is not None else None
            if why is not None:
                o = BNOutcome(o.batchnorm, o.result, o.layer, o.direction, why)
        out.append(o)
    return out
