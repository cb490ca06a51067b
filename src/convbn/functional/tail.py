"""Element-wise tail operations after a fused BatchNorm: PReLU and dropout.

A fused layer's *tail* is the sequence of element-wise ops between its BatchNorm and
the next convolution (or the chain's output). Besides the :class:`Activation` records
of :mod:`convbn.functional.activations`, a tail may hold

* :class:`PReLUOp`: ``torch.prelu`` with a learnable weight (one value or one per
  channel), a parameter of the chain;
* :class:`DropoutOp`: one of the ``torch.nn.functional`` dropouts in training with
  ``0 < p``, replayed in backward from the RNG state captured in forward.

Everything here is per-call and static (value objects): what a module's training flag
and ``p`` mean is decided by :func:`tail_op_from_module` when the chain is called.

# Note: [dropout in a chain]
# Eager dropout draws its mask from the global RNG. A fused chain must leave that stream
# exactly as eager does and must use the very same mask. Two ways: keep the mask (at
# best 1 bit, in practice a 1-byte bool per element, plus a pack/unpack pass), or keep
# only the RNG state from just before the dropout call (a few KiB, independent of the
# tensor size) and regenerate the mask in backward. We regenerate, as
# ``torch.utils.checkpoint`` does with ``preserve_rng_state``: forward captures the CPU
# generator's state (and the CUDA one on CUDA) and then runs *the same functional op
# eager runs* on the BN output, so the global stream advances exactly as in eager. In
# backward a private generator holding that state is drawn from (the global stream, and
# what other threads draw from it, is left alone; CUDA's fused dropout kernel takes no
# generator: there the state is restored inside ``torch.random.fork_rng``) and the same op runs on a tensor of ones with z's shape, dtype and strides:
# the op draws the same noise, and ``ones * noise`` is the noise itself, bit for bit,
# which is what eager's backward multiplies the gradient by (``input * noise``). The
# rebuilt layer output (the next conv's input) is the same op on the recomputed z under
# the same restored state. The alpha dropouts add a shift (``input * a * m + b``): the
# slope ``a * m`` is read from the shift alone (``b`` takes two values, larger where kept)
# by running the op on zeros. Cost: no saved bytes; one RNG pass and one transient
# tensor per dropout per rebuild in backward.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .activations import Activation, activation_from_module
from .private_rng import active_private_rng, private_rng

__all__ = ["PReLUOp", "DropoutOp", "TailOp", "RNGState", "tail_op_from_module", "is_tail_module",
           "capture_rng", "replay_rng", "dropout_draw", "DROPOUT_FUNCTIONS"]

aten = torch.ops.aten

#: dropout module class -> the ``torch.nn.functional`` function its forward calls
DROPOUT_FUNCTIONS = {
    nn.Dropout: "dropout",
    nn.Dropout1d: "dropout1d",
    nn.Dropout2d: "dropout2d",
    nn.Dropout3d: "dropout3d",
    nn.AlphaDropout: "alpha_dropout",
    nn.FeatureAlphaDropout: "feature_alpha_dropout",
}

#: (CPU generator state, CUDA generator state or ``None``, CUDA device index or ``None``)
#: ``(CPU state, CUDA state, CUDA device index, drawn from a check's private generators)``
RNGState = Tuple[Tensor, Optional[Tensor], Optional[int], bool]


@dataclass(frozen=True)
class PReLUOp:
    """``torch.prelu(z, w)``: ``z`` where positive, ``w * z`` elsewhere; ``w`` is a chain parameter.

    Attributes:
        num_parameters: ``1`` (one slope) or the channel count (one slope per channel).

    Example:
        >>> PReLUOp(1)(torch.tensor([-2.0, 3.0]), torch.tensor([0.25]))
        tensor([-0.5000,  3.0000])
    """

    num_parameters: int = 1

    def _weight(self, z: Tensor, w: Tensor) -> Tensor:
        # as ``torch.prelu``: a per-channel weight is viewed along dim 1
        if w.numel() != 1 and z.dim() >= 2:
            return w.reshape([1, w.numel()] + [1] * (z.dim() - 2))
        return w

    def __call__(self, z: Tensor, w: Tensor) -> Tensor:
        """Forward (the op ``F.prelu`` dispatches to)."""
        return aten._prelu_kernel(z, self._weight(z, w))

    def reference(self, z: Tensor, w: Tensor) -> Tensor:
        """Differentiable forward (double backward)."""
        return torch.prelu(z, w)

    def backward(self, grad_out: Tensor, z: Tensor, w: Tensor, need_w: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """``(grad_z, grad_w)`` with PyTorch's own kernel; ``grad_w`` reduced to ``w``'s shape
        as autograd reduces a broadcast gradient."""
        wv = self._weight(z, w)
        gz, gw = aten._prelu_kernel_backward(grad_out, z, wv)
        return gz, (gw.sum_to_size(wv.shape).reshape(w.shape) if need_w else None)

    def __str__(self) -> str:
        return "prelu" if self.num_parameters == 1 else f"prelu({self.num_parameters})"


@dataclass(frozen=True)
class DropoutOp:
    """A training-mode dropout (``0 < p``) by its functional name (Note: [dropout in a chain]).

    Attributes:
        fn: one of the values of :data:`DROPOUT_FUNCTIONS`.
        p: the drop probability.
        inplace: the module's ``inplace`` flag (the in-place op draws its noise differently
            on CUDA, so it is run as eager runs it).
    """

    fn: str
    p: float
    inplace: bool = False

    def __post_init__(self) -> None:
        if self.fn not in DROPOUT_FUNCTIONS.values():
            raise ValueError(f"dropout fn must be one of {tuple(DROPOUT_FUNCTIONS.values())}, but got {self.fn!r}")
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got p={self.p}")

    @property
    def alpha(self) -> bool:
        return "alpha" in self.fn

    def __call__(self, z: Tensor, inplace: Optional[bool] = None) -> Tensor:
        """The functional op eager's module runs (training mode); draws from the global RNG."""
        ip = self.inplace if inplace is None else inplace
        return getattr(F, self.fn)(z, self.p, True, ip)

    def slope(self, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """``d out / d z`` of the last call on a ``z`` of this size, strides, dtype and device,
        regenerated: call under :func:`replay_rng` with the state captured before that call."""
        if self.p == 1.0:  # every dropout returns ``input * 0`` and draws nothing
            return torch.zeros(size, dtype=dtype, device=device)
        like = torch.empty_strided(size, stride, dtype=dtype, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager already warned (e.g. dropout2d on 3-D input)
            if not self.alpha:
                return self(like.fill_(1.0))  # ones * noise == noise
            shift = self(like.zero_())  # b: larger where kept
        del like
        alpha = 1.7580993408473766  # SELU's -scale * alpha, the alpha dropouts' saturation value
        a = 1.0 / ((alpha * alpha * self.p + 1) * (1 - self.p)) ** 0.5
        kept = shift > alpha * a * self.p - alpha * a / 2
        return kept.to(dtype).mul_(a)

    def __str__(self) -> str:
        return f"{self.fn}({self.p})"


TailOp = Union[Activation, PReLUOp, DropoutOp]


def is_tail_module(module: nn.Module) -> bool:
    """Whether ``module`` is an element-wise op a chain's tail can hold (activation, PReLU, dropout)."""
    return (activation_from_module(module) is not None or _prelu(module) or _dropout_fn(module) is not None)


def _prelu(module: nn.Module) -> bool:
    return isinstance(module, nn.PReLU) and type(module).forward is nn.PReLU.forward


def _dropout_fn(module: nn.Module) -> Optional[str]:
    for cls, fn in DROPOUT_FUNCTIONS.items():  # the classes do not subclass one another
        if isinstance(module, cls) and type(module).forward is cls.forward:
            return fn
    return None


def tail_op_from_module(module: Union[Activation, nn.Module]) -> Optional[TailOp]:
    """The per-call op of a tail element, read now (``training``, ``p``), or ``None`` for an
    identity (an identity activation, a dropout in eval mode or with ``p == 0``).

    Raises:
        TypeError: ``module`` is not an element-wise op a tail can hold.

    Example:
        >>> tail_op_from_module(nn.Dropout(0.5).eval()) is None
        True
    """
    if isinstance(module, Activation):
        return None if module.is_identity else module
    act = activation_from_module(module)
    if act is not None:
        return None if act.is_identity else act
    if _prelu(module):
        return PReLUOp(int(module.num_parameters))
    fn = _dropout_fn(module)
    if fn is not None:
        p = float(module.p)  # type: ignore[arg-type]
        if not module.training or p == 0.0:
            return None
        return DropoutOp(fn, p, bool(module.inplace))
    raise TypeError(
        f"a chain's tail holds activations, nn.PReLU and dropout modules, but got {type(module).__name__}"
    )


def capture_rng(t: Tensor) -> RNGState:
    """The state of the generator a dropout on ``t`` will draw from: the global one (CPU
    always, CUDA on CUDA), or a check's own (Note: [a check's random numbers are its own])."""
    mode = active_private_rng()
    if t.device.type == "cuda":
        idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if mode is not None:
            return mode.generator(torch.device("cuda", idx)).get_state(), None, idx, True
        return torch.get_rng_state(), torch.cuda.get_rng_state(idx), idx, False
    if mode is not None:
        return mode.generator(torch.device("cpu")).get_state(), None, None, True
    return torch.get_rng_state(), None, None, False


@contextmanager
def replay_rng(state: RNGState) -> Iterator[None]:
    """Run the body drawing from ``state`` without touching the global streams: on CPU, and
    for what a check drew, from a private generator holding that state (what other threads
    draw meanwhile is untouched); a dropout drawn from CUDA's global stream (its fused kernel)
    with the global state set inside ``torch.random.fork_rng``."""
    cpu, cuda, idx, private = state
    if private or idx is None:
        device = torch.device("cpu") if idx is None else torch.device("cuda", idx)
        with private_rng(0) as mode:
            mode.generator(device).set_state(cpu)
            yield
        return
    with torch.random.fork_rng(devices=[idx], enabled=True):
        torch.set_rng_state(cpu)
        torch.cuda.set_rng_state(cuda, idx)
        yield


def dropout_draw(op: "DropoutOp", z: Tensor, owned: bool, capture: Optional[List[RNGState]] = None,
                 states: Optional[Iterator[RNGState]] = None) -> Tensor:
    """``op`` on ``z`` as a chain's tail runs it (Note: [dropout in a chain]): an in-place dropout
    on a copy unless ``z``'s buffer is the caller's own (``owned``); a recompute (``states``
    given) draws from its next captured state, leaving the global streams alone; otherwise the
    draw is eager's, its state appended to ``capture`` first where given."""
    if op.inplace and not owned:
        z = z.clone()
    if states is not None:
        with replay_rng(next(states)):
            return op(z)
    if capture is not None:
        capture.append(capture_rng(z))
    return op(z)
