"""Two model libraries for ``bm_sweep.py``: Hugging Face ``transformers`` (``hf``) and ``kornia``.

``transformers`` 5.x vision and audio models are built from small configs (hidden sizes, depths
and image sizes shrunk so each converts in well under a minute on one CPU thread; no hub
download: ``HF_HUB_OFFLINE=1``, no pretrained backbone). ``kornia`` 0.9 feature / contrib
networks are built with ``pretrained=False`` (``TORCH_HOME`` points at an empty folder, so a
download that slipped through fails fast instead of fetching weights).

Set-up (``--no-deps``: both would otherwise resolve another torch)::

    pip install --no-deps transformers==5.24.0 tokenizers==0.23.3 huggingface_hub==2.4.0 safetensors regex
    pip install --no-deps kornia==0.9.0 kornia_rs==0.2.0

Each entry maps a model name to a builder returning ``(model, example_inputs)``; the caller
seeds torch first and passes the generator for the inputs.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Tuple

__all__ = ["HF_MODELS", "KORNIA_MODELS", "build_hf", "build_kornia", "offline"]

Built = Tuple[Any, Tuple[Any, ...]]


def offline() -> None:
    """No downloads: the hub offline, torch hub / kornia caches in an empty temporary folder."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("TORCH_HOME", "/tmp/bm_sweep_torch_home_empty")
    os.environ.setdefault("HF_HOME", "/tmp/bm_sweep_hf_home_empty")


# --------------------------------------------------------------------------- transformers

def _image(gen: Any, size: int = 64) -> Tuple[Any, ...]:
    import torch

    return (torch.randn(2, 3, size, size, generator=gen),)


def _resnet_cfg() -> Any:
    from transformers import ResNetConfig

    return ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_labels=10)


def _hf_vision(model_cls: str, cfg_cls: str, size: int = 64, **cfg: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        import transformers

        config = getattr(transformers, cfg_cls)(**cfg)
        return getattr(transformers, model_cls)(config), _image(gen, size)
    return build


def _upernet(gen: Any) -> Built:
    from transformers import ConvNextConfig, UperNetConfig, UperNetForSemanticSegmentation

    backbone = ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                              out_features=["stage1", "stage2", "stage3", "stage4"])
    config = UperNetConfig(backbone_config=backbone, hidden_size=32, auxiliary_in_channels=64,
                           auxiliary_channels=32, num_labels=4, use_pretrained_backbone=False)
    return UperNetForSemanticSegmentation(config), _image(gen)


def _detr(model_cls: str, cfg_cls: str, **extra: Any) -> Callable[[Any], Built]:
    """A DETR-family detector on a small transformers ResNet backbone (no timm, no weights)."""
    def build(gen: Any) -> Built:
        import transformers

        backbone = _resnet_cfg()
        backbone.out_features = ["stage2", "stage3", "stage4"] if extra.get("multi") else ["stage4"]
        kw = {k: v for k, v in extra.items() if k != "multi"}
        config = getattr(transformers, cfg_cls)(
            use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False, backbone=None,
            d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=10, num_labels=5, **kw)
        return getattr(transformers, model_cls)(config), _image(gen)
    return build


def _rtdetr(gen: Any) -> Built:
    from transformers import RTDetrConfig, RTDetrForObjectDetection, RTDetrResNetConfig

    backbone = RTDetrResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                  out_features=["stage2", "stage3", "stage4"])
    config = RTDetrConfig(backbone_config=backbone, use_pretrained_backbone=False, encoder_in_channels=[32, 64, 128],
                          encoder_hidden_dim=32, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                          decoder_in_channels=[32, 32, 32], decoder_layers=2, encoder_layers=1, num_queries=10, num_labels=5,
                          num_denoising=0, anchor_image_size=None)
    return RTDetrForObjectDetection(config), _image(gen)


def _dfine(gen: Any) -> Built:
    from transformers import DFineConfig, DFineForObjectDetection, HGNetV2Config

    backbone = HGNetV2Config(stem_channels=[3, 8, 16], stage_in_channels=[16, 16, 32, 64],
                             stage_mid_channels=[8, 16, 32, 64], stage_out_channels=[16, 32, 64, 128],
                             stage_num_blocks=[1, 1, 1, 1], stage_numb_of_layers=[2, 2, 2, 2],
                             stage_downsample=[False, True, True, True], stage_light_block=[False, False, True, True],
                             stage_kernel_size=[3, 3, 5, 5], hidden_sizes=[16, 32, 64, 128],
                             out_features=["stage2", "stage3", "stage4"])
    config = DFineConfig(backbone_config=backbone, use_pretrained_backbone=False, encoder_in_channels=[32, 64, 128],
                         encoder_hidden_dim=32, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                         decoder_in_channels=[32, 32, 32], decoder_layers=2, encoder_layers=1, num_queries=10, num_labels=5,
                         num_denoising=0, anchor_image_size=None, hidden_expansion=0.5)
    return DFineForObjectDetection(config), _image(gen)


def _fastspeech2(gen: Any) -> Built:
    import torch
    from transformers import FastSpeech2ConformerConfig, FastSpeech2ConformerModel

    config = FastSpeech2ConformerConfig(
        hidden_size=32, vocab_size=40, num_mel_bins=16, encoder_num_attention_heads=2, decoder_num_attention_heads=2,
        encoder_layers=1, decoder_layers=1, encoder_linear_units=64, decoder_linear_units=64,
        speech_decoder_postnet_layers=2, speech_decoder_postnet_units=32, duration_predictor_channels=32,
        pitch_predictor_channels=32, energy_predictor_channels=32, duration_predictor_layers=1,
        pitch_predictor_layers=1, energy_predictor_layers=1)
    ids = torch.randint(1, 40, (2, 12), generator=gen)
    mask = torch.ones(2, 12, dtype=torch.long)
    durations = torch.randint(1, 3, (2, 12), generator=gen)  # training needs every label
    frames = int(durations.sum(1).max())
    spectrogram = torch.randn(2, frames, 16, generator=gen)
    pitch, energy = torch.randn(2, 12, 1, generator=gen), torch.randn(2, 12, 1, generator=gen)
    return FastSpeech2ConformerModel(config), (ids, mask, spectrogram, durations, pitch, energy)


def _clap(gen: Any) -> Built:
    import torch
    from transformers import ClapAudioConfig, ClapAudioModel

    config = ClapAudioConfig(window_size=4, num_mel_bins=32, spec_size=64, patch_size=4, patch_stride=(4, 4),
                             depths=[1, 1], num_attention_heads=[2, 4], hidden_size=64, patch_embeds_hidden_size=16,
                             projection_hidden_size=64, enable_fusion=False)
    feats = torch.randn(2, 1, 64, 32, generator=gen)
    return ClapAudioModel(config), (feats,)


def _wav2vec2_conformer(gen: Any) -> Built:
    import torch
    from transformers import Wav2Vec2ConformerConfig, Wav2Vec2ConformerModel

    config = Wav2Vec2ConformerConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, conv_depthwise_kernel_size=7, position_embeddings_type="relative",
        feat_extract_norm="layer", do_stable_layer_norm=True, mask_time_prob=0.0)
    wave = torch.randn(2, 800, generator=gen)
    return Wav2Vec2ConformerModel(config), (wave,)


HF_MODELS: Dict[str, Tuple[str, Callable[[Any], Built]]] = {
    "ResNet": ("classification", _hf_vision("ResNetForImageClassification", "ResNetConfig", embedding_size=16,
                                            hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_labels=10)),
    "ResNet-bottleneck": ("classification", _hf_vision(
        "ResNetForImageClassification", "ResNetConfig", embedding_size=16, hidden_sizes=[32, 64, 128, 256],
        depths=[1, 2, 1, 1], layer_type="bottleneck", downsample_in_bottleneck=True, num_labels=10)),
    "MobileNetV1": ("classification", _hf_vision("MobileNetV1ForImageClassification", "MobileNetV1Config",
                                                 image_size=64, depth_multiplier=0.25, num_labels=10)),
    "MobileNetV2": ("classification", _hf_vision("MobileNetV2ForImageClassification", "MobileNetV2Config",
                                                 image_size=64, depth_multiplier=0.35, num_labels=10)),
    "EfficientNet": ("classification", _hf_vision(
        "EfficientNetForImageClassification", "EfficientNetConfig", image_size=64, width_coefficient=0.25,
        depth_coefficient=0.25, hidden_dim=320, num_labels=10)),
    "RegNet": ("classification", _hf_vision("RegNetForImageClassification", "RegNetConfig", embedding_size=16,
                                            hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], groups_width=8,
                                            num_labels=10)),
    "MobileViT": ("classification", _hf_vision(
        "MobileViTForImageClassification", "MobileViTConfig", image_size=64, hidden_sizes=[32, 40, 48],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], num_attention_heads=2, num_labels=10)),
    "MobileViTV2": ("classification", _hf_vision("MobileViTV2ForImageClassification", "MobileViTV2Config",
                                                 image_size=64, width_multiplier=0.25, num_labels=10)),
    "UperNet-ConvNext": ("segmentation", _upernet),
    "Cvt": ("classification", _hf_vision("CvtForImageClassification", "CvtConfig", embed_dim=[16, 32, 64],
                                         num_heads=[1, 2, 2], depth=[1, 2, 3], num_labels=10)),
    "RTDetr": ("detection", _rtdetr),
    "DFine": ("detection", _dfine),
    "Detr": ("detection", _detr("DetrForObjectDetection", "DetrConfig")),
    "ConditionalDetr": ("detection", _detr("ConditionalDetrForObjectDetection", "ConditionalDetrConfig")),
    "TableTransformer": ("detection", _detr("TableTransformerForObjectDetection", "TableTransformerConfig")),
    "DeformableDetr": ("detection", _detr("DeformableDetrForObjectDetection", "DeformableDetrConfig", multi=True,
                                          num_feature_levels=3, encoder_n_points=2, decoder_n_points=2)),
    "FastSpeech2Conformer": ("speech", _fastspeech2),
    "ClapAudio": ("audio", _clap),
    "Wav2Vec2Conformer": ("audio", _wav2vec2_conformer),
}


def build_hf(name: str, gen: Any) -> Built:
    """A ``transformers`` model of :data:`HF_MODELS` (training mode) and its example inputs."""
    offline()
    import transformers  # noqa: F401 - after torchvision (the caller imports it first)

    return HF_MODELS[name][1](gen)


# --------------------------------------------------------------------------- kornia

def _kornia_feature(cls: str, size: int = 32, channels: int = 1, **kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        import torch
        import kornia.feature as KF

        return getattr(KF, cls)(pretrained=False, **kw), (torch.randn(2, channels, size, size, generator=gen),)
    return build


def _affnet(gen: Any) -> Built:
    import torch
    import kornia.feature as KF

    model = KF.LAFAffNetShapeEstimator(pretrained=False)
    centers = torch.rand(2, 4, 2, generator=gen) * 32 + 16
    laf = KF.laf_from_center_scale_ori(centers, torch.full((2, 4, 1, 1), 8.0))
    return model, (laf, torch.rand(2, 1, 64, 64, generator=gen))


def _xfeat(gen: Any) -> Built:
    import torch
    from kornia.feature.xfeat import XFeatModel

    return XFeatModel(), (torch.rand(2, 1, 64, 64, generator=gen),)


def _sold2(gen: Any) -> Built:
    import dataclasses

    import torch
    from kornia.feature.sold2.backbones import SOLD2Net
    from kornia.feature.sold2.structures import DetectorCfg

    cfg = DetectorCfg()
    cfg.use_descriptor = True
    return SOLD2Net(dataclasses.asdict(cfg)), (torch.rand(2, 1, 64, 64, generator=gen),)


def _tinyvit(gen: Any) -> Built:
    import torch
    from kornia.models.tiny_vit import TinyViT

    model = TinyViT(img_size=64, embed_dims=[16, 32, 64, 64], depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 2],
                    window_sizes=[2, 2, 4, 2], num_classes=10)
    return model, (torch.randn(2, 3, 64, 64, generator=gen),)


def _dedode_detector(gen: Any) -> Built:
    import torch
    from kornia.feature.dedode.dedode_models import get_detector

    return get_detector("L", torch.float32), (torch.rand(1, 3, 64, 64, generator=gen),)


KORNIA_MODELS: Dict[str, Tuple[str, Callable[[Any], Built]]] = {
    "OriNet": ("features", _kornia_feature("OriNet")),
    "SOSNet": ("features", _kornia_feature("SOSNet")),
    "HardNet": ("features", _kornia_feature("HardNet")),
    "HardNet8": ("features", _kornia_feature("HardNet8")),
    "HyNet": ("features", _kornia_feature("HyNet")),
    "AffNet": ("features", _affnet),
    "XFeat": ("features", _xfeat),
    "SOLD2": ("lines", _sold2),
    "TinyViT": ("classification", _tinyvit),
    "DeDoDe-detector": ("features", _dedode_detector),
}


def build_kornia(name: str, gen: Any) -> Built:
    """A ``kornia`` network of :data:`KORNIA_MODELS` (no weights) and its example inputs."""
    offline()
    return KORNIA_MODELS[name][1](gen)
