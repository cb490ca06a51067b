"""The chain under ``torch.compile`` as ops inductor can fuse, its saved set kept by a
selective-checkpoint policy.

# Note: [a chain inductor can see into]
# The custom op (Note: [why a custom op under torch.compile]) keeps the chain's saved set
# exactly, but inductor fuses nothing inside it: each BN, activation and their backward
# stay separate ATen kernels, and a compiled converted model ran at 2.2x of compiled eager
# on an H100 (BENCHMARKS.md "Issue 25: the GPU table"). Here a plain chain (conv -> BN with
# batch statistics -> activation per layer) is written as differentiable ops inside
# ``torch.utils.checkpoint`` with a selective policy that states the plan to the
# partitioner:
#
#     convolution of a ``recompute_bn`` layer     MUST_SAVE       (the kept ``y``)
#     convolution of a ``recompute_conv`` layer   MUST_RECOMPUTE  (recomputed in backward)
#     batch statistics (mean, variance)           MUST_SAVE       (per channel: small)
#     everything else (normalise, affine, act)    PREFER_RECOMPUTE
#
# so what backward keeps is the chain input, the kept conv outputs and the statistics,
# as in the eager chain, while inductor fuses the normalisation, the activation and their
# backward into the kernels around them. The running statistics are updated outside the
# region (unbiased variance, ``lerp_`` by the momentum factor, as ``native_batch_norm``),
# never twice by a recompute. Float rounding: inductor's, like compiled eager's.
#
# Tails of PReLUs and dropouts with p = 0, and transposed convolutions, run in the region
# too. Chains with anything else (other tails, heads, linear layers, no batch statistics, a
# process group, a momentum tensor) keep the custom op. On the CPU each convolution in the
# region is the opaque ``convbn::conv`` (Note: [a conv inductor cannot re-layout] in
# autograd/conv_op.py): a visible ``aten.convolution`` made inductor save a channels_last
# copy of every conv weight for backward, as it does compiling eager.
#
# The default under compile, as measured (BENCHMARKS.md "Issue 25"), against the op:
#   H100, ResNet-50 b128 fp32:  0.77x eager (1.20x compiled eager), the op 1.41x eager;
#   CPU, U-Net 2d b8 128²:      1.15x compiled eager at 0.79x its peak, the op 2.0x at 1.10x;
#   CPU, ResNet-18 b8 112²:     1.03x compiled eager at 0.89x its peak, the op 1.02x at
#                               0.71x (inductor's weight copies, above, were the difference;
#                               with ``convbn::conv``: 0.91x compiled eager at 0.63x its peak,
#                               BENCHMARKS.md "Issue 42").
# ``with compile_chains("op"):`` (or ``CONVBN_COMPILE_CHAINS=op``) selects the op.
#
# torch logs a one-time advisory when a ``context_fn`` reaches a checkpoint under compile:
# make sure the region holds no in-place op. This region holds none (activations are
# applied out of place), so :class:`_OwnRegionAdvisory` drops that record when the
# ``context_fn`` is this module's; a user's own still logs it. (torch prints it once per
# process: where convbn's region was compiled first, the once has been spent.)
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from typing import Any, Callable, List, Literal, Optional, Sequence, Tuple, get_args, overload

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .._compat import SAC_ADVISORY_LOGGER
from ..functional.deprecation import warn_renamed
from ..functional.tail import DropoutOp, PReLUOp
from .chain_spec import ChainLayerSpec, param_offsets, split_params

__all__ = ["CompileChainsMode", "compile_chains", "compile_chains_mode", "set_compile_chains", "fusible_by_inductor",
           "chain_inductor_apply", "chain_contexts", "quiet_own_advisory", "hides_conv_layout",
           "chain_convolution"]

CompileChainsMode = Literal["inductor", "op"]
_MODES: Tuple[CompileChainsMode, ...] = get_args(CompileChainsMode)
_STATE: dict = {"mode": None}  # None: ``CONVBN_COMPILE_CHAINS`` decides, read when asked
_UNSET: Any = object()


def _check_mode(mode: Any, who: str) -> CompileChainsMode:
    if mode not in _MODES:
        raise ValueError(f"{who} expects one of {_MODES}, but got {mode!r}")
    return mode


class _CompileChains(contextlib.ContextDecorator):
    """The context manager :func:`compile_chains` returns."""

    def __init__(self, mode: CompileChainsMode) -> None:
        self.mode = _check_mode(mode, "compile_chains")
        self._saved: List[Optional[str]] = []  # one per open block: re-entrant, nestable

    def __enter__(self) -> "_CompileChains":
        self._saved.append(_STATE["mode"])
        _STATE["mode"] = self.mode
        return self

    def __exit__(self, *exc: Any) -> None:
        _STATE["mode"] = self._saved.pop()  # None again where the environment decided


@overload
def compile_chains(mode: CompileChainsMode) -> _CompileChains: ...
@overload
def compile_chains() -> str: ...
def compile_chains(mode: Any = _UNSET) -> Any:
    """How fused chains run under ``torch.compile`` inside a ``with`` block (or a decorated function).

    ``"inductor"`` (the default): plain ops in a selective checkpoint that inductor fuses;
    ``"op"``: one opaque custom op per chain. Outside every block the
    environment variable ``CONVBN_COMPILE_CHAINS`` decides (read when a graph is compiled),
    else ``"inductor"``. The mode is read when ``torch.compile`` traces a graph: compile (make
    the first call) inside the block; graphs compiled before keep their mode.

    Thread safety: like ``torch.backends.cudnn.flags()``, the switch is process-wide: while a
    block is open every thread compiles with its mode. Open and close blocks in one thread;
    nested blocks restore the previous mode in order, on exit and on an exception.

    Args:
        mode: ``"inductor"`` or ``"op"``.

    Returns:
        A context manager (also usable as a decorator). Called without ``mode``
        (deprecated): the current mode, as :func:`compile_chains_mode`.

    Example:
        >>> with compile_chains("op"):
        ...     compile_chains_mode()
        'op'
    """
    if mode is _UNSET:
        warn_renamed("compile_chains() without a mode", "compile_chains_mode()")
        return compile_chains_mode()
    return _CompileChains(mode)


def compile_chains_mode() -> str:
    """The mode fused chains compile with now: the innermost :func:`compile_chains` block's,
    else the environment's ``CONVBN_COMPILE_CHAINS`` (read now), else ``"inductor"``.

    Example:
        >>> compile_chains_mode() in ("inductor", "op")
        True
    """
    mode = _STATE["mode"] if _STATE["mode"] is not None else os.environ.get("CONVBN_COMPILE_CHAINS", "inductor")
    return mode if mode in _MODES else "inductor"


def set_compile_chains(mode: str) -> str:
    """Deprecated: use ``with convbn.compile_chains(mode):``. Sets the mode for the process
    (until set again) and returns the previous one.

    Args:
        mode: ``"op"`` or ``"inductor"``.

    Returns:
        The previous mode.
    """
    warn_renamed("set_compile_chains(mode)", "with convbn.compile_chains(mode): ...")
    _check_mode(mode, "set_compile_chains")
    prev, _STATE["mode"] = compile_chains_mode(), mode
    return prev

_aten = torch.ops.aten
_STATS_OPS = {_aten.var_mean.correction}


def fusible_by_inductor(specs: Sequence[ChainLayerSpec]) -> bool:
    """Whether a chain can run as plain ops under a selective checkpoint (Note above)."""
    return all(
        s.conv is not None and not s.conv.is_linear and s.bn is not None
        and s.bn.batch_stats and s.bn.process_group is None and not isinstance(s.bn.momentum, Tensor)
        and all(_plain_tail_op(op) for op in s.tail)
        for s in specs
    )


def _plain_tail_op(op: Any) -> bool:
    """A tail op the region runs as a plain op: a PReLU, or a dropout that drops nothing (p = 0,
    as MONAI's blocks build by default); a dropout that draws is left to the custom op."""
    return isinstance(op, PReLUOp) or (isinstance(op, DropoutOp) and op.p == 0.0)


def hides_conv_layout(x: Tensor) -> bool:
    """Whether a compiled chain on ``x``'s device runs its convolutions as ``convbn::conv``
    (Note: [a conv inductor cannot re-layout] in :mod:`convbn.autograd.conv_op`): on the CPU,
    where inductor takes the layout optimisation for a training graph with convolutions (with
    oneDNN always) and saves channels_last weight copies. A device check only: Dynamo traces
    it without a graph break (``torch.backends.mkldnn.is_available`` would break the graph)."""
    return x.device.type == "cpu"


def chain_convolution(x: Tensor) -> Callable[..., Tensor]:
    """The convolution a compiled chain region on ``x``'s device calls, with
    ``torch.convolution``'s arguments: ``convbn::conv`` where :func:`hides_conv_layout`, else
    ``torch.convolution``."""
    if hides_conv_layout(x):
        from .conv_op import conv_op  # registers ``convbn::conv`` on first use

        return conv_op
    return torch.convolution


def _is_conv(op: Any) -> bool:
    return op is _aten.convolution.default or (hasattr(torch.ops, "convbn") and op is getattr(
        getattr(torch.ops.convbn, "conv", None), "default", None))


def chain_contexts(keep_y: Tuple[bool, ...]) -> Any:
    """The selective-checkpoint contexts of one call (a module-level function: Dynamo takes a
    ``functools.partial`` of one as ``context_fn``, not a closure)."""
    seen = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if _is_conv(op):
            i = seen[ctx.is_recompute]
            seen[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if keep_y[i % len(keep_y)] else CheckpointPolicy.MUST_RECOMPUTE
        if op in _STATS_OPS:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _OwnRegionAdvisory(logging.Filter):
    """Drops torch's one-time "context_fn ... under torch.compile" advisory where the
    ``context_fn`` is :func:`chain_contexts` (Note above); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "context_fn is passed to torch.utils.checkpoint" not in str(record.msg):
            return True
        frame = sys._getframe(1)
        while frame is not None:  # the caller that holds the region's context_fn
            fn = frame.f_locals.get("context_fn") if "checkpoint" in frame.f_code.co_name else None
            if fn is not None:
                return not (isinstance(fn, functools.partial) and fn.func is chain_contexts)
            frame = frame.f_back  # type: ignore[assignment]
        return True


_ADVISORY_FILTER = _OwnRegionAdvisory()


def quiet_own_advisory() -> None:
    """Attach :class:`_OwnRegionAdvisory` to torch's checkpoint logger (once): called where a
    fused chain is built, never on ``import convbn``; it drops only the advisory about convbn's
    own ``context_fn``."""
    logger = logging.getLogger(SAC_ADVISORY_LOGGER)
    if _ADVISORY_FILTER not in logger.filters:
        logger.addFilter(_ADVISORY_FILTER)


def _body(specs: Sequence[ChainLayerSpec]) -> Callable[..., Tuple[Tensor, ...]]:
    off = param_offsets(specs)

    def run(x: Tensor, *params: Optional[Tensor]) -> Tuple[Tensor, ...]:
        stats: List[Tensor] = []
        conv = chain_convolution(x)  # Note: [a conv inductor cannot re-layout]
        for i, spec in enumerate(specs):
            w, b, g, beta, tail_weights = split_params(spec, params[off[i]: off[i + 1]])
            if i > 0:
                x = spec.conv.pad_input(x)  # type: ignore[union-attr]
            c = spec.conv
            y = conv(x, w, b, list(c.stride), list(c.padding), list(c.dilation),  # type: ignore[union-attr]
                                  c.transposed, c.kernel_output_padding(), c.groups)  # type: ignore[union-attr]
            dims = [0] + list(range(2, y.dim()))
            # statistics and normalisation in float32 at least, as batch norm computes them
            yf = y if y.dtype in (torch.float32, torch.float64) else y.float()
            var, mean = torch.var_mean(yf, dims, correction=0, keepdim=True)
            z = (yf - mean) * torch.rsqrt(var + spec.bn.eps)  # type: ignore[union-attr]
            if g is not None:
                shape = [1, -1] + [1] * (y.dim() - 2)
                z = z * g.view(shape) + beta.view(shape)  # type: ignore[union-attr]
            x = spec.act(z.to(y.dtype))
            weights = iter(tail_weights)
            for op in spec.tail:  # PReLU, or a dropout with p = 0 (identity): fusible_by_inductor
                if isinstance(op, PReLUOp):
                    x = torch.prelu(x, next(weights))
            n = y.numel() // y.shape[1]
            stats += [mean.detach().flatten(), (var.detach() * (n / max(n - 1, 1))).flatten()]  # unbiased, as eager's
        return (x, *stats)

    return run


def chain_inductor_apply(x: Tensor, params: Sequence[Optional[Tensor]], specs: Sequence[ChainLayerSpec],
                         stats: Sequence[Tuple[Optional[Tensor], Optional[Tensor]]]) -> Tensor:
    """Run a chain :func:`fusible_by_inductor` accepts as plain ops in a selective checkpoint
    (Note: [a chain inductor can see into]); running statistics updated as eager's."""
    keep = [s.keep_y for s in specs]
    out, *moments = checkpoint(_body(specs), x, *params, use_reentrant=False, context_fn=functools.partial(chain_contexts, tuple(keep)))
    with torch.no_grad():
        for i, (spec, (rm, rv)) in enumerate(zip(specs, stats)):
            if rm is not None and rv is not None:
                m = float(spec.bn.momentum)  # type: ignore[union-attr]
                rm.lerp_(moments[2 * i].to(rm.dtype), m)
                rv.lerp_(moments[2 * i + 1].to(rv.dtype), m)
    return out
