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
* ``fold``: why the norm cannot fold into a neighbouring layer in eval, or ``""`` where it folds;
* ``last_dim``: the torch norm over the last dimension that is this norm between permutes
  (``nn.LayerNorm``, ``nn.RMSNorm``), read by matching where it once named ``nn.LayerNorm``;
* ``stat_count`` / ``stat_tensors`` / ``graph_maps`` / ``output_unread`` / ``affine_per_sample``:
  what its backward holds, read by the planner's memory model (``autograd/norm_chain_memory.py``,
  :func:`stat_bytes`) instead of a norm's name.

Matching (``passes/bn/norm_sites.py``), the chain Function (``autograd/norm_chain.py``), the
planner's memory model (a per-sample norm layer is a chain layer like BatchNorm's), the report
and fold read the table; a new norm is one row (``tests/test_norm_table.py`` adds a toy row).

.. math::

    \\text{out} = \\frac{y - \\mathrm{E}[y]}{\\sqrt{\\mathrm{Var}[y] + \\epsilon}} \\cdot \\gamma + \\beta

with the expectation over the row's statistics axes (biased variance; InstanceNorm's running
variance takes the unbiased one, as torch's). The channel RMSNorm row does not centre:
``y / sqrt(E_c[y^2] + eps) * gamma``, or ``F.normalize``'s ``y / max(||y||, eps) * scale * gamma``,
each spelling computed by its own ops (:func:`channel_rms_norm`, :data:`RMS_FORMS`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import InstanceNormBase

__all__ = ["NormCall", "NormRow", "NORMS", "norm_row", "row_of_module", "row_of_function", "channel_layer_norm",
           "channel_rms_norm", "RMS_FORMS", "LastDimSpelling", "row_of_last_dim_module", "norm_forward",
           "norm_reference", "stat_bytes"]


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
        normalized: LayerNorm's / RMSNorm's ``normalized_shape`` (the channels), for its call.
        form: which of its row's spellings the call computes, where they round differently
            (RMSNorm: :data:`RMS_FORMS`); ``""`` for rows with one.
        scale: a constant factor the spelling multiplies by (RMSNorm's ``F.normalize`` forms:
            ``sqrt(C)``); 1 elsewhere.
    """

    row: str
    eps: float
    groups: int = 1
    use_input_stats: bool = True
    momentum: float = 0.1
    normalized: Tuple[int, ...] = ()
    form: str = ""
    scale: float = 1.0


ModuleCall = Union[NormCall, str, None]


@dataclass(frozen=True)
class LastDimSpelling:
    """A torch norm over the last dimension that is a row's channel norm between permutes
    (``x.permute(0, 2, 3, 1)`` -> ``nn.LayerNorm(C)`` -> permute back; ``passes/bn/norm_sites.py``
    rewrites the three nodes into one call of the row's first function).

    Attributes:
        module: its module class (``isinstance``: a subclass with its own forward that calls
            ``function`` is found through that call).
        function: its functional call.
        signature: ``function``'s parameters by position, ``(name, default)``.
        channel_args: ``(x, normalized_shape, weight, bias, eps) -> arguments`` of the row's
            channel function computing the same values.
    """

    module: type
    function: Callable[..., Any]
    signature: Tuple[Tuple[str, Any], ...]
    channel_args: Callable[[Any, Tuple[int, ...], Any, Any, Any], Tuple[Any, ...]]


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
    #: how many statistics-sized tensors its backward holds (a native norm: mean and inverse
    #: std; an uncentred one computed from differentiable ops: what they save)
    stat_tensors: Callable[[NormCall], int] = field(default=lambda call: 2)
    #: how many input-sized tensors its graph under autograd holds besides its input and output
    #: (a native norm: none; a composite one with a gain: the normalised input the gain's
    #: gradient reads), given whether it has a weight
    graph_maps: Callable[[NormCall, bool], int] = field(default=lambda call, weight: 0)
    #: the torch norm over the last dimension that is this norm between permutes, if any
    last_dim: Optional[LastDimSpelling] = None

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


# --------------------------------------------------------------------------- channel RMSNorm

#: the spellings of a channel RMSNorm, each computed by its own ops (they round differently, and
#: ``F.normalize`` clamps the norm by ``eps`` where the others add ``eps`` to the mean square)
RMS_FORMS: Dict[str, str] = {
    "rsqrt": "x * rsqrt(mean_c(x^2) + eps) * w",
    "sqrt": "x / sqrt(mean_c(x^2) + eps) * w",
    "normalize_gs": "F.normalize(x, dim=1, eps=eps) * w * scale",
    "normalize_sg": "F.normalize(x, dim=1, eps=eps) * scale * w",
    "rms_norm": "F.rms_norm(x channels-last, (C,), w, eps), permuted back",
}


def channel_rms_norm(x: Tensor, normalized_shape: Tuple[int, ...], weight: Optional[Tensor] = None,
                     eps: Optional[float] = None, form: str = "rsqrt", scale: float = 1.0) -> Tensor:
    """RMSNorm over the channel dimension of ``(N, C, *spatial)``, no centring, computed by the
    very ops of the spelling ``form`` names (:data:`RMS_FORMS`; the canonical node the rewrites
    of ``passes/bn/hand_rms_norms.py`` and ``passes/bn/norm_sites.py`` put in a traced graph):

    .. math::

        \\text{out} = \\frac{x}{\\sqrt{\\mathrm{E}_c[x^2] + \\epsilon}} \\cdot \\gamma
        \\quad\\text{or, for } \\texttt{F.normalize}: \\quad
        \\frac{x}{\\max(\\lVert x \\rVert_{2,c}, \\epsilon)} \\cdot s \\cdot \\gamma

    ``weight`` (``γ``) may be stored in any shape with C elements; ``eps=None`` is
    ``F.rms_norm``'s (the input dtype's machine epsilon), 1e-12 for ``F.normalize`` and 1e-6 for
    the hand-written forms where not given.

    Example:
        >>> x, w = torch.randn(2, 3, 4, 4), torch.rand(3)
        >>> ref = F.normalize(x, dim=1) * w.view(1, 3, 1, 1) * 3 ** 0.5
        >>> torch.equal(channel_rms_norm(x, (3,), w, 1e-12, "normalize_gs", 3 ** 0.5), ref)
        True
    """
    if form not in RMS_FORMS:
        raise ValueError(f"form must be one of {sorted(RMS_FORMS)}, but got form={form!r}")
    channels = int(normalized_shape[0])
    if form == "rms_norm":
        w = None if weight is None else weight.reshape(channels)
        nd = x.dim()
        out = F.rms_norm(x.permute(0, *range(2, nd), 1), (channels,), w, eps)
        return out.permute(0, nd - 1, *range(1, nd - 1))
    w = None if weight is None else weight.reshape(1, channels, *([1] * (x.dim() - 2)))
    if form.startswith("normalize"):
        out = F.normalize(x, 2.0, 1, 1e-12 if eps is None else eps)
        s = None if scale == 1.0 else scale  # a product by 1 is the identity, bit for bit
        # the product by the scale is written over its operand, which no backward reads (the
        # gain's product saves the other): the values of ``* scale`` without the map beside it
        if form == "normalize_gs":
            out = out if w is None else out * w
            return out if s is None else out.mul_(s)
        out = out if s is None else out.mul_(s)
        return out if w is None else out * w
    e = 1e-6 if eps is None else eps
    # one expression, as written: no name holds the mean square past its root (a map-sized
    # moment's worth of statistics the model's own code never holds)
    if form == "rsqrt":
        out = x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + e)
    else:
        out = x / torch.sqrt(x.pow(2).mean(1, keepdim=True) + e)
    return out if w is None else out * w


def _rms_compute(y: Tensor, call: NormCall, w: Optional[Tensor], b: Optional[Tensor],
                 rm: Optional[Tensor], rv: Optional[Tensor]) -> Tensor:
    return channel_rms_norm(y, call.normalized or (y.shape[1],), w, call.eps, call.form or "rsqrt", call.scale)


def _rms_args(a: Dict[str, Any]) -> ModuleCall:
    shape, eps, form, scale = a["normalized_shape"], a["eps"], a["form"], a["scale"]
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or len(shape) != 1 or not isinstance(shape[0], int):
        return "it normalises over more than the channel dimension"
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float))):
        return "its eps is computed in forward, not a constant"
    if form not in RMS_FORMS or isinstance(scale, bool) or not isinstance(scale, (int, float)):
        return "its form or scale is computed in forward, not a constant"
    return NormCall("channel_rms_norm", eps if eps is None else float(eps), normalized=(int(shape[0]),),
                    form=str(form), scale=float(scale))


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
            last_dim=LastDimSpelling(nn.LayerNorm, F.layer_norm,
                                     (("input", None), ("normalized_shape", None), ("weight", None), ("bias", None),
                                      ("eps", 1e-5)),
                                     lambda x, shape, w, b, eps: (x, shape, w, b, eps)),
            fold=lambda call, stats: "cannot fold: per-sample statistics (a LayerNorm normalises each position of "
                                     "each sample by its own, in eval too)"),
    NormRow("channel_rms_norm", "per sample and position, the root mean square over the channels (no centring)",
            _rms_compute, lambda m: None, _rms_args, functions=(channel_rms_norm,),
            signature=(("input", None), ("normalized_shape", None), ("weight", None), ("eps", None),
                       ("form", "rsqrt"), ("scale", 1.0)),
            stat_count=lambda call, shape: _prod(shape) // max(shape[1], 1), output_unread=True,
            # what its ops save: rsqrt's output (F.normalize: the norm and its clamp), and the
            # normalised input where a gain multiplies it
            stat_tensors=lambda call: 2 if call.form.startswith("normalize") else 1,
            graph_maps=lambda call, weight: int(weight),
            last_dim=LastDimSpelling(nn.RMSNorm, F.rms_norm,
                                     (("input", None), ("normalized_shape", None), ("weight", None), ("eps", None)),
                                     lambda x, shape, w, b, eps: (x, shape, w, eps, "rms_norm")),
            fold=lambda call, stats: "cannot fold: per-sample statistics (an RMSNorm divides each position of each "
                                     "sample by its own root mean square, in eval too)"),
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


def row_of_last_dim_module(module: nn.Module) -> Optional[NormRow]:
    """The row whose norm ``module`` computes between permutes (an ``nn.LayerNorm``, an
    ``nn.RMSNorm``: :attr:`NormRow.last_dim`), or ``None``."""
    for row in NORMS:
        if row.last_dim is not None and isinstance(module, row.last_dim.module):
            return row
    return None


def row_of_function(fn: Any) -> Optional[NormRow]:
    """The row one of whose functional spellings ``fn`` is, or ``None``."""
    for row in NORMS:
        if any(fn is f for f in row.functions):
            return row
    return None


def stat_bytes(call: NormCall, shape: Tuple[int, ...], element_size: int = 4, weight: bool = False) -> int:
    """Bytes a call on ``shape`` holds for its backward besides its input and output, made with
    its output and released with its graph: the statistics (:attr:`NormRow.stat_tensors`, mean
    and inverse std for a native norm), the per-sample copy of its ``weight`` (where given) its
    row makes, and the input-sized tensors its graph holds (:attr:`NormRow.graph_maps`)."""
    row = norm_row(call.row)
    copies = int(weight and row.affine_per_sample)
    stats = (row.stat_tensors(call) + copies) * element_size * row.stat_count(call, tuple(shape))
    return stats + row.graph_maps(call, weight) * element_size * _prod(tuple(shape))


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
