"""Per-sample normalisations as one table: what each norm computes, read by every layer.

BatchNorm normalises per channel over the whole batch (:mod:`convbn.functional.batchnorm`).
The norms here normalise *per sample*: their statistics never mix samples, so a fused layer
needs no cross-sample state beyond the running statistics some of them track. Each row of
:data:`NORMS` says what one norm computes:

* ``statistics``: the axes its mean and variance run over (for the report and the docs);
* ``modules`` / ``functions``: how a model spells it (``isinstance`` on the module classes
  whose forward is torch's own; the functional calls a traced graph records);
* ``compute``: the eager computation, ``compute(y, call, weight, bias, running_mean,
  running_var)`` on an ``(N, C, *spatial)`` tensor, differentiable, updating running
  statistics in place where ``call`` says so, exactly as torch's module does;
* ``call_of_module`` / ``call_of_args``: the :class:`NormCall` of a module or of a recorded
  functional call (a string reason where it is not this norm or cannot be fused);
* ``fold``: why the norm cannot fold into a neighbouring layer in eval, or ``""`` where it folds.

Matching (``passes/bn/norm_sites.py``), the chain Function (``autograd/norm_chain.py``), the
planner's memory model (a per-sample norm layer is a chain layer like BatchNorm's), the report
and fold read the table; a new norm is one row (``tests/test_norm_table.py`` adds a toy row).

.. math::

    \\text{out} = \\frac{y - \\mathrm{E}[y]}{\\sqrt{\\mathrm{Var}[y] + \\epsilon}} \\cdot \\gamma + \\beta

with the expectation over the row's statistics axes (biased variance; InstanceNorm's running
variance takes the unbiased one, as torch's).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import InstanceNormBase

__all__ = ["NormCall", "NormRow", "NORMS", "norm_row", "row_of_module", "row_of_function", "channel_layer_norm",
           "norm_forward", "norm_reference", "stat_bytes"]


@dataclass(frozen=True)
class NormCall:
    """The static arguments of one per-sample norm call (hashable: part of a chain's structure).

    Attributes:
        row: the :data:`NORMS` row name.
        eps: added to the variance inside the square root.
        groups: GroupNorm's number of groups (1 for the others).
        use_input_stats: normalise with this sample's statistics (``False``: an InstanceNorm in
            eval mode with running statistics, an affine map).
        momentum: running statistics' update factor, where they update.
        normalized: LayerNorm's ``normalized_shape`` (the channels), for its call.
    """

    row: str
    eps: float
    groups: int = 1
    use_input_stats: bool = True
    momentum: float = 0.1
    normalized: Tuple[int, ...] = ()


ModuleCall = Union[NormCall, str, None]


@dataclass(frozen=True)
class NormRow:
    """One per-sample norm (see the module docstring for each field)."""

    name: str
    statistics: str
    compute: Callable[[Tensor, NormCall, Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]], Tensor]
    call_of_module: Callable[[nn.Module], ModuleCall]
    call_of_args: Callable[[Dict[str, Any]], ModuleCall]
    modules: Tuple[type, ...] = ()
    standard_forwards: Tuple[Callable[..., Any], ...] = ()
    functions: Tuple[Callable[..., Any], ...] = ()
    #: the function's parameters by position, ``(name, default)``: how a recorded call is read
    signature: Tuple[Tuple[str, Any], ...] = ()
    fold: Callable[[NormCall, bool], str] = field(default=lambda call, stats: "cannot fold: per-sample statistics")
    #: how many (mean, inverse std) pairs a call on a tensor of this shape computes (the
    #: planner's memory model: what the norm's own backward holds besides its input)
    stat_count: Callable[[NormCall, Tuple[int, ...]], int] = field(default=lambda call, shape: shape[0] * call.groups)
    #: its backward reads its input and statistics, never its output (the chain's backward may
    #: then release the recomputed output: Note: [the norm's output as a root only])
    output_unread: bool = False
    #: its computation repeats the affine weight and bias once per sample (torch's InstanceNorm
    #: runs batch_norm on ``(1, N * C, ...)``): the weight's statistics-sized copy is kept for
    #: backward beside the statistics (the bias's dies with the forward)
    affine_per_sample: bool = False

    def tracks_stats(self, call: NormCall, has_stats: bool) -> bool:
        """Whether a training call updates running statistics (given the module holds them)."""
        return has_stats and call.use_input_stats


# --------------------------------------------------------------------------- group norm

def _group_compute(y: Tensor, call: NormCall, w: Optional[Tensor], b: Optional[Tensor],
                   rm: Optional[Tensor], rv: Optional[Tensor]) -> Tensor:
    return F.group_norm(y, call.groups, w, b, call.eps)


def _group_module(m: nn.Module) -> ModuleCall:
    if not isinstance(m, nn.GroupNorm):
        return None
    return NormCall("group_norm", float(m.eps), int(m.num_groups))


def _group_args(a: Dict[str, Any]) -> ModuleCall:
    groups, eps = a["num_groups"], a["eps"]
    if not isinstance(groups, int) or isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return "its num_groups or eps is computed in forward, not a constant"
    return NormCall("group_norm", float(eps), groups)


# --------------------------------------------------------------------------- instance norm

def _instance_compute(y: Tensor, call: NormCall, w: Optional[Tensor], b: Optional[Tensor],
                      rm: Optional[Tensor], rv: Optional[Tensor]) -> Tensor:
    return F.instance_norm(y, rm, rv, w, b, call.use_input_stats, call.momentum, call.eps)


def _instance_module(m: nn.Module) -> ModuleCall:
    if not isinstance(m, InstanceNormBase):
        return None
    use_input = m.training or not m.track_running_stats
    if not use_input and m.running_mean is None:
        return "it is in eval mode with track_running_stats=True but holds no running statistics"
    momentum = m.momentum if m.momentum is not None else 0.0
    return NormCall("instance_norm", float(m.eps), 1, bool(use_input), float(momentum))


def _instance_args(a: Dict[str, Any]) -> ModuleCall:
    use, momentum, eps = a["use_input_stats"], a["momentum"], a["eps"]
    if not isinstance(use, bool) or isinstance(eps, bool) or not isinstance(eps, (int, float)) \
            or isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        return "its use_input_stats, momentum or eps is computed in forward, not a constant"
    if not use and (a["running_mean"] is None or a["running_var"] is None):
        return "it normalises with running statistics it does not pass"
    return NormCall("instance_norm", float(eps), 1, use, float(momentum))


def _instance_fold(call: NormCall, stats: bool) -> str:
    if stats and not call.use_input_stats:
        return ""
    if stats:
        return "cannot fold: per-sample statistics (an InstanceNorm in training mode normalises each sample by its own)"
    return "cannot fold: per-sample statistics (an InstanceNorm without track_running_stats normalises each sample " \
           "by its own, in eval too)"


# --------------------------------------------------------------------------- channel layer norm

def channel_layer_norm(x: Tensor, normalized_shape: Tuple[int, ...], weight: Optional[Tensor],
                       bias: Optional[Tensor], eps: float) -> Tensor:
    """LayerNorm over the channel dimension of ``(N, C, *spatial)``: the values of
    ``F.layer_norm(x.permute(0, 2, ..., 1), (C,), weight, bias, eps)`` permuted back, computed
    by those very ops (the canonical form a channels-last LayerNorm between permutes and a
    ``LayerNorm2d`` take in a traced graph: ``passes/bn/norm_sites.py``; a hand-written one:
    ``passes/bn/hand_layer_norms.py``). A ``weight`` / ``bias`` stored in a broadcastable shape
    with C elements (``(1, C, 1, 1)``) is read as ``(C,)``.

    Example:
        >>> x = torch.randn(2, 3, 4, 4)
        >>> ref = F.layer_norm(x.permute(0, 2, 3, 1), (3,)).permute(0, 3, 1, 2)
        >>> torch.equal(channel_layer_norm(x, (3,), None, None, 1e-5), ref)
        True
    """
    shape = tuple(normalized_shape)
    if weight is not None and tuple(weight.shape) != shape:  # stored broadcastable, e.g. (1, C, 1, 1)
        weight = weight.reshape(shape)
    if bias is not None and tuple(bias.shape) != shape:
        bias = bias.reshape(shape)
    nd = x.dim()
    to_last = (0, *range(2, nd), 1)
    back = (0, nd - 1, *range(1, nd - 1))
    return F.layer_norm(x.permute(to_last), normalized_shape, weight, bias, eps).permute(back)


def _layer_compute(y: Tensor, call: NormCall, w: Optional[Tensor], b: Optional[Tensor],
                   rm: Optional[Tensor], rv: Optional[Tensor]) -> Tensor:
    return channel_layer_norm(y, call.normalized or (y.shape[1],), w, b, call.eps)


def _layer_module(m: nn.Module) -> ModuleCall:
    return None  # an nn.LayerNorm module normalises the last dimension: a channel norm only between permutes


def _layer_args(a: Dict[str, Any]) -> ModuleCall:
    shape, eps = a["normalized_shape"], a["eps"]
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or len(shape) != 1 or not isinstance(shape[0], int):
        return "it normalises over more than the channel dimension"
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return "its eps is computed in forward, not a constant"
    return NormCall("channel_layer_norm", float(eps), normalized=(int(shape[0]),))


def _prod(shape: Tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


#: the table every layer reads (a row per norm; see the module docstring)
NORMS: List[NormRow] = [
    NormRow("group_norm", "per sample, over each group of channels and all positions",
            _group_compute, _group_module, _group_args,
            modules=(nn.GroupNorm,), standard_forwards=(nn.GroupNorm.forward,), functions=(F.group_norm,),
            output_unread=True,
            fold=lambda call, stats: "cannot fold: per-sample statistics (a GroupNorm normalises each sample by "
                                     "its own, in eval too)",
            signature=(("input", None), ("num_groups", None), ("weight", None), ("bias", None), ("eps", 1e-5))),
    NormRow("instance_norm", "per sample and channel, over all positions",
            _instance_compute, _instance_module, _instance_args,
            modules=(InstanceNormBase,), standard_forwards=(InstanceNormBase.forward,), functions=(F.instance_norm,),
            signature=(("input", None), ("running_mean", None), ("running_var", None), ("weight", None),
                       ("bias", None), ("use_input_stats", True), ("momentum", 0.1), ("eps", 1e-5)),
            fold=_instance_fold, stat_count=lambda call, shape: shape[0] * shape[1], output_unread=True,
            affine_per_sample=True),
    NormRow("channel_layer_norm", "per sample and position, over the channels",
            _layer_compute, _layer_module, _layer_args, functions=(channel_layer_norm,),
            signature=(("input", None), ("normalized_shape", None), ("weight", None), ("bias", None),
                       ("eps", 1e-5)),
            stat_count=lambda call, shape: _prod(shape) // max(shape[1], 1), output_unread=True,
            fold=lambda call, stats: "cannot fold: per-sample statistics (a LayerNorm normalises each position of "
                                     "each sample by its own, in eval too)"),
]


def norm_row(name: str) -> NormRow:
    """The row called ``name``.

    Raises:
        KeyError: no row has that name (it was removed from :data:`NORMS`).
    """
    for row in NORMS:
        if row.name == name:
            return row
    raise KeyError(f"no per-sample norm named {name!r} in convbn.functional.norms.NORMS "
                   f"(rows: {[r.name for r in NORMS]})")


def row_of_module(module: nn.Module) -> Optional[NormRow]:
    """The row whose module classes ``module`` is an instance of, or ``None``."""
    for row in NORMS:
        if row.modules and isinstance(module, row.modules):
            return row
    return None


def row_of_function(fn: Any) -> Optional[NormRow]:
    """The row one of whose functional spellings ``fn`` is, or ``None``."""
    for row in NORMS:
        if any(fn is f for f in row.functions):
            return row
    return None


def stat_bytes(call: NormCall, shape: Tuple[int, ...], element_size: int = 4, weight: bool = False) -> int:
    """Bytes of the statistics (mean and inverse std) a call on ``shape`` computes for its
    backward, with the per-sample copy of its ``weight`` (where given) its row makes."""
    row = norm_row(call.row)
    copies = int(weight and row.affine_per_sample)
    return (2 + copies) * element_size * row.stat_count(call, tuple(shape))


def norm_forward(y: Tensor, call: NormCall, weight: Optional[Tensor], bias: Optional[Tensor],
                 running_mean: Optional[Tensor] = None, running_var: Optional[Tensor] = None) -> Tensor:
    """The norm of ``call`` on ``y`` as its row computes it (running statistics updated where given)."""
    return norm_row(call.row).compute(y, call, weight, bias, running_mean, running_var)


def norm_reference(y: Tensor, call: NormCall, weight: Optional[Tensor], bias: Optional[Tensor],
                   running_mean: Optional[Tensor] = None, running_var: Optional[Tensor] = None) -> Tensor:
    """The same values without touching running statistics: recompute in backward and double
    backward (statistics of this sample where the call uses them, the running ones read only
    where it does not)."""
    if call.use_input_stats:
        running_mean = running_var = None
    return norm_row(call.row).compute(y, call, weight, bias, running_mean, running_var)
