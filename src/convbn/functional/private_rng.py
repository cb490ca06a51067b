"""Random numbers a check draws from generators of its own, never from the global streams.

Note: [a check's random numbers are its own]
A check runs the model twice (as it was and as rewritten) and compares: both runs must draw
the same random numbers (dropout masks, ``torch.rand`` in a forward), and neither may move
what the rest of the program draws. Seeding the global generator and restoring it afterwards
(``torch.random.fork_rng``) gets the first but not the second: the CPU generator is one per
process, so another thread drawing meanwhile (a data-loading thread's augmentations, a
second model training) gets numbers repeated or skipped. :func:`private_rng` instead pushes a
dispatch mode on *this thread's* mode stack (other threads do not see it) that gives every
random operator called without a ``generator`` one of its own: a ``torch.Generator`` per
device, seeded with ``seed``. Operators without a ``generator`` overload are run with the
private state swapped into the global generator for that one call (``native_dropout``, CUDA's
fused dropout, is rewritten as ``bernoulli_`` first; what is left is rare: fused attention or
cuDNN RNN with dropout).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from .._compat import TorchDispatchMode, dispatch_mode_stack

__all__ = ["PrivateRNG", "private_rng", "active_private_rng"]

_aten = torch.ops.aten
_SWAP_LOCK = threading.Lock()
#: whether this thread holds a swapped-in private state (a seeded op built of other seeded ops,
#: such as attention with dropout, re-enters the mode: its inner draws continue that state)
_SWAPPED = threading.local()
_WITH_GENERATOR: Dict[Any, Optional[Any]] = {}
_SEEDED: Dict[Any, bool] = {}  # operator -> draws random numbers (read once per operator)


def _has_generator(op: Any) -> bool:
    return any(a.name == "generator" for a in op._schema.arguments)


def _generator_overload(op: Any) -> Optional[Any]:
    """The overload of ``op``'s operator taking a ``generator`` and otherwise the same
    arguments (``aten.rand.default`` -> ``aten.rand.generator``), or ``None``."""
    if op in _WITH_GENERATOR:
        return _WITH_GENERATOR[op]
    names = [a.name for a in op._schema.arguments]
    found = None
    packet = op.overloadpacket
    for name in packet.overloads():
        other = getattr(packet, name)
        if _has_generator(other) and [a.name for a in other._schema.arguments if a.name != "generator"] == names:
            found = other
            break
    _WITH_GENERATOR[op] = found
    return found


def _device_of(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> torch.device:
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            return a.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


class PrivateRNG(TorchDispatchMode):
    """The dispatch mode :func:`private_rng` pushes: one seeded generator per device."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self.generators: Dict[torch.device, torch.Generator] = {}
        self.seeded_states: Dict[torch.device, Tensor] = {}  # each generator's state as first seeded

    def generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        gen = self.generators.get(device)
        if gen is None:
            gen = self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
            self.seeded_states[device] = gen.get_state()
        return gen

    def states(self) -> List[Tensor]:
        """The state of every private generator that drew (what the block drew), in device order.

        Note: [a generator that drew nothing is no state]
        A generator is made the first time a random operator asks for one, and some are asked
        and draw nothing: CPU attention (``_scaled_dot_product_flash_attention_for_cpu``, tagged
        random for its dropout) with ``dropout_p=0``. Which attention kernel runs depends on grad
        mode (with a mask that requires grad, the composite one, which asks for no generator),
        so eager's output taken without autograd and the rewrite's step with it would list
        different generators though neither drew a number. Only generators that moved from
        their seed are listed."""
        return [state for d in sorted(self.generators, key=str)
                if not torch.equal(state := self.generators[d].get_state(), self.seeded_states[d])]

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        seeded = _SEEDED.get(func)
        if seeded is None:
            seeded = _SEEDED[func] = torch.Tag.nondeterministic_seeded in func.tags
        if not seeded:  # the common case, kept short: this runs for every operator of a check
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        device = _device_of(args, kwargs)
        if _has_generator(func):
            if kwargs.get("generator") is None and not _positional_generator(func, args):
                kwargs["generator"] = self.generator(device)
            return func(*args, **kwargs)
        other = _generator_overload(func)
        if other is not None:
            return other(*args, generator=self.generator(device), **kwargs)
        if func is _aten.native_dropout.default:
            return self._native_dropout(*args, **kwargs)
        return self._swapped(func, device, args, kwargs)

    def _native_dropout(self, x: Tensor, p: float, train: Optional[bool] = None) -> Tuple[Tensor, Tensor]:
        if train is False or p == 0.0:
            return x.clone(), torch.ones_like(x, dtype=torch.bool)
        if p == 1.0:
            return torch.zeros_like(x), torch.zeros_like(x, dtype=torch.bool)
        mask = torch.empty_like(x).bernoulli_(1.0 - p, generator=self.generator(x.device))
        return x * mask * (1.0 / (1.0 - p)), mask.bool()

    def _swapped(self, func: Any, device: torch.device, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """``func`` drawing from the global generator of ``device`` with the private state in
        it for this one call (no ``generator`` overload exists)."""
        if getattr(_SWAPPED, "active", False):  # inside a swap already: the global holds our state
            return func(*args, **kwargs)
        gen = self.generator(device)
        glob = torch.cuda.default_generators[gen.device.index] if device.type == "cuda" else torch.default_generator
        with _SWAP_LOCK:
            saved = glob.get_state()
            glob.set_state(gen.get_state())
            _SWAPPED.active = True
            try:
                return func(*args, **kwargs)
            finally:
                _SWAPPED.active = False
                gen.set_state(glob.get_state())
                glob.set_state(saved)


def _positional_generator(func: Any, args: Tuple[Any, ...]) -> bool:
    names = [a.name for a in func._schema.arguments]
    i = names.index("generator")
    return i < len(args) and args[i] is not None


@contextmanager
def private_rng(seed: int = 0) -> Iterator[PrivateRNG]:
    """Every random number drawn in the block, in this thread, comes from generators of the
    block's own seeded with ``seed`` (Note: [a check's random numbers are its own]); the
    global generators, and what other threads draw from them, are untouched.

    Args:
        seed: the seed of the private generators.

    Returns:
        The active :class:`PrivateRNG` (``states()``: what the block drew).

    Example:
        >>> with private_rng(0):
        ...     a = torch.rand(3)
        >>> with private_rng(0):
        ...     b = torch.rand(3)
        >>> torch.equal(a, b)
        True
    """
    mode = PrivateRNG(seed)
    with mode:
        yield mode


def active_private_rng() -> Optional[PrivateRNG]:
    """The innermost :class:`PrivateRNG` on this thread's dispatch mode stack, if any."""
    for mode in reversed(dispatch_mode_stack()):
        if isinstance(mode, PrivateRNG):
            return mode
    return None
