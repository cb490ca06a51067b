"""A chain's static structure, owned by the chains that have it, found by key by the custom op.

The custom op of :mod:`convbn.autograd.chain_op` takes a chain's static structure (conv
geometry, activations, eps, tails) as a string key (Note: [why a custom op under
torch.compile]); it cannot take the records themselves. A :class:`ChainStructure` holds the
records and the key; the chain built with it owns it (``FusedChain.op_structure``), and
the table the op looks keys up in holds it *weakly*: an entry lives exactly as long as
some chain (or a pending backward of the op) holds its structure, so the table never
outgrows the models alive.
"""
from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from ..functional.tail import TailOp

__all__ = ["ChainStructure", "register_chain", "structure_of"]

#: one layer's static record: conv geometry (``None`` for a head), activation, eps (``None``
#: for an end layer), the tail's ops without dropouts
StaticLayer = Tuple[Any, Any, Optional[float], Tuple[TailOp, ...]]


@dataclass(frozen=True, eq=False)
class ChainStructure:
    """A chain's static structure and its key (equal structures, equal keys, in every process).

    Attributes:
        key: the string the custom op is called with.
        layers: per layer ``(ConvSpec or None, Activation, eps or None, tail ops)``.
    """

    key: str
    layers: Tuple[StaticLayer, ...]


_LIVE: "weakref.WeakValueDictionary[str, ChainStructure]" = weakref.WeakValueDictionary()


def register_chain(static: Sequence[Tuple[Any, ...]]) -> ChainStructure:
    """The :class:`ChainStructure` of ``[(ConvSpec, Activation, eps[, tail]), ...]`` (``None``
    for a head's conv or an end layer's eps; ``tail`` the tail's ops without dropouts, default
    ``()``), findable by its key while the caller holds it.

    Called when a :class:`convbn.nn.FusedChain` is built or unpickled (never while tracing);
    equal structures share one object, so deep copies of a model share compiled kernels.

    Example:
        >>> from convbn.functional.activations import Activation
        >>> s = register_chain([(None, Activation("relu"), 1e-5)])
        >>> structure_of(s.key) is s
        True
    """
    layers = tuple((l[0], l[1], None if l[2] is None else float(l[2]), tuple(l[3]) if len(l) > 3 else ())
                   for l in static)
    key = hashlib.sha1(repr(layers).encode()).hexdigest()[:20]
    live = _LIVE.get(key)
    if live is not None:
        return live
    made = ChainStructure(key, layers)
    _LIVE[key] = made
    return made


def structure_of(key: str) -> ChainStructure:
    """The live structure registered under ``key``.

    Raises:
        KeyError: no chain holding that structure is alive in this process.
    """
    live = _LIVE.get(key)
    if live is None:
        raise KeyError(f"no live convbn chain has the structure key {key!r}: the chain (and the model holding it) "
                       "was freed, or it was built in another process and not unpickled here")
    return live
