"""More libraries whose networks normalise per sample: the second round of :mod:`sweep_norm_libs`.

Families for ``bm_sweep.py`` (merged into :data:`sweep_norm_libs.NORM_FAMILIES`), each built from
the library's own code without weights, on small CPU inputs (batch 2):

* ``p3dunet``: ``pytorch3dunet`` (wolny's 3-D U-Nets for volumetric segmentation): ``UNet3D``,
  ``ResidualUNet3D``, ``ResidualUNetSE3D``, ``UNet2D`` with the library's default layer order
  ``gcr`` (GroupNorm -> Conv -> ReLU: the norm *before* the convolution, no activation between)
  and with ``cgr`` (Conv -> GroupNorm -> ReLU).
* ``fepunet``: ``unet`` (fepegar's 1/2/3-D U-Net): ``UNet2D`` / ``UNet3D`` with
  ``normalization="instance"`` (InstanceNorm without affine), pre-activation and residual blocks.
* ``cfm``: ``torchcfm``'s ``UNetModelWrapper`` (OpenAI's guided-diffusion U-Net: ``GroupNorm32``,
  an ``nn.GroupNorm`` subclass computing in float32, SiLU, attention, scale-shift time
  embedding), called ``model(t, x)``.
* ``taming``: ``taming-transformers``' VQGAN ``Encoder`` / ``Decoder`` and its DDPM ``Model``
  (``GroupNorm(32)`` -> hand-written swish ``x * sigmoid(x)`` -> Conv).
* ``ddpm``: ``denoising-diffusion-pytorch``'s ``Unet`` and ``Unet1D`` (hand-written channel
  ``RMSNorm``: ``F.normalize(x, dim=1) * g * sqrt(C)``; no GroupNorm in this version).
* ``vdiff``: ``video-diffusion-pytorch``'s ``Unet3D`` (hand-written channel ``LayerNorm`` /
  ``RMSNorm`` on 5-D video tensors).
* ``hfconvnext``: Hugging Face ``transformers``' ``ConvNextModel`` / ``ConvNextV2Model``
  (``ConvNextLayerNorm``, channels-first in the stem and downsampling layers, channels-last
  ``nn.LayerNorm`` -> ``nn.Linear`` in the blocks) from small configs.
* ``monai2``: MONAI nets the ``monai`` family does not build: ``UNETR`` and ``SwinUNETR``
  (InstanceNorm conv encoders / decoders around a transformer), ``DiffusionModelUNet`` and
  ``AutoencoderKL`` (MONAI Generative, GroupNorm -> SiLU -> Conv), ``HighResNet`` with
  InstanceNorm, ``SegResNetDS`` and ``SegResNetVAE`` with GroupNorm.

Hand-written norms (a module of its own whose class name ends in ``Norm``, not a torch norm,
normalising over the channel dimension) are counted as their own kind, ``hand-written``
(:data:`sweep_norm_libs.NORM_KINDS`), outside the three the fused share is taken over.

Set-up (``--no-deps``: each would otherwise resolve another torch; einops and the rest are
what these libraries import)::

    pip install --no-deps pytorch3dunet==1.9.6 unet==0.8.1 torchcfm==1.0.7 taming-transformers==0.0.1 \
        denoising-diffusion-pytorch==2.3.4 video-diffusion-pytorch==0.7.0 einops==0.8.1 einops-exts \
        rotary-embedding-torch ema-pytorch

(MONAI and transformers are in the dev environment / ``requirements-sweep.txt``.) Modules they
import at the top but these nets never call (``skimage``, ``ot``) load as stand-ins
(:func:`sweep_more_libs.import_lenient`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

__all__ = ["NORM_MORE_FAMILIES"]

Built = Tuple[Any, Tuple[Any, ...]]
Entry = Tuple[str, Callable[[Any], Built]]


def _randn(gen: Any, *shape: int) -> Tuple[Any, ...]:
    import torch

    return (torch.randn(*shape, generator=gen),)


def _lenient(module: str) -> Any:
    from sweep_more_libs import import_lenient

    return import_lenient(module)


def _times(gen: Any) -> Any:
    import torch

    return torch.rand(2, generator=gen) * 500


# --------------------------------------------------------------------------- pytorch3dunet

def _p3d(arch: str, order: str = "gcr", **kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        model = _lenient("pytorch3dunet.unet3d.model")
        cls = getattr(model, arch)
        net = cls(in_channels=1, out_channels=2, final_sigmoid=False, f_maps=8, layer_order=order, num_groups=4,
                  num_levels=3, is_segmentation=False, dropout_prob=0.0, **kw)
        size = (48, 48) if arch.endswith("2D") else (24, 24, 24)
        return net, _randn(gen, 2, 1, *size)
    return build


# --------------------------------------------------------------------------- fepegar's unet

def _fep(dim: int, **kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        from unet import UNet

        net = UNet(in_channels=1, out_classes=2, dimensions=dim, num_encoding_blocks=3, out_channels_first_layer=8,
                   normalization="instance", padding=1, upsampling_type="linear", **kw)
        size = (48, 48) if dim == 2 else (24, 24, 24)
        return net, _randn(gen, 2, 1, *size)
    return build


# --------------------------------------------------------------------------- torchcfm

def _cfm(**kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        unet = _lenient("torchcfm.models.unet.unet")
        net = unet.UNetModelWrapper(dim=(3, 32, 32), num_channels=32, num_res_blocks=1, channel_mult=(1, 2, 2),
                                    num_heads=2, num_head_channels=16, attention_resolutions="16", **kw)
        return net, (_times(gen), *_randn(gen, 2, 3, 32, 32))
    return build


# --------------------------------------------------------------------------- taming-transformers

def _taming(kind: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        m = _lenient("taming.modules.diffusionmodules.model")
        common = dict(ch=32, out_ch=3, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=[8], in_channels=3,
                      resolution=32)
        if kind == "Encoder":
            return m.Encoder(z_channels=4, double_z=False, **common), _randn(gen, 2, 3, 32, 32)
        if kind == "Decoder":
            return m.Decoder(z_channels=4, **common), _randn(gen, 2, 4, 16, 16)
        import torch

        return m.Model(**common), (*_randn(gen, 2, 3, 32, 32), torch.tensor([10, 500]))
    return build


# --------------------------------------------------------------------------- lucidrains

def _ddpm(kind: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        ddpm = _lenient("denoising_diffusion_pytorch")
        if kind == "Unet1D":
            return ddpm.Unet1D(dim=16, dim_mults=(1, 2), channels=2), (*_randn(gen, 2, 2, 64), _times(gen))
        return ddpm.Unet(dim=16, dim_mults=(1, 2, 4)), (*_randn(gen, 2, 3, 32, 32), _times(gen))
    return build


def _vdiff(gen: Any) -> Built:
    vd = _lenient("video_diffusion_pytorch")
    net = vd.Unet3D(dim=16, dim_mults=(1, 2), attn_heads=2, attn_dim_head=8)
    return net, (*_randn(gen, 2, 3, 4, 16, 16), _times(gen))


# --------------------------------------------------------------------------- transformers

def _hf_convnext(kind: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        import transformers

        cfg_cls, cls = ((transformers.ConvNextV2Config, transformers.ConvNextV2Model) if kind == "v2"
                        else (transformers.ConvNextConfig, transformers.ConvNextModel))
        cfg = cfg_cls(num_channels=3, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 2, 1], patch_size=4)
        return _HFOutput(cls(cfg)), _randn(gen, 2, 3, 64, 64)
    return build


def _HFOutput(model: Any) -> Any:  # noqa: N802 - builds a module, named as one
    """``model(pixel_values, return_dict=False)``: its outputs as a tuple of tensors."""
    import torch.nn as nn

    class HFTuple(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Any) -> Any:
            return self.inner(x, return_dict=False)

    return HFTuple(model)


# --------------------------------------------------------------------------- MONAI

def _monai2(name: str, **kw: Any) -> Callable[[Any], Built]:  # noqa: C901 - one branch per net
    def build(gen: Any) -> Built:
        import torch
        from monai.networks import nets

        if name == "UNETR":
            net = nets.UNETR(in_channels=1, out_channels=2, img_size=32, feature_size=8, hidden_size=64, mlp_dim=128,
                             num_heads=4)
            return net, _randn(gen, 2, 1, 32, 32, 32)
        if name == "SwinUNETR":
            net = nets.SwinUNETR(in_channels=1, out_channels=2, feature_size=12, depths=(1, 1, 1, 1),
                                 num_heads=(3, 3, 3, 3), spatial_dims=2)
            return net, _randn(gen, 2, 1, 64, 64)
        if name == "DiffusionModelUNet":
            net = nets.DiffusionModelUNet(spatial_dims=2, in_channels=1, out_channels=1, num_res_blocks=1,
                                          channels=(16, 32, 32), attention_levels=(False, False, True),
                                          norm_num_groups=8, num_head_channels=8)
            return net, (*_randn(gen, 2, 1, 32, 32), torch.tensor([10, 500]))
        if name == "AutoencoderKL":
            net = nets.AutoencoderKL(spatial_dims=2, in_channels=1, out_channels=1, num_res_blocks=1,
                                     channels=(16, 32), attention_levels=(False, False), latent_channels=4,
                                     norm_num_groups=8, with_encoder_nonlocal_attn=False,
                                     with_decoder_nonlocal_attn=False)
            return _FirstOutput(net), _randn(gen, 2, 1, 32, 32)
        if name == "HighResNet":
            return nets.HighResNet(spatial_dims=3, in_channels=1, out_channels=2, norm_type="instance",
                                   **kw), _randn(gen, 2, 1, 16, 16, 16)
        if name == "SegResNetDS":
            return nets.SegResNetDS(spatial_dims=3, init_filters=8, in_channels=1, out_channels=2,
                                    norm=("group", {"num_groups": 4}), blocks_down=(1, 1, 1)), \
                _randn(gen, 2, 1, 32, 32, 32)
        if name == "SegResNetVAE":
            net = nets.SegResNetVAE(input_image_size=(32, 32), spatial_dims=2, init_filters=8, in_channels=1,
                                    out_channels=2, vae_nz=16)
            return _FirstOutput(net), _randn(gen, 2, 1, 32, 32)
        raise ValueError(f"unknown MONAI net {name!r}")
    return build


def _FirstOutput(model: Any) -> Any:  # noqa: N802 - builds a module, named as one
    """The first output of a net that returns (output, extra) where the extra may be None
    (MONAI ``AutoencoderKL``: reconstruction, mu, sigma; ``SegResNetVAE``: output, VAE loss)."""
    import torch.nn as nn

    class First(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Any) -> Any:
            return tuple(o for o in self.inner(x) if o is not None)

    return First(model)


# --------------------------------------------------------------------------- the families

NORM_MORE_FAMILIES: Dict[str, Dict[str, Entry]] = {
    "p3dunet": {
        "UNet3D-gcr": ("segmentation", _p3d("UNet3D")),
        "UNet3D-cgr": ("segmentation", _p3d("UNet3D", order="cgr")),
        "ResidualUNet3D-gcr": ("segmentation", _p3d("ResidualUNet3D")),
        "ResidualUNetSE3D-gcr": ("segmentation", _p3d("ResidualUNetSE3D")),
        "UNet2D-gcr": ("segmentation", _p3d("UNet2D")),
        "UNet2D-cgr": ("segmentation", _p3d("UNet2D", order="cgr")),
    },
    "fepunet": {
        "UNet2D-instance": ("segmentation", _fep(2)),
        "UNet3D-instance": ("segmentation", _fep(3)),
        "UNet3D-instance-preactivation": ("segmentation", _fep(3, preactivation=True)),
        "UNet3D-instance-residual": ("segmentation", _fep(3, residual=True)),
    },
    "cfm": {
        "UNetModel": ("diffusion", _cfm()),
        "UNetModel-scale-shift": ("diffusion", _cfm(use_scale_shift_norm=True, resblock_updown=True)),
    },
    "taming": {
        "VQGAN-Encoder": ("autoencoder", _taming("Encoder")),
        "VQGAN-Decoder": ("autoencoder", _taming("Decoder")),
        "DDPM-Model": ("diffusion", _taming("Model")),
    },
    "ddpm": {
        "Unet": ("diffusion", _ddpm("Unet")),
        "Unet1D": ("diffusion", _ddpm("Unet1D")),
    },
    "vdiff": {
        "Unet3D": ("diffusion", _vdiff),
    },
    "hfconvnext": {
        "ConvNextModel": ("classification", _hf_convnext("v1")),
        "ConvNextV2Model": ("classification", _hf_convnext("v2")),
    },
    "monai2": {
        "UNETR-3d": ("segmentation", _monai2("UNETR")),
        "SwinUNETR-2d": ("segmentation", _monai2("SwinUNETR")),
        "DiffusionModelUNet-2d": ("diffusion", _monai2("DiffusionModelUNet")),
        "AutoencoderKL-2d": ("autoencoder", _monai2("AutoencoderKL")),
        "HighResNet-3d-instance": ("segmentation", _monai2("HighResNet")),
        "SegResNetDS-3d-group": ("segmentation", _monai2("SegResNetDS")),
        "SegResNetVAE-2d": ("segmentation", _monai2("SegResNetVAE")),
    },
}
