"""convbn.autograd: the ``torch.autograd.Function``s of the fast paths, and ``conv_bn_act``.

The tutorial's reference Functions live in :mod:`convbn.reference`.
"""
from .chain import ChainFunction
from .dispatch import conv_bn_act
from .layer_functions import FrozenFunction
from ..functional.deprecation import module_aliases as _module_aliases

__all__ = [
    "ChainFunction",
    "FrozenFunction",
    "conv_bn_act",
]


def _one_layer(name: str) -> object:
    from . import layer_functions

    return getattr(layer_functions, name)


# ``RecomputeConvFunction`` / ``RecomputeBNFunction`` are not ``autograd.Function``s: each is a
# one-layer ``ChainFunction`` call (``ChainFunction.apply`` with one ``ChainLayerSpec``).
__getattr__ = _module_aliases(__name__, {
    "RecomputeConvFunction": (lambda: _one_layer("RecomputeConvFunction"),
                              "convbn.conv_bn_act(..., strategy='recompute_conv') or ChainFunction"),
    "RecomputeBNFunction": (lambda: _one_layer("RecomputeBNFunction"),
                            "convbn.conv_bn_act(..., strategy='recompute_bn') or ChainFunction"),
})
