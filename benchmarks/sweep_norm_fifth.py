"""A fifth round of per-sample-norm networks (after :mod:`sweep_norm_fourth`): timm's families never run.

One family for ``bm_sweep.py`` (merged into :data:`sweep_norm_libs.NORM_FAMILIES`), ``timmnorm``: the
smallest configuration of each timm family whose convolutions are followed by a ``GroupNorm``, an
``InstanceNorm`` or a LayerNorm over channels (read from timm's code), built without weights, ten
classes, on 64² CPU inputs (batch 2). timm is in the dev environment (``scripts/setup.sh``); it is
imported through ``tests/zoo.py``'s helper. What each brings:

* ``GroupNormAct`` (``GroupNorm`` + activation in one timm module): ``efficientnet_b0_gn``,
  ``test_efficientnet_gn``, and the pre-activation ``resnetv2_50d_gn``.
* ``LayerNormAct2d`` (channel LayerNorm + activation): ``test_efficientnet_ln``, ``vitamin_small_224``'s
  convolutional stages.
* ``GroupNorm1`` (``GroupNorm(1, C)``, MetaFormer's "LayerNorm over C, H, W"): ``poolformer_s12``,
  ``mobilevitv2_050``, ``lowformer_b0``, ``shvit_s1``; without bias (``GroupNorm1NoBias``):
  ``poolformerv2_s12``.
* ``LayerNorm2d`` / ``LayerNorm2dNoBias`` (a ``nn.LayerNorm`` subclass that permutes around
  ``F.layer_norm``): ``convformer_s18``, ``caformer_s18``, ``edgenext_xx_small``, ``rdnet_tiny``,
  ``focalnet_tiny_srf``, ``convnextv2_pico`` (with ``GlobalResponseNorm``, no row of the table),
  ``gcvit_xxtiny``, ``davit_tiny``, ``test_coatnet``, ``test_maxvit``.
* ``nn.LayerNorm`` on channels-last activations after a permuted convolution: ``mambaout_femto``,
  ``test_mambaout``.

Families looked at and not run (no per-sample norm after a convolution, or only on tokens):
``hgnet``, ``fastvit``, ``nextvit``, ``efficientformerv2``, ``starnet``, ``swiftformer``, ``repvit``,
``efficientvit`` (BatchNorm; a token LayerNorm at most), ``inception_next`` (BatchNorm, one token
LayerNorm in the head), ``hiera`` (token LayerNorms), ``tiny_vit`` (one ``LayerNorm2d`` in the head).
"""
from __future__ import annotations

from typing import Any, Callable, Dict

from sweep_norm_more import Built, Entry, _randn

__all__ = ["NORM_FIFTH_FAMILIES"]

#: models whose attention windows / position tables are sized from ``img_size`` (64 here)
_SIZED = ("gcvit", "test_coatnet", "test_maxvit", "vitamin", "coatnet", "maxvit")


def _timm(name: str, size: int = 64) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        from zoo import import_timm

        timm = import_timm()
        kw: Dict[str, Any] = {"img_size": size} if name.startswith(_SIZED) else {}
        return timm.create_model(name, pretrained=False, num_classes=10, **kw), _randn(gen, 2, 3, size, size)
    return build


_MODELS = ("test_efficientnet_gn", "test_efficientnet_ln", "test_coatnet", "test_maxvit", "test_mambaout",
           "efficientnet_b0_gn", "resnetv2_50d_gn", "poolformer_s12", "poolformerv2_s12", "convformer_s18",
           "caformer_s18", "edgenext_xx_small", "gcvit_xxtiny", "mambaout_femto", "rdnet_tiny", "focalnet_tiny_srf",
           "convnextv2_pico", "mobilevitv2_050", "lowformer_b0", "shvit_s1", "vitamin_small_224", "davit_tiny")

NORM_FIFTH_FAMILIES: Dict[str, Dict[str, Entry]] = {
    "timmnorm": {name: ("classification", _timm(name)) for name in _MODELS},
}
