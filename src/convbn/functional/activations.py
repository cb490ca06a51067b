"""Element-wise activations that a fused layer can apply and recompute.

An activation here is a value object with a forward (optionally in place) and a
backward written against the *pre-activation* ``z`` with PyTorch's own native
derivative kernels (``threshold_backward``, ``silu_backward`` ...), so a fused layer
that recomputes ``z`` in backward never needs the activation's output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Activation", "ACTIVATIONS", "get_activation", "activation_from_module", "activation_from_call",
           "activation_from_method", "activation_functions", "activation_methods", "ArgReader"]

aten = torch.ops.aten

# Note: [one table of activations]
# Every activation is ONE record in ``_TABLE``: its forward (optionally in place), its
# backward against the pre-activation ``z`` with PyTorch's native derivative kernel
# (written into ``z``'s buffer where the kernel has an ``out=`` form), its backward from
# the output where f'(z) is a function of f(z), its nn module classes and how to read a
# module's parameters. A name missing here is a KeyError-style ValueError listing the
# known names, never a silent fallback. Modules match by ``isinstance`` on the record's
# classes only when the subclass keeps the base's ``forward`` (a subclass that computes
# something else is not that activation); ``nn.Hardtanh(0, 6)`` is ``relu6``.
# The record also says how a traced graph spells it -- its ``F.*`` / ``torch.*`` callables
# (in-place variants included) and the parameters read off their arguments, its ``Tensor``
# methods, a callable that is it for some arguments only (``F.hardtanh(x, 0, 6)``) -- and
# whether the compiled element-wise kernels cover it. Matching (passes/convert/match_tail.py),
# folding (passes/fold/layers.py), the kernels (autograd/chain_kernels.py) and the memory
# replay (autograd/chain_memory.py) read these records and keep no list of their own, so an
# activation added here is recognised, folded around, compiled and replayed everywhere.

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


#: an argument of a torch callable spelling an activation: (the ``Activation`` field or
#: module attribute and keyword it fills, its position after the input, its default)
_Param = Tuple[str, int, Any]


@dataclass(frozen=True)
class _Spelling:
    """A torch callable or module class that computes an activation only for some argument
    values: ``F.hardtanh(x, 0.0, 6.0)`` and ``nn.Hardtanh(0, 6)`` are ``relu6``.

    Attributes:
        functions: the callables (in-place variants included).
        modules: the module classes (their attributes named as the keywords).
        params: ``(keyword, position, default)`` of each argument that must hold ``values``.
        values: the argument values that make it this activation.
    """

    functions: Tuple[Callable[..., Any], ...]
    modules: Tuple[type, ...]
    params: Tuple[_Param, ...]
    values: Tuple[Any, ...]


@dataclass(frozen=True)
class _Record:
    forward: Callable[["Activation", Tensor, bool], Tensor]
    backward: Callable[["Activation", Tensor, Tensor], Tensor]
    backward_: Callable[["Activation", Tensor, Tensor], Tensor]
    modules: Tuple[type, ...] = ()
    from_module: Optional[Callable[[Any], Dict[str, Any]]] = None
    backward_from_output_: Optional[Callable[["Activation", Tensor, Tensor], Tensor]] = None
    make_module: Optional[Callable[["Activation"], nn.Module]] = None
    #: ``F.*`` / ``torch.*`` callables computing it, in-place variants included
    functions: Tuple[Callable[..., Any], ...] = ()
    #: ``Tensor`` methods computing it (called with no argument but the tensor)
    methods: Tuple[str, ...] = ()
    #: the ``Activation`` fields read off a functional call's arguments
    call_params: Tuple[_Param, ...] = ()
    #: a callable or module that is this activation for some argument values only
    spelling: Optional[_Spelling] = None
    #: autograd/chain_kernels.py's compiled forward / backward cover it (the backward: the
    #: piecewise-linear ones; a smooth derivative recomputed in both passes measured slower)
    fused_forward: bool = False
    fused_backward: bool = False


def _elu_args(a: "Activation") -> Tuple[float, float, float]:
    """(alpha, scale, input_scale) of ``aten.elu_backward`` for elu / celu / selu."""
    if a.name == "selu":
        return _SELU_ALPHA, _SELU_SCALE, 1.0
    if a.name == "celu":  # as PyTorch's own celu: input_scale = 1 / float32(alpha)
        return a.alpha, 1.0, 1.0 / float(torch.tensor(a.alpha, dtype=torch.float32))
    return a.alpha, 1.0, 1.0


def _elu_bwd(a: "Activation", g: Tensor, z: Tensor) -> Tensor:
    return aten.elu_backward(g, *_elu_args(a), False, z)


def _elu_bwd_(a: "Activation", g: Tensor, z: Tensor) -> Tensor:
    return aten.elu_backward.grad_input(g, *_elu_args(a), False, z, grad_input=z)


def _sigmoid_bwd_(a: "Activation", g: Tensor, z: Tensor) -> Tensor:
    return aten.sigmoid_backward.grad_input(g, torch.sigmoid_(z), grad_input=z)


def _tanh_bwd_(a: "Activation", g: Tensor, z: Tensor) -> Tensor:
    return aten.tanh_backward.grad_input(g, torch.tanh_(z), grad_input=z)


_ALPHA: Tuple[_Param, ...] = (("alpha", 1, 1.0),)

_TABLE: Dict[str, _Record] = {
    "identity": _Record(
        lambda a, z, ip: z, lambda a, g, z: g, lambda a, g, z: g, (nn.Identity,), lambda m: {},
        lambda a, g, o: g, lambda a: nn.Identity(), fused_forward=True, fused_backward=True),
    "relu": _Record(
        lambda a, z, ip: torch.relu_(z) if ip else torch.relu(z),
        lambda a, g, z: aten.threshold_backward(g, z, 0),
        lambda a, g, z: aten.threshold_backward.grad_input(g, z, 0, grad_input=z),
        (nn.ReLU,), lambda m: {},
        lambda a, g, o: aten.threshold_backward.grad_input(g, o, 0, grad_input=o), lambda a: nn.ReLU(),
        functions=(torch.relu, torch.relu_, F.relu, F.relu_), methods=("relu", "relu_"),
        fused_forward=True, fused_backward=True),
    "relu6": _Record(
        lambda a, z, ip: F.hardtanh(z, 0.0, 6.0, inplace=ip),
        lambda a, g, z: aten.hardtanh_backward(g, z, 0.0, 6.0),
        lambda a, g, z: aten.hardtanh_backward.grad_input(g, z, 0.0, 6.0, grad_input=z),
        (nn.ReLU6,), lambda m: {},
        lambda a, g, o: aten.hardtanh_backward.grad_input(g, o, 0.0, 6.0, grad_input=o), lambda a: nn.ReLU6(),
        functions=(F.relu6,),
        spelling=_Spelling((F.hardtanh, F.hardtanh_), (nn.Hardtanh,),
                           (("min_val", 1, -1.0), ("max_val", 2, 1.0)), (0.0, 6.0)),
        fused_forward=True, fused_backward=True),
    "leaky_relu": _Record(
        lambda a, z, ip: F.leaky_relu(z, a.negative_slope, inplace=ip),
        lambda a, g, z: aten.leaky_relu_backward(g, z, a.negative_slope, False),
        lambda a, g, z: aten.leaky_relu_backward.grad_input(g, z, a.negative_slope, False, grad_input=z),
        (nn.LeakyReLU,), lambda m: {"negative_slope": float(m.negative_slope)},
        lambda a, g, o: aten.leaky_relu_backward.grad_input(g, o, a.negative_slope, True, grad_input=o),
        lambda a: nn.LeakyReLU(a.negative_slope),
        functions=(F.leaky_relu, F.leaky_relu_), call_params=(("negative_slope", 1, 0.01),),
        fused_forward=True, fused_backward=True),
    "silu": _Record(
        lambda a, z, ip: F.silu(z, inplace=ip),
        lambda a, g, z: aten.silu_backward(g, z),
        lambda a, g, z: aten.silu_backward.grad_input(g, z, grad_input=z),
        (nn.SiLU,), lambda m: {}, None, lambda a: nn.SiLU(), functions=(F.silu,), fused_forward=True),
    "gelu": _Record(
        lambda a, z, ip: F.gelu(z, approximate=a.approximate),
        lambda a, g, z: aten.gelu_backward(g, z, approximate=a.approximate),
        lambda a, g, z: aten.gelu_backward.grad_input(g, z, approximate=a.approximate, grad_input=z),
        (nn.GELU,), lambda m: {"approximate": str(m.approximate)}, None,
        lambda a: nn.GELU(approximate=a.approximate),
        functions=(F.gelu,), call_params=(("approximate", 1, "none"),), fused_forward=True),
    "hardswish": _Record(
        lambda a, z, ip: F.hardswish(z, inplace=ip),
        lambda a, g, z: aten.hardswish_backward(g, z),
        lambda a, g, z: aten.hardswish_backward.out(g, z, out=z),
        (nn.Hardswish,), lambda m: {}, None, lambda a: nn.Hardswish(), functions=(F.hardswish,), fused_forward=True),
    "hardsigmoid": _Record(
        lambda a, z, ip: F.hardsigmoid(z, inplace=ip),
        lambda a, g, z: aten.hardsigmoid_backward(g, z),
        lambda a, g, z: aten.hardsigmoid_backward.grad_input(g, z, grad_input=z),
        (nn.Hardsigmoid,), lambda m: {}, None, lambda a: nn.Hardsigmoid(), functions=(F.hardsigmoid,)),
    "sigmoid": _Record(
        lambda a, z, ip: torch.sigmoid_(z) if ip else torch.sigmoid(z),
        lambda a, g, z: aten.sigmoid_backward(g, torch.sigmoid(z)),
        _sigmoid_bwd_, (nn.Sigmoid,), lambda m: {}, None, lambda a: nn.Sigmoid(),
        functions=(torch.sigmoid, torch.sigmoid_, F.sigmoid), methods=("sigmoid", "sigmoid_"), fused_forward=True),
    "tanh": _Record(
        lambda a, z, ip: torch.tanh_(z) if ip else torch.tanh(z),
        lambda a, g, z: aten.tanh_backward(g, torch.tanh(z)),
        _tanh_bwd_, (nn.Tanh,), lambda m: {}, None, lambda a: nn.Tanh(),
        functions=(torch.tanh, torch.tanh_, F.tanh), methods=("tanh", "tanh_"), fused_forward=True),
    "elu": _Record(
        lambda a, z, ip: F.elu(z, a.alpha, inplace=ip), _elu_bwd, _elu_bwd_,
        (nn.ELU,), lambda m: {"alpha": float(m.alpha)}, None, lambda a: nn.ELU(a.alpha),
        functions=(F.elu, F.elu_), call_params=_ALPHA, fused_forward=True),
    "celu": _Record(
        lambda a, z, ip: F.celu(z, a.alpha, inplace=ip), _elu_bwd, _elu_bwd_,
        (nn.CELU,), lambda m: {"alpha": float(m.alpha)}, None, lambda a: nn.CELU(a.alpha),
        functions=(F.celu, F.celu_, torch.celu, torch.celu_), call_params=_ALPHA),
    "selu": _Record(
        lambda a, z, ip: F.selu(z, inplace=ip), _elu_bwd, _elu_bwd_,
        (nn.SELU,), lambda m: {}, None, lambda a: nn.SELU(), functions=(F.selu, F.selu_, torch.selu, torch.selu_)),
    "mish": _Record(
        lambda a, z, ip: F.mish(z, inplace=ip),
        lambda a, g, z: aten.mish_backward(g, z),
        lambda a, g, z: aten.mish_backward(g, z),  # no out= form of the kernel
        (nn.Mish,), lambda m: {}, None, lambda a: nn.Mish(), functions=(F.mish,), fused_forward=True),
    "softplus": _Record(
        lambda a, z, ip: F.softplus(z, a.beta, a.threshold),
        lambda a, g, z: aten.softplus_backward(g, z, a.beta, a.threshold),
        lambda a, g, z: aten.softplus_backward.grad_input(g, z, a.beta, a.threshold, grad_input=z),
        (nn.Softplus,), lambda m: {"beta": float(m.beta), "threshold": float(m.threshold)}, None,
        lambda a: nn.Softplus(a.beta, a.threshold),
        functions=(F.softplus,), call_params=(("beta", 1, 1.0), ("threshold", 2, 20.0))),
}

#: Names accepted wherever an activation is asked for.
ACTIVATIONS = tuple(_TABLE)


@dataclass(frozen=True)
class Activation:
    """An element-wise activation ``out = f(z)`` with its derivative (one record of ``_TABLE``).

    Attributes:
        name: one of :data:`ACTIVATIONS`.
        negative_slope: slope of ``leaky_relu`` for ``z < 0``.
        approximate: ``gelu``'s approximation (``"none"`` or ``"tanh"``).
        alpha: ``elu`` / ``celu``'s alpha.
        beta: ``softplus``'s beta.
        threshold: ``softplus``'s threshold.

    Example:
        >>> Activation("elu", alpha=0.5).module()
        ELU(alpha=0.5)
    """

    name: str = "identity"
    negative_slope: float = 0.01
    approximate: str = "none"
    alpha: float = 1.0
    beta: float = 1.0
    threshold: float = 20.0

    def __post_init__(self) -> None:
        if self.name not in _TABLE:
            raise ValueError(
                f"activation must be one of {ACTIVATIONS} (or None), but got activation={self.name!r}"
            )
        if self.approximate not in ("none", "tanh"):
            raise ValueError(f"gelu approximate must be 'none' or 'tanh', but got {self.approximate!r}")
        if self.name == "celu" and self.alpha == 0:
            raise ValueError("celu alpha must be non-zero, but got alpha=0")

    @property
    def _record(self) -> _Record:
        return _TABLE[self.name]

    @property
    def is_identity(self) -> bool:
        return self.name == "identity"

    def __call__(self, z: Tensor, inplace: bool = False) -> Tensor:
        """Apply the activation (differentiable unless ``inplace``)."""
        return self._record.forward(self, z, inplace)

    def backward(self, grad_out: Tensor, z: Tensor) -> Tensor:
        """``grad_z = grad_out * f'(z)`` with native derivative kernels (first order only)."""
        return self._record.backward(self, grad_out, z)

    @property
    def output_derivable(self) -> bool:
        """``f'(z)`` is a function of the output ``f(z)`` (ReLU family): backward needs no ``z``.

        Only the piecewise-linear family takes this path. Sigmoid and tanh have such a
        derivative too, but routed through the fused layers' output-based paths (eval /
        frozen) they failed the exactness tests; until that is understood they keep ``z``.
        """
        if self.name == "leaky_relu" and self.negative_slope <= 0:
            return False
        return self._record.backward_from_output_ is not None

    def backward_(self, grad_out: Tensor, z: Tensor) -> Tensor:
        """:meth:`backward` written into ``z``'s buffer (``z`` is consumed): one fewer
        activation-sized allocation in the fused layers' backward."""
        return self._record.backward_(self, grad_out, z)

    def backward_from_output_(self, grad_out: Tensor, out: Tensor) -> Tensor:
        """``grad_z`` from the activation's *output*, written into ``out`` (see :attr:`output_derivable`)."""
        if not self.output_derivable:
            raise ValueError(f"the derivative of {self} is not a function of its output")
        return self._record.backward_from_output_(self, grad_out, out)  # type: ignore[misc]

    @property
    def fused_forward_kernel(self) -> bool:
        """The opt-in compiled element-wise kernels run BN + this activation's forward fused."""
        return self._record.fused_forward

    @property
    def fused_backward_kernel(self) -> bool:
        """The opt-in compiled element-wise kernels run its backward fused (piecewise-linear ones)."""
        return self._record.fused_backward

    def module(self) -> nn.Module:
        """An equivalent ``nn`` module (for eager baselines and unfused fallbacks)."""
        return self._record.make_module(self)  # type: ignore[misc]

    def __str__(self) -> str:
        if self.name == "leaky_relu":
            return f"leaky_relu({self.negative_slope})"
        if self.name == "gelu" and self.approximate != "none":
            return f"gelu({self.approximate})"
        if self.name in ("elu", "celu") and self.alpha != 1.0:
            return f"{self.name}({self.alpha})"
        if self.name == "softplus" and (self.beta, self.threshold) != (1.0, 20.0):
            return f"softplus({self.beta}, {self.threshold})"
        return self.name


def activation_from_module(module: nn.Module) -> Optional[Activation]:
    """The :class:`Activation` equivalent to ``module``, or ``None`` if it has none.

    ``nn.Hardtanh(0, 6)`` is recognised as ``relu6``. A subclass matches its base
    class's record when it keeps the base's ``forward`` (e.g. a renamed ``nn.ReLU``);
    one with its own ``forward`` computes something else and matches nothing.
    """
    for name, rec in _TABLE.items():
        for cls in rec.modules:
            if isinstance(module, cls) and type(module).forward is cls.forward:
                return Activation(name, **rec.from_module(module))  # type: ignore[misc]
    for name, rec in _TABLE.items():
        sp = rec.spelling
        for cls in sp.modules if sp is not None else ():
            if (isinstance(module, cls) and type(module).forward is cls.forward
                    and tuple(getattr(module, k) for k, _, _ in sp.params) == sp.values):  # type: ignore[union-attr]
                return Activation(name)
    return None


#: reads one argument of a call: ``(position after the input, keyword, default) -> value``
ArgReader = Callable[[int, str, Any], Any]


def activation_functions(name: Optional[str] = None, inplace: Optional[bool] = None) -> FrozenSet[Callable[..., Any]]:
    """The torch callables that compute an activation of the table (``name``: that one only),
    those that compute it for some arguments only (``F.hardtanh``) included; ``inplace``: only
    the in-place variants (``torch.relu_``), or only the others.

    Example:
        >>> torch.relu_ in activation_functions("relu", inplace=True)
        True
    """
    found = set()
    for key, rec in _TABLE.items():
        if name is None or key == name:
            found.update(rec.functions + (rec.spelling.functions if rec.spelling is not None else ()))
    return frozenset(f for f in found if inplace is None or getattr(f, "__name__", "").endswith("_") == inplace)


def activation_methods(name: Optional[str] = None, inplace: Optional[bool] = None) -> FrozenSet[str]:
    """The ``Tensor`` methods (``x.relu()``, ``x.sigmoid_()`` ...) that compute an activation
    (``name``, ``inplace``: as :func:`activation_functions`)."""
    return frozenset(m for key, rec in _TABLE.items() if name is None or key == name for m in rec.methods
                     if inplace is None or m.endswith("_") == inplace)


def activation_from_call(fn: Any, arg: ArgReader) -> Optional[Activation]:
    """The :class:`Activation` a call of ``fn`` computes, its parameters read with ``arg``;
    ``None`` where ``fn`` is not in :func:`activation_functions` or, with these arguments,
    computes none of the table (``F.hardtanh(x, -2.0, 2.0)``).

    Example:
        >>> activation_from_call(F.leaky_relu, lambda i, k, d: 0.2 if k == "negative_slope" else d)
        Activation(name='leaky_relu', negative_slope=0.2, approximate='none', alpha=1.0, beta=1.0, threshold=20.0)
    """
    for name, rec in _TABLE.items():
        if any(fn is f for f in rec.functions):
            return Activation(name, **{k: type(d)(arg(i, k, d)) for k, i, d in rec.call_params})
        sp = rec.spelling
        if sp is not None and any(fn is f for f in sp.functions):
            if tuple(arg(i, k, d) for k, i, d in sp.params) == sp.values:
                return Activation(name)
            return None
    return None


def activation_from_method(method: str) -> Optional[Activation]:
    """The :class:`Activation` the ``Tensor`` method ``method`` computes (called without
    arguments), or ``None``."""
    return next((Activation(name) for name, rec in _TABLE.items() if method in rec.methods), None)


def get_activation(activation: Union[None, str, Activation, nn.Module]) -> Activation:
    """Normalise ``None`` / a name / an ``nn`` module / an :class:`Activation`.

    Args:
        activation: ``None`` (identity), a name from :data:`ACTIVATIONS`, an
            :class:`Activation`, or an ``nn.ReLU``/``nn.ReLU6``/``nn.LeakyReLU``/
            ``nn.SiLU``/``nn.GELU``/``nn.Hardswish``/``nn.Identity`` instance.

    Returns:
        The :class:`Activation`.

    Raises:
        ValueError: unknown name (the message lists the allowed ones).
        TypeError: an unsupported type or module.

    Example:
        >>> get_activation("relu").name
        'relu'
    """
    if activation is None:
        return Activation("identity")
    if isinstance(activation, Activation):
        return activation
    if isinstance(activation, str):
        return Activation(activation.lower())
    if isinstance(activation, nn.Module):
        act = activation_from_module(activation)
        if act is None:
            raise TypeError(
                f"activation module {type(activation).__name__} is not supported; "
                f"use one of {ACTIVATIONS} or the matching nn module"
            )
        return act
    raise TypeError(
        f"activation must be None, a str in {ACTIVATIONS}, an nn activation module or an "
        f"Activation, but got {type(activation).__name__}"
    )
