"""A fourth round of libraries whose networks normalise per sample (after :mod:`sweep_norm_third`).

Families for ``bm_sweep.py`` (merged into :data:`sweep_norm_libs.NORM_FAMILIES`), each built from
the library's own code without weights, on small CPU inputs (batch 2):

* ``dalle2``: ``dalle2-pytorch``'s decoder ``Unet`` (ResNet blocks Conv -> ``GroupNorm`` -> time
  scale-shift -> SiLU, hand-written ``ChanLayerNorm`` before attention), with and without weight-
  standardised convolutions.
* ``medsegdiff``: ``med-seg-diff-pytorch``'s ``Unet`` (the same ResNet blocks, a hand-written
  ``LayerNorm`` over channels, a ViT conditioning branch and an FFT attention map), ``model(x, t, cond)``.
* ``muse``: ``muse-maskgit-pytorch``'s VQGAN ``ResnetEncDec`` (Conv -> ``GroupNorm`` -> LeakyReLU
  ResNet blocks, GLU -> ``GroupNorm`` blocks in the decoder), encoded then decoded, and its
  PatchGAN ``Discriminator`` (strided Conv -> ``GroupNorm`` -> LeakyReLU).
* ``imagen``: ``imagen-pytorch``'s ``Unet`` (hand-written ``ChanRMSNorm`` -> SiLU -> Conv blocks,
  hand-written channel ``LayerNorm`` around global-context attention and the feed-forwards), with
  and without its memory-efficient blocks. The library reads a Hugging Face T5 config as a default
  argument at import; the sweep answers with ``T5Config()`` (no download), and its data module calls
  ``datasets``' ``get_datasets_user_agent()`` at import (a stand-in answers).
* ``segformer``: ``segformer-pytorch``'s ``Segformer`` (overlapping patch Conv, hand-written channel
  ``LayerNorm`` with eps outside the square root before attention / Mix-FFN convolutions).

BatchNorm libraries never run here before (their numbers join the BatchNorm tables):

* ``resnest``: ``resnest``'s ``resnest50`` / ``resnest101`` (split-attention: grouped Conv -> BN ->
  ReLU, radix softmax, ``avd`` pooling).
* ``umx``: ``openunmix``'s ``OpenUnmix`` (Linear -> ``BatchNorm1d`` -> tanh around an LSTM, on a
  spectrogram).

Set-up (``--no-deps``: several would otherwise resolve another torch; beartype, einops and the rest
are what these libraries import; kornia is in ``requirements-sweep.txt``)::

    pip install --no-deps --target /work/venvs/normsweep4-libs dalle2-pytorch==1.15.6 \\
        med-seg-diff-pytorch==0.3.3 muse-maskgit-pytorch==0.3.5 imagen-pytorch==2.1.0 segformer-pytorch==0.0.6 \\
        resnest==0.0.5 openunmix==1.3.0 beartype==0.23.1 einops==0.8.1 einops-exts==0.0.4 ema-pytorch==0.8.3 \\
        vector-quantize-pytorch==1.32.0 resize-right==0.0.2 rotary-embedding-torch==0.9.1 kornia==0.9.0 \\
        kornia_rs==0.2.0

Modules they import at the top but these nets never call (``x_clip``, ``coca_pytorch``, ``ftfy``,
``pytorch_warmup`` ...) load as stand-ins (:func:`sweep_more_libs.import_lenient`).

Installed and not run: ``magvit2-pytorch`` (its convolutions are not normalised; its norms are
RMSNorms in attention), ``compressai`` (GDN, no norm of the table), ``lightweight-gan`` (asserts a
CUDA device at import), ``face-alignment`` (needs ``numba`` compiled), ``pyannote-audio``
(``pyannote.core`` and friends), ``make-a-video-pytorch`` (RMSNorm only), ``uformer-pytorch`` (the
same hand-written LayerNorm as ``segformer``).
"""
from __future__ import annotations

from typing import Any, Callable, Dict

from sweep_norm_more import Built, Entry, _lenient, _randn, _times  # the second round's builders' helpers

__all__ = ["NORM_FOURTH_FAMILIES"]


def _called_as(model: Any, call: Callable[..., Any]) -> Any:
    """A module whose ``forward(*args)`` is ``call(model, *args)`` (keyword arguments, tuple outputs)."""
    import torch.nn as nn

    class CalledAs(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: Any) -> Any:
            return call(self.inner, *args)

    return CalledAs(model)


# --------------------------------------------------------------------------- dalle2-pytorch

def _dalle2(**kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        m = _lenient("dalle2_pytorch.dalle2_pytorch")
        net = m.Unet(dim=16, dim_mults=(1, 2), channels=3, attn_heads=2, attn_dim_head=8, resnet_groups=4,
                     num_resnet_blocks=1, self_attn=(False, True), **kw)
        return _called_as(net, lambda u, x, t: u(x, t, image_embed=None)), (*_randn(gen, 2, 3, 32, 32), _times(gen))
    return build


# --------------------------------------------------------------------------- med-seg-diff-pytorch

def _medsegdiff(gen: Any) -> Built:
    m = _lenient("med_seg_diff_pytorch.med_seg_diff_pytorch")
    net = m.Unet(dim=16, image_size=32, mask_channels=1, input_img_channels=3, dim_mults=(1, 2),
                 full_self_attn=(False, True), resnet_block_groups=4, attn_heads=2, attn_dim_head=8,
                 conditioning_kwargs=dict(dim_head=8, heads=2, depth=1, patch_size=8))
    return net, (*_randn(gen, 2, 1, 32, 32), _times(gen), *_randn(gen, 2, 3, 32, 32))


# --------------------------------------------------------------------------- muse-maskgit-pytorch

def _muse(kind: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        m = _lenient("muse_maskgit_pytorch.vqgan_vae")
        if kind == "Discriminator":
            return m.Discriminator(dims=(16, 32, 64), channels=3, groups=4), _randn(gen, 2, 3, 32, 32)
        net = m.ResnetEncDec(dim=16, channels=3, layers=2, num_resnet_blocks=1, resnet_groups=4)
        return _called_as(net, lambda e, x: e.decode(e.encode(x))), _randn(gen, 2, 3, 32, 32)
    return build


# --------------------------------------------------------------------------- imagen-pytorch

def _imagen(**kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        import importlib.util
        import sys

        import transformers

        if importlib.util.find_spec("datasets") is None:  # its data module calls this at import
            from sweep_more_libs import _stand_in

            _stand_in("datasets.utils.file_utils")
            sys.modules["datasets.utils.file_utils"].get_datasets_user_agent = lambda: "bm_sweep"  # type: ignore[attr-defined]
        original = transformers.T5Config.from_pretrained
        transformers.T5Config.from_pretrained = classmethod(lambda cls, *a, **k: cls())  # type: ignore[assignment]
        try:
            m = _lenient("imagen_pytorch.imagen_pytorch")
        finally:
            transformers.T5Config.from_pretrained = original  # type: ignore[assignment]
        net = m.Unet(dim=16, dim_mults=(1, 2), text_embed_dim=32, cond_on_text=False, layer_attns=False,
                     layer_cross_attns=False, attn_heads=2, attn_dim_head=8, num_resnet_blocks=1, **kw)
        return net, (*_randn(gen, 2, 3, 32, 32), _times(gen) / 500)
    return build


# --------------------------------------------------------------------------- segformer-pytorch

def _segformer(gen: Any) -> Built:
    m = _lenient("segformer_pytorch.segformer_pytorch")
    net = m.Segformer(dims=(16, 32, 32, 64), heads=(1, 2, 2, 4), ff_expansion=(2, 2, 2, 2), reduction_ratio=(4, 2, 1, 1),
                      num_layers=1, channels=3, decoder_dim=32, num_classes=2)
    return net, _randn(gen, 2, 3, 64, 64)


# --------------------------------------------------------------------------- BatchNorm: resnest, openunmix

def _resnest(name: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        m = _lenient("resnest.torch")
        return getattr(m, name)(pretrained=False), _randn(gen, 2, 3, 64, 64)
    return build


def _umx(gen: Any) -> Built:
    m = _lenient("openunmix.model")
    net = m.OpenUnmix(nb_bins=128, nb_channels=2, hidden_size=32, nb_layers=2, max_bin=64)
    return net, _randn(gen, 2, 2, 128, 16)


# --------------------------------------------------------------------------- the families

NORM_FOURTH_FAMILIES: Dict[str, Dict[str, Entry]] = {
    "dalle2": {
        "Unet": ("diffusion", _dalle2()),
        "Unet-weight-standardization": ("diffusion", _dalle2(resnet_weight_standardization=True)),
    },
    "medsegdiff": {
        "Unet": ("segmentation", _medsegdiff),
    },
    "muse": {
        "ResnetEncDec": ("autoencoder", _muse("ResnetEncDec")),
        "Discriminator": ("gan", _muse("Discriminator")),
    },
    "imagen": {
        "Unet": ("diffusion", _imagen()),
        "Unet-memory-efficient": ("diffusion", _imagen(memory_efficient=True)),
    },
    "segformer": {
        "Segformer": ("segmentation", _segformer),
    },
    "resnest": {
        "resnest50": ("classification", _resnest("resnest50")),
        "resnest101": ("classification", _resnest("resnest101")),
    },
    "umx": {
        "OpenUnmix": ("audio", _umx),
    },
}
