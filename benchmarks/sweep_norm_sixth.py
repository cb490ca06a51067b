"""A sixth round of per-sample-norm networks (after :mod:`sweep_norm_fifth`): diffusers' video / 3-D models and
transformers' convolutional audio encoders and vision nets, never run before.

Three families for ``bm_sweep.py`` (merged into :data:`sweep_norm_libs.NORM_FAMILIES`), each built from the
library's own code from a tiny configuration (a few channels, one or two layers, small inputs, batch 2), no
weights. Both libraries are in the dev environment (``diffusers`` 0.42.1, ``transformers`` 5.24.0); nothing is
installed for this round.

* ``diff2``: ``diffusers`` models the ``diff`` family does not build: the video / 3-D autoencoders
  (``AutoencoderKLCogVideoX``, ``AutoencoderKLTemporalDecoder``, ``AutoencoderKLHunyuanVideo``,
  ``AutoencoderKLMochi``, ``AutoencoderKLLTXVideo``, ``AutoencoderKLWan``: GroupNorm, channel RMSNorm, causal 3-D
  convolutions), ``AutoencoderDC`` (channel RMSNorm), ``AsymmetricAutoencoderKL``, the video UNets
  (``UNet3DConditionModel``, ``UNetSpatioTemporalConditionModel``), ``Kandinsky3UNet``, ``ControlNetModel``
  and ``UVit2DModel`` (diffusers' ``RMSNorm`` on channels-last maps). Called with ``return_dict=False``.
* ``hfaudio``: ``transformers``' convolutional feature encoders: ``Wav2Vec2Model`` with
  ``feat_extract_norm="group"`` (``GroupNorm(C, C)`` after the first convolution) and ``"layer"`` (each
  convolution -> transpose -> ``LayerNorm`` over channels -> transpose -> GELU), ``HubertModel``, ``WavLMModel``,
  ``SEWModel``, ``Data2VecAudioModel``, ``UniSpeechModel``, SpeechT5's speech encoder prenet and ``EncodecModel``
  with ``norm_type="time_group_norm"`` (``GroupNorm(1, C)`` after each convolution).
* ``hfvision2``: ``transformers``' vision nets with per-sample norms beside convolutions: ``BitModel``
  (GroupNorm, weight-standardised convolutions; pre-activation and bottleneck), ``MobileViTV2Model``
  (``GroupNorm(1, C)``), ``CvtModel`` (convolutional embedding -> LayerNorm), ``PoolFormerModel``,
  ``VitDetBackbone`` with residual blocks (``VitDetLayerNorm``, channels-first), SAM's vision encoder (its neck:
  conv -> ``SamLayerNorm`` channels-first), ``FocalNetModel``, ``PvtV2Model``, ``Swin2SRModel``, ``GLPNModel``.
  (``MobileViTV2`` and ``Cvt`` ran before in the ``hf`` family as classifiers, for their BatchNorms; their
  per-sample norms are counted here for the first time.)

Looked at and not run: ``T2IAdapter`` (no norm in its blocks), ``UNetMotionModel`` (needs a motion adapter's
weights layout; the spatio-temporal UNet stands for the video UNets), ``ConsistencyDecoderVAE`` (its decoder is a
sampling loop drawing noise), ``Mask2Former``'s pixel decoder (needs a backbone's multi-scale deformable attention;
not small on this CPU).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from sweep_norm_more import Built, Entry, _randn

__all__ = ["NORM_SIXTH_FAMILIES"]


def _wrap(model: Any, first: int = 0, **kw: Any) -> Any:
    """``model`` called as ``model(*inputs, return_dict=False, **kw)``: what a training script's
    ``model(...).sample`` computes, as a tuple the sweep's loss reads, from its output ``first`` on
    (``convbn.memory.timeline``'s default loss, which the sweep's peak takes, reads the first tensor:
    not an integer one such as EncodecModel's codes)."""
    import torch.nn as nn

    class ReturnTuple(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: Any) -> Any:
            out = self.inner(*args, return_dict=False, **kw)
            return out[first:] if first else out

    return ReturnTuple(model)


def _diffusers() -> Any:
    from sweep_more_libs import offline

    offline()
    import diffusers

    return diffusers


# --------------------------------------------------------------------------- diffusers: video / 3-D autoencoders

def _video(gen: Any, channels: int = 3, frames: int = 5, size: int = 32) -> Tuple[Any, ...]:
    return _randn(gen, 2, channels, frames, size, size)


def _cogvideox(gen: Any) -> Built:
    d = _diffusers()
    vae = d.AutoencoderKLCogVideoX(
        down_block_types=("CogVideoXDownBlock3D",) * 2, up_block_types=("CogVideoXUpBlock3D",) * 2,
        block_out_channels=(32, 64), latent_channels=4, layers_per_block=1, norm_num_groups=16,
        temporal_compression_ratio=2, sample_height=32, sample_width=32)
    return _wrap(vae), _video(gen)


def _temporal_decoder(gen: Any) -> Built:
    d = _diffusers()
    vae = d.AutoencoderKLTemporalDecoder(down_block_types=("DownEncoderBlock2D",) * 2, block_out_channels=(32, 64),
                                         layers_per_block=1, latent_channels=4)
    return _wrap(vae, num_frames=2), _randn(gen, 2, 3, 32, 32)


def _hunyuan(gen: Any) -> Built:
    d = _diffusers()
    vae = d.AutoencoderKLHunyuanVideo(
        latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 2,
        up_block_types=("HunyuanVideoUpBlock3D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
        norm_num_groups=16, spatial_compression_ratio=2, temporal_compression_ratio=4, mid_block_add_attention=False)
    return _wrap(vae), _video(gen)


def _mochi(gen: Any) -> Built:
    d = _diffusers()
    vae = d.AutoencoderKLMochi(
        in_channels=15, encoder_block_out_channels=(32, 64), decoder_block_out_channels=(32, 64), latent_channels=4,
        layers_per_block=(1, 1, 1), temporal_expansions=(1,), spatial_expansions=(2,),
        add_attention_block=(False, False, False), latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)
    return _wrap(vae), _video(gen, frames=7, size=16)


def _ltx(gen: Any) -> Built:
    d = _diffusers()
    vae = d.AutoencoderKLLTXVideo(
        latent_channels=8, block_out_channels=(16, 32), down_block_types=("LTXVideoDownBlock3D",) * 2,
        decoder_block_out_channels=(16, 32), layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, False), decoder_spatio_temporal_scaling=(True, False),
        decoder_inject_noise=(False, False, False), downsample_type=("conv", "conv"), upsample_residual=(False, False),
        upsample_factor=(1, 1), patch_size=2, patch_size_t=1)
    return _wrap(vae), _video(gen, frames=5, size=16)


def _wan(gen: Any) -> Built:
    d = _diffusers()
    vae = d.AutoencoderKLWan(base_dim=16, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                             latents_mean=[0.0] * 4, latents_std=[1.0] * 4, scale_factor_temporal=2,
                             scale_factor_spatial=2)
    return _wrap(vae), _video(gen, size=16)


def _dc(gen: Any) -> Built:
    d = _diffusers()
    vae = d.AutoencoderDC(
        latent_channels=4, attention_head_dim=8, encoder_block_types="ResBlock", decoder_block_types="ResBlock",
        encoder_block_out_channels=(16, 32), decoder_block_out_channels=(16, 32), encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), ()), decoder_qkv_multiscales=((), ()))
    return _wrap(vae), _randn(gen, 2, 3, 32, 32)


def _asym(gen: Any) -> Built:
    d = _diffusers()
    vae = d.AsymmetricAutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2, down_block_out_channels=(32, 64), layers_per_down_block=1,
        up_block_types=("UpDecoderBlock2D",) * 2, up_block_out_channels=(32, 64), layers_per_up_block=1,
        latent_channels=4, norm_num_groups=16, sample_size=32)
    return _wrap(vae), _randn(gen, 2, 3, 32, 32)


# --------------------------------------------------------------------------- diffusers: UNets

def _steps() -> Any:
    import torch

    return torch.tensor([10, 500])


def _unet3d(gen: Any) -> Built:
    import torch

    d = _diffusers()
    unet = d.UNet3DConditionModel(
        in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), block_out_channels=(32, 64), layers_per_block=1,
        norm_num_groups=16, cross_attention_dim=32, attention_head_dim=8)
    ctx = torch.randn(2, 7, 32, generator=gen)
    return _wrap(unet), (*_randn(gen, 2, 4, 2, 16, 16), _steps(), ctx)


def _spatio_temporal(gen: Any) -> Built:
    import torch

    d = _diffusers()
    unet = d.UNetSpatioTemporalConditionModel(
        in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"), block_out_channels=(32, 64),
        addition_time_embed_dim=8, projection_class_embeddings_input_dim=24, layers_per_block=1,
        cross_attention_dim=32, num_attention_heads=(2, 4), num_frames=2)
    ctx = torch.randn(2, 1, 32, generator=gen)
    added = torch.randn(2, 3, generator=gen)
    return _wrap(unet), (*_randn(gen, 2, 2, 4, 16, 16), _steps(), ctx, added)


def _controlnet(gen: Any) -> Built:
    import torch

    d = _diffusers()
    net = d.ControlNetModel(
        in_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), block_out_channels=(32, 64),
        layers_per_block=1, norm_num_groups=16, cross_attention_dim=32, attention_head_dim=8,
        conditioning_embedding_out_channels=(16, 32))
    ctx = torch.randn(2, 7, 32, generator=gen)
    cond = torch.randn(2, 3, 32, 32, generator=gen)
    return _wrap(net), (*_randn(gen, 2, 4, 16, 16), _steps(), ctx, cond)


def _uvit2d(gen: Any) -> Built:
    import torch

    d = _diffusers()
    net = d.UVit2DModel(hidden_size=32, cond_embed_dim=16, micro_cond_encode_dim=4, micro_cond_embed_dim=20,
                        encoder_hidden_size=16, vocab_size=40, codebook_size=32, in_channels=16, block_out_channels=32,
                        num_res_blocks=1, block_num_heads=2, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, sample_size=8)
    ids = torch.randint(0, 40, (2, 8, 8), generator=gen)
    ctx = torch.randn(2, 5, 16, generator=gen)
    pooled = torch.randn(2, 16, generator=gen)
    micro = torch.rand(2, 5, generator=gen) * 10
    return _UVitCall(net), (ids, ctx, pooled, micro)


def _UVitCall(net: Any) -> Any:  # noqa: N802 - builds the wrapper module
    import torch.nn as nn

    class UVitCall(nn.Module):
        """``UVit2DModel`` returns its logits (no ``return_dict``): a tuple for the sweep's loss."""

        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, ids: Any, ctx: Any, pooled: Any, micro: Any) -> Any:
            return (self.inner(ids, encoder_hidden_states=ctx, pooled_text_emb=pooled, micro_conds=micro),)

    return UVitCall(net)


# --------------------------------------------------------------------------- transformers: audio encoders

def _transformers() -> Any:
    from sweep_more_libs import offline

    offline()
    import transformers

    return transformers


_SPEECH = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16, 16),
               conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
               num_conv_pos_embedding_groups=2, mask_time_prob=0.0, layerdrop=0.0)


def _speech(model_cls: str, cfg_cls: str, **cfg: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        t = _transformers()
        config = getattr(t, cfg_cls)(**{**_SPEECH, **cfg})
        return _wrap(getattr(t, model_cls)(config)), _randn(gen, 2, 1600)
    return build


def _speecht5_prenet(gen: Any) -> Built:
    t = _transformers()
    from transformers.models.speecht5.modeling_speecht5 import SpeechT5SpeechEncoderPrenet

    config = t.SpeechT5Config(hidden_size=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                              decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                              conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                              num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
                              feat_extract_norm="group")
    return SpeechT5SpeechEncoderPrenet(config), _randn(gen, 2, 1600)


def _encodec(gen: Any) -> Built:
    t = _transformers()
    config = t.EncodecConfig(target_bandwidths=[1.5], hidden_size=16, num_filters=8, num_residual_layers=1,
                             upsampling_ratios=[2, 2], norm_type="time_group_norm", use_causal_conv=False,
                             num_lstm_layers=1, codebook_size=16, codebook_dim=16, sampling_rate=400)
    return _wrap(t.EncodecModel(config), first=1), _randn(gen, 2, 1, 400)  # the codes, then the audio


# --------------------------------------------------------------------------- transformers: vision nets

def _vision(model_cls: str, cfg_cls: str, size: int = 64, **cfg: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        t = _transformers()
        config = getattr(t, cfg_cls)(**cfg)
        return _wrap(getattr(t, model_cls)(config)), _randn(gen, 2, 3, size, size)
    return build


_FOUR = dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])
_SEGF = dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_attention_heads=[1, 1, 2, 2],
             sr_ratios=[4, 2, 1, 1])

NORM_SIXTH_FAMILIES: Dict[str, Dict[str, Entry]] = {
    "diff2": {
        "AutoencoderKLCogVideoX": ("autoencoder", _cogvideox),
        "AutoencoderKLTemporalDecoder": ("autoencoder", _temporal_decoder),
        "AutoencoderKLHunyuanVideo": ("autoencoder", _hunyuan),
        "AutoencoderKLMochi": ("autoencoder", _mochi),
        "AutoencoderKLLTXVideo": ("autoencoder", _ltx),
        "AutoencoderKLWan": ("autoencoder", _wan),
        "AutoencoderDC": ("autoencoder", _dc),
        "AsymmetricAutoencoderKL": ("autoencoder", _asym),
        "UNet3DConditionModel": ("diffusion", _unet3d),
        "UNetSpatioTemporalConditionModel": ("diffusion", _spatio_temporal),
        "ControlNetModel": ("diffusion", _controlnet),
        "UVit2DModel": ("diffusion", _uvit2d),
    },
    "hfaudio": {
        "Wav2Vec2Model-group": ("audio", _speech("Wav2Vec2Model", "Wav2Vec2Config", feat_extract_norm="group")),
        "Wav2Vec2Model-layer": ("audio", _speech("Wav2Vec2Model", "Wav2Vec2Config", feat_extract_norm="layer",
                                                 do_stable_layer_norm=True)),
        "HubertModel": ("audio", _speech("HubertModel", "HubertConfig", feat_extract_norm="group")),
        "WavLMModel": ("audio", _speech("WavLMModel", "WavLMConfig", feat_extract_norm="layer", num_buckets=16,
                                        max_bucket_distance=32)),
        "SEWModel": ("audio", _speech("SEWModel", "SEWConfig", feat_extract_norm="group", squeeze_factor=2)),
        "Data2VecAudioModel": ("audio", _speech("Data2VecAudioModel", "Data2VecAudioConfig", conv_pos_kernel_size=5,
                                                num_conv_pos_embeddings=2)),
        "UniSpeechModel": ("audio", _speech("UniSpeechModel", "UniSpeechConfig", feat_extract_norm="group")),
        "SpeechT5SpeechEncoderPrenet": ("audio", _speecht5_prenet),
        "EncodecModel-time_group_norm": ("audio", _encodec),
    },
    "hfvision2": {
        "BitModel-preactivation": ("classification", _vision("BitModel", "BitConfig", embedding_size=16, num_groups=8,
                                                             **_FOUR)),
        "BitModel-bottleneck": ("classification", _vision("BitModel", "BitConfig", embedding_size=16, num_groups=8,
                                                          layer_type="bottleneck", hidden_sizes=[32, 64, 128, 256],
                                                          depths=[1, 1, 1, 1])),
        "MobileViTV2Model": ("classification", _vision("MobileViTV2Model", "MobileViTV2Config", image_size=64,
                                                       width_multiplier=0.25)),
        "CvtModel": ("classification", _vision("CvtModel", "CvtConfig", embed_dim=[16, 32, 64], num_heads=[1, 2, 2],
                                               depth=[1, 2, 3])),
        "PoolFormerModel": ("classification", _vision("PoolFormerModel", "PoolFormerConfig", **_FOUR)),
        "VitDetBackbone-residual": ("detection", _vision(
            "VitDetBackbone", "VitDetConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            image_size=64, pretrain_image_size=64, patch_size=8, residual_block_indices=[0, 1],
            out_features=["stage2"])),
        "SamVisionModel": ("segmentation", _vision(
            "SamVisionModel", "SamVisionConfig", hidden_size=32, output_channels=16, num_hidden_layers=1,
            num_attention_heads=2, image_size=64, patch_size=8, window_size=4, global_attn_indexes=[0], mlp_dim=64)),
        "FocalNetModel": ("classification", _vision("FocalNetModel", "FocalNetConfig", image_size=64, embed_dim=16,
                                                    hidden_sizes=[32, 64], depths=[1, 1], focal_levels=[2, 2],
                                                    focal_windows=[3, 3], use_conv_embed=True)),
        "PvtV2Model": ("classification", _vision("PvtV2Model", "PvtV2Config", image_size=64, **_SEGF)),
        "Swin2SRModel": ("super-resolution", _vision("Swin2SRModel", "Swin2SRConfig", size=32, image_size=32,
                                                     embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)),
        "GLPNModel": ("depth", _vision("GLPNModel", "GLPNConfig", **_SEGF)),
    },
}
