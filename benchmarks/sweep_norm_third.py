"""A third round of libraries whose networks normalise per sample (after :mod:`sweep_norm_more`).

Families for ``bm_sweep.py`` (merged into :data:`sweep_norm_libs.NORM_FAMILIES`), each built from
the library's own code without weights, on small CPU inputs (batch 2):

* ``demucs``: ``demucs`` (music source separation): ``Demucs`` v2 (Conv1d -> ``GroupNorm`` -> GELU /
  GLU, the ``DConv`` residual branch with ``GroupNorm(1, C)`` and ``LayerScale``) and ``HDemucs``
  (the same blocks on the waveform and on an STFT's spectrogram, Conv2d).
* ``sam``: ``segment-anything``: the ViT image encoder (its neck: Conv 1x1 -> ``LayerNorm2d`` ->
  Conv 3x3 -> ``LayerNorm2d``, a channel LayerNorm written from tensor ops), the prompt encoder's
  mask down-scaling (Conv -> ``LayerNorm2d`` -> GELU, twice) and the mask decoder's up-scaling
  (ConvTranspose -> ``LayerNorm2d`` -> GELU -> ConvTranspose).
* ``encodec``: ``encodec``'s SEANet encoder / decoder (Conv1d, ELU, residual blocks) with
  ``norm="time_group_norm"`` (``GroupNorm(1, C)`` after each convolution). Its ``"layer_norm"``
  (``ConvLayerNorm``) is not built: in 0.1.1 its ``forward`` returns ``None``.
* ``aunet``: ``audio-diffusion-pytorch`` 0.1.3's ``UNetV0`` (``a-unet``'s 1-D U-Net: ResNet blocks
  ``GroupNorm`` -> SiLU -> Conv1d, time modulation, attention) and ``a-unet``'s ConvNeXt-V2 block
  (depthwise Conv1d -> ``GroupNorm(1, C)`` -> pointwise convs with GRN).
* ``xunet``: lucidrains' ``x-unet`` ``XUnet`` (hand-written channel ``LayerNorm`` on 5-D tensors,
  ResNet blocks and, with ``use_convnext=True``, ConvNeXt blocks), images as one-frame videos.
* ``vocos``: ``vocos``' ``VocosBackbone`` (Conv1d, then ConvNeXt blocks: depthwise Conv1d ->
  ``x.transpose(1, 2)`` -> ``nn.LayerNorm`` -> Linear MLP; a LayerNorm over the channels of a 3-D
  tensor, which the sweep counts as ``layer-token``: it cannot tell it from a token sequence's).
* ``asteroid``: ``asteroid``'s Conv-TasNet (``TDConvNet``: Conv1d -> PReLU -> ``GlobLN`` / ``ChanLN``
  -> depthwise Conv1d, hand-written global / channel layer norms) and SuDORMRF.

Hand-written norms (a module of its own named like a norm, ``...Norm``, ``...Norm2d``,
``...LN``: :func:`sweep_norm_libs._is_hand_written_norm`) are counted as their own kind,
``hand-written``, outside the three the fused share is taken over.

Set-up (``--no-deps``: several would otherwise resolve another torch; einops and
torch-einops-utils are what x-unet / a-unet import)::

    pip install --no-deps demucs==4.1.0 julius==0.2.8 segment-anything==1.0 encodec==0.1.1 a-unet==0.0.16 \\
        audio-diffusion-pytorch==0.1.3 x-unet==0.5.0 torch-einops-utils==0.2.0 asteroid==0.7.0 \\
        asteroid-filterbanks==0.4.0 einops==0.8.1 vocos==0.1.0

Modules they import at the top but these nets never call (``soundfile``, ``torchaudio``, ``lameenc``,
``pytorch_lightning`` ...) load as stand-ins (:func:`sweep_more_libs.import_lenient`).

Not run: ``k-diffusion``'s ``image_v1`` normalises with ``AdaGN`` (``F.group_norm`` then a per-sample,
conditioning-dependent scale and shift inside a module holding a ``Linear``), which the sweep's module
count cannot see, and whose per-sample affine no chain takes.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from sweep_norm_more import Built, Entry, _lenient, _randn  # the second round's builders' helpers

__all__ = ["NORM_THIRD_FAMILIES"]


# --------------------------------------------------------------------------- demucs

def _demucs(kind: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        if kind == "Demucs":
            m = _lenient("demucs.demucs")
            net = m.Demucs(sources=["a", "b"], audio_channels=1, channels=8, depth=3, norm_starts=0, norm_groups=2,
                           dconv_attn=8, dconv_lstm=8, resample=False, samplerate=8000, segment=1)
            return net, _randn(gen, 2, 1, 2048)
        m = _lenient("demucs.hdemucs")
        net = m.HDemucs(sources=["a", "b"], audio_channels=1, channels=8, depth=3, nfft=256, norm_starts=0,
                        norm_groups=2, dconv_attn=8, dconv_lstm=8, samplerate=8000, segment=1, rewrite=True)
        return net, _randn(gen, 2, 1, 2048)
    return build


# --------------------------------------------------------------------------- segment-anything

def _sam(part: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        m = _lenient("segment_anything.modeling")
        if part == "image_encoder":
            net = m.ImageEncoderViT(img_size=64, patch_size=8, embed_dim=32, depth=2, num_heads=2, out_chans=16,
                                    window_size=4, global_attn_indexes=(1,))
            return net, _randn(gen, 2, 3, 64, 64)
        if part == "mask_downscaling":
            enc = m.PromptEncoder(embed_dim=16, image_embedding_size=(8, 8), input_image_size=(32, 32),
                                  mask_in_chans=16)
            return enc.mask_downscaling, _randn(gen, 2, 1, 32, 32)
        dec = m.MaskDecoder(transformer_dim=32, transformer=m.TwoWayTransformer(depth=1, embedding_dim=32,
                                                                                num_heads=2, mlp_dim=64))
        return dec.output_upscaling, _randn(gen, 2, 32, 8, 8)
    return build


# --------------------------------------------------------------------------- encodec

def _encodec(kind: str, norm: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        m = _lenient("encodec.modules")
        kw = dict(channels=1, dimension=16, n_filters=4, n_residual_layers=1, ratios=[4, 2], norm=norm, lstm=0)
        if kind == "encoder":
            return m.SEANetEncoder(**kw), _randn(gen, 2, 1, 1024)
        return m.SEANetDecoder(**kw), _randn(gen, 2, 16, 128)
    return build


# --------------------------------------------------------------------------- audio-diffusion / a-unet

def _aunet(kind: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        import torch

        if kind == "UNetV0":
            adp = _lenient("audio_diffusion_pytorch")
            net = adp.UNetV0(dim=1, in_channels=2, channels=[8, 16, 32], factors=[1, 2, 2], items=[1, 1, 1],
                             attentions=[0, 0, 1], attention_heads=2, attention_features=8, resnet_groups=4,
                             modulation_features=32)
            return _TimeKwarg(net), (*_randn(gen, 2, 2, 256), torch.rand(2, generator=gen))
        au = _lenient("a_unet")
        block = au.ConvNextV2Block(dim=1, channels=16)
        return block, _randn(gen, 2, 16, 128)
    return build


def _TimeKwarg(model: Any) -> Any:  # noqa: N802 - builds a module, named as one
    """``model(x, time=t)``: a U-Net whose time argument is a keyword."""
    import torch.nn as nn

    class TimeKwarg(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Any, t: Any) -> Any:
            return self.inner(x, time=t)

    return TimeKwarg(model)


# --------------------------------------------------------------------------- x-unet

def _xunet(**kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        xu = _lenient("x_unet")
        net = xu.XUnet(dim=16, channels=3, dim_mults=(1, 2), num_blocks_per_stage=(1, 1),
                       num_self_attn_per_stage=(0, 1), nested_unet_depths=(0, 0), attn_heads=2, attn_dim_head=8, **kw)
        return net, _randn(gen, 2, 3, 32, 32)
    return build


# --------------------------------------------------------------------------- asteroid

def _asteroid(kind: str, norm_type: str = "gLN") -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        models = _lenient("asteroid.models")
        if kind == "ConvTasNet":
            net = models.ConvTasNet(n_src=2, n_repeats=1, n_blocks=2, bn_chan=16, hid_chan=32, skip_chan=16,
                                    n_filters=32, kernel_size=16, stride=8, norm_type=norm_type)
        else:
            net = models.SuDORMRFNet(n_src=2, bn_chan=16, num_blocks=2, upsampling_depth=2, in_chan=32,
                                     n_filters=32, kernel_size=16, stride=8)
        return net, _randn(gen, 2, 1024)
    return build


# --------------------------------------------------------------------------- vocos

def _vocos(gen: Any) -> Built:
    models = _lenient("vocos.models")
    net = models.VocosBackbone(input_channels=16, dim=32, intermediate_dim=64, num_layers=2)
    return net, _randn(gen, 2, 16, 64)


# --------------------------------------------------------------------------- the families

NORM_THIRD_FAMILIES: Dict[str, Dict[str, Entry]] = {
    "demucs": {
        "Demucs-v2": ("audio", _demucs("Demucs")),
        "HDemucs": ("audio", _demucs("HDemucs")),
    },
    "sam": {
        "ImageEncoderViT": ("segmentation", _sam("image_encoder")),
        "PromptEncoder-mask_downscaling": ("segmentation", _sam("mask_downscaling")),
        "MaskDecoder-output_upscaling": ("segmentation", _sam("output_upscaling")),
    },
    "encodec": {
        "SEANetEncoder-time_group_norm": ("audio", _encodec("encoder", "time_group_norm")),
        "SEANetDecoder-time_group_norm": ("audio", _encodec("decoder", "time_group_norm")),
    },
    "aunet": {
        "UNetV0": ("diffusion", _aunet("UNetV0")),
        "ConvNextV2Block": ("audio", _aunet("ConvNextV2Block")),
    },
    "xunet": {
        "XUnet": ("diffusion", _xunet()),
        "XUnet-convnext": ("diffusion", _xunet(use_convnext=True)),
    },
    "vocos": {
        "VocosBackbone": ("audio", _vocos),
    },
    "asteroid": {
        "ConvTasNet-gLN": ("audio", _asteroid("ConvTasNet")),
        "ConvTasNet-cLN": ("audio", _asteroid("ConvTasNet", norm_type="cLN")),
        "SuDORMRFNet": ("audio", _asteroid("SuDORMRFNet")),
    },
}
