"""More model libraries for ``bm_sweep.py``, none of them run by the sweep before.

Each family is one library, its networks built from code or config without weights (no
download: only the package index is reachable), on small CPU inputs:

* ``bd``: ``braindecode`` EEG / sleep / EMG networks (``n_chans``, ``n_times`` small).
* ``effnet``: ``efficientnet_pytorch`` (TF "SAME" padding computed from the input's shape when
  ``image_size`` is unset; inline drop-connect ``torch.rand([batch, 1, 1, 1])``).
* ``dna``: ``dynamic_network_architectures`` (nnU-Net's 2-D / 3-D U-Nets; ``nonlin_first``
  puts the activation before the BatchNorm).
* ``xrv``: ``torchxrayvision`` (chest X-ray DenseNet, ResNet auto-encoder).
* ``clip``: ``open_clip`` ``ModifiedResNet`` (attention pooling; ``lock`` freezes its BatchNorms).
* ``facenet``: ``facenet_pytorch`` ``InceptionResnetV1``.
* ``effdet``: ``effdet`` EfficientDet (BiFPN with BatchNorm, TF "SAME" backbones).
* ``lightly``: ``lightly`` self-supervised projection / prediction heads (Linear -> BatchNorm1d)
  and its CIFAR ResNet generator.
* ``sb``: ``speechbrain`` speaker / speech encoders (BatchNorm1d on ``(N, L, C)`` through a
  transpose wrapper).
* ``smp3d``: ``segmentation_models_pytorch_3d`` volumetric segmentation nets.
* ``td``: ``torchdistill`` CIFAR classifiers.
* ``timm3d``: ``timm_3d`` volumetric classifiers.
* ``vitp``: ``vit_pytorch`` hybrid ViTs with BatchNorm (LeViT, MobileViT, MaxViT, XCiT, CvT).
* ``pyg``: ``torch_geometric`` graph networks with BatchNorm (``norm="batch_norm"``).

Some of these import a module they do not use for the networks built here, and whose wheel
does not load on this torch (``torchaudio``'s compiled extension) or is not installed (an
optional dependency): :func:`import_lenient` imports the library with an empty stand-in for
each such module (a class taken from it raises when instantiated), and
:data:`STAND_INS` records which. ``effdet`` scripts a post-processing function with
TorchScript at import; it is imported with ``torch.jit.script`` as the identity.

Set-up (``--no-deps``; see ``requirements-sweep.txt`` for the pinned versions)::

    pip install --no-deps -r benchmarks/requirements-sweep.txt

Each entry maps a model name to ``(task, builder)``; a builder takes the caller's seeded
generator and returns ``(model, example_inputs)``.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import types
from typing import Any, Callable, Dict, List, Tuple

__all__ = ["MORE_FAMILIES", "STAND_INS", "build_more", "import_lenient"]

Built = Tuple[Any, Tuple[Any, ...]]
Entry = Tuple[str, Callable[[Any], Built]]

#: modules replaced by an empty stand-in so that a library imports
STAND_INS: List[str] = []


def _stand_in(name: str) -> None:
    """An empty module ``name`` (and parents): attributes are classes that raise when built."""
    def missing(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)

        class Missing:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise ImportError(f"{name}.{attr} is a stand-in: the module does not load here")
        return Missing

    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub in sys.modules:
            continue
        mod = types.ModuleType(sub)
        mod.__getattr__ = missing  # type: ignore[attr-defined]
        mod.__path__ = []  # type: ignore[attr-defined]
        mod.__spec__ = importlib.machinery.ModuleSpec(sub, None, is_package=True)
        mod.__version__ = "0.0"  # type: ignore[attr-defined]
        sys.modules[sub] = mod
        if i > 1:
            setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], mod)
    STAND_INS.append(name)


def import_lenient(module: str) -> Any:
    """Import ``module``; each module it needs that is missing or does not load becomes a stand-in."""
    root = module.split(".")[0]
    for _ in range(40):
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if not exc.name or exc.name.split(".")[0] == root:
                raise
            missing = exc.name
        except OSError as exc:  # a compiled extension built for another torch
            if "torchaudio" not in str(exc):
                raise
            for key in [k for k in sys.modules if k.split(".")[0] == "torchaudio"]:
                del sys.modules[key]
            missing = "torchaudio"
        for key in [k for k in sys.modules if k.split(".")[0] == root]:
            del sys.modules[key]
        for sub in ("", ".functional", ".transforms") if missing == "torchaudio" else ("",):
            _stand_in(missing + sub)
    raise ImportError(f"{module}: too many missing modules ({STAND_INS})")


def offline() -> None:
    """No downloads: torch hub / hub caches in an empty temporary folder."""
    os.environ.setdefault("TORCH_HOME", "/tmp/bm_sweep_torch_home_empty")
    os.environ["HF_HUB_OFFLINE"] = "1"


def _randn(gen: Any, *shape: int) -> Tuple[Any, ...]:
    import torch

    return (torch.randn(*shape, generator=gen),)


# --------------------------------------------------------------------------- braindecode

#: name -> (n_chans, n_times, sfreq, extra kwargs)
_BD: Dict[str, Tuple[int, int, float, Dict[str, Any]]] = {}


def _bd(name: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        models = import_lenient("braindecode.models")
        chans, times, sfreq, extra = _BD[name]
        model = getattr(models, name.split("-")[0])(n_chans=chans, n_outputs=4, n_times=times, sfreq=sfreq, **extra)
        return model, _randn(gen, 2, chans, times)
    return build


# --------------------------------------------------------------------------- efficientnet_pytorch

def _effnet(name: str, **kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        from efficientnet_pytorch import EfficientNet

        return EfficientNet.from_name(name, num_classes=10, **kw), _randn(gen, 2, 3, 64, 64)
    return build


# --------------------------------------------------------------------------- dynamic_network_architectures

def _dna(arch: str, dim: int, *, norm_kind: str = "batch", **kw: Any) -> Callable[[Any], Built]:
    """An nnU-Net network of ``arch`` in ``dim`` dimensions, normalised by BatchNorm or, with
    ``norm_kind="instance"``, by InstanceNorm (nnU-Net's own default); ``kw`` go to the network."""
    def build(gen: Any) -> Built:
        import torch.nn as nn
        from dynamic_network_architectures.architectures import unet

        conv = nn.Conv3d if dim == 3 else nn.Conv2d
        norms = {"batch": (nn.BatchNorm2d, nn.BatchNorm3d), "instance": (nn.InstanceNorm2d, nn.InstanceNorm3d)}
        norm = norms[norm_kind][dim == 3]
        stages = 4
        common = dict(input_channels=1, n_stages=stages, features_per_stage=[8, 16, 32, 32], conv_op=conv,
                      kernel_sizes=3, strides=[1, 2, 2, 2], num_classes=3, norm_op=norm,
                      norm_op_kwargs={"eps": 1e-5, "affine": True}, nonlin=nn.LeakyReLU,
                      nonlin_kwargs={"inplace": True})
        if arch == "PlainConvUNet":
            common.update(n_conv_per_stage=2, n_conv_per_stage_decoder=2, conv_bias=True)
        else:
            common.update(n_blocks_per_stage=[1, 2, 2, 2], n_conv_per_stage_decoder=1)
        common.update(kw)
        size = (24, 24, 24) if dim == 3 else (48, 48)
        return getattr(unet, arch)(**common), _randn(gen, 2, 1, *size)
    return build


# --------------------------------------------------------------------------- torchxrayvision

def _xrv_densenet(gen: Any) -> Built:
    xrv = import_lenient("torchxrayvision")
    model = xrv.models.DenseNet(weights=None, growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16,
                                num_classes=18)
    return model, _randn(gen, 2, 1, 64, 64)


# --------------------------------------------------------------------------- open_clip

def _clip(layers: List[int], width: int, lock: bool = False) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        from open_clip.modified_resnet import ModifiedResNet

        model = ModifiedResNet(layers=layers, output_dim=32, heads=2, image_size=64, width=width)
        if lock:  # CLIP's locked-tower fine-tuning: every BatchNorm made a frozen BatchNorm
            from open_clip.utils import freeze_batch_norm_2d

            model = freeze_batch_norm_2d(model)
        return model, _randn(gen, 2, 3, 64, 64)
    return build


# --------------------------------------------------------------------------- facenet_pytorch

def _facenet(gen: Any) -> Built:
    from facenet_pytorch import InceptionResnetV1

    return InceptionResnetV1(pretrained=None, classify=True, num_classes=10), _randn(gen, 2, 3, 96, 96)


# --------------------------------------------------------------------------- effdet

def _import_effdet() -> Any:
    import torch

    if "effdet" in sys.modules:
        return sys.modules["effdet"]
    script = torch.jit.script
    torch.jit.script = lambda fn=None, *a, **k: fn  # type: ignore[assignment]  # eager post-processing
    try:
        return import_lenient("effdet")
    finally:
        torch.jit.script = script


def _effdet(name: str, size: int = 128) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        effdet = _import_effdet()
        model = effdet.create_model(name, bench_task="", num_classes=5, pretrained=False, pretrained_backbone=False,
                                    image_size=(size, size))
        return model, _randn(gen, 2, 3, size, size)
    return build


# --------------------------------------------------------------------------- lightly

def _lightly_head(cls: str, *args: Any, **kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        from lightly.models.modules import heads

        return getattr(heads, cls)(*args, **kw), _randn(gen, 4, 32)
    return build


def _lightly_resnet(name: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        from lightly.models import ResNetGenerator

        return ResNetGenerator(name, num_classes=10, width=0.25), _randn(gen, 2, 3, 32, 32)
    return build


# --------------------------------------------------------------------------- speechbrain

def _sb(module: str, cls: str, shape: Tuple[int, ...], **kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        mod = import_lenient(f"speechbrain.lobes.models.{module}")
        for key, value in list(kw.items()):  # "speechbrain.x.y.Name": a class of the library
            if isinstance(value, str) and value.startswith("speechbrain."):
                path, attr = value.rsplit(".", 1)
                kw[key] = getattr(importlib.import_module(path), attr)
        return getattr(mod, cls)(**kw), _randn(gen, *shape)
    return build


# --------------------------------------------------------------------------- segmentation_models_pytorch_3d

def _smp3d(arch: str, encoder: str, size: int = 32) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        smp3d = import_lenient("segmentation_models_pytorch_3d")
        model = getattr(smp3d, arch)(encoder_name=encoder, encoder_weights=None, in_channels=1, classes=2)
        return model, _randn(gen, 2, 1, size, size, size)
    return build


# --------------------------------------------------------------------------- torchdistill

def _td(name: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        from torchdistill.models.registry import get_model

        return get_model(name, num_classes=10, pretrained=False), _randn(gen, 2, 3, 32, 32)
    return build


# --------------------------------------------------------------------------- timm_3d

def _timm3d(name: str, size: int = 32, **kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        import timm_3d

        model = timm_3d.create_model(name, pretrained=False, num_classes=5, in_chans=1, **kw)
        return model, _randn(gen, 2, 1, size, size, size)
    return build


# --------------------------------------------------------------------------- vit_pytorch

def _levit(gen: Any) -> Built:
    from vit_pytorch.levit import LeViT

    model = LeViT(image_size=64, num_classes=10, stages=2, dim=(32, 48), depth=1, heads=(2, 2), mlp_mult=2,
                  dropout=0.0)
    return model, _randn(gen, 2, 3, 64, 64)


def _mobilevit(gen: Any) -> Built:
    from vit_pytorch.mobile_vit import MobileViT

    model = MobileViT(image_size=(64, 64), dims=[32, 40, 48], channels=[8, 8, 16, 16, 24, 24, 32, 32, 40, 40, 96],
                      num_classes=10)
    return model, _randn(gen, 2, 3, 64, 64)


def _maxvit(gen: Any) -> Built:
    from vit_pytorch.max_vit import MaxViT

    model = MaxViT(num_classes=10, dim_conv_stem=16, dim=16, dim_head=8, depth=(1, 1), window_size=4,
                   mbconv_expansion_rate=2, mbconv_shrinkage_rate=0.25, dropout=0.0)
    return model, _randn(gen, 2, 3, 32, 32)


def _xcit(gen: Any) -> Built:
    from vit_pytorch.xcit import XCiT

    model = XCiT(image_size=32, patch_size=8, num_classes=10, dim=32, depth=2, cls_depth=1, heads=2, mlp_dim=64,
                 dropout=0.0, emb_dropout=0.0, local_patch_kernel_size=3, layer_dropout=0.0)
    return model, _randn(gen, 2, 3, 32, 32)


def _cvt(gen: Any) -> Built:
    from vit_pytorch.cvt import CvT

    model = CvT(num_classes=10, s1_emb_dim=16, s1_depth=1, s1_heads=1, s2_emb_dim=32, s2_depth=1, s2_heads=2,
                s3_emb_dim=48, s3_depth=1, s3_heads=2, dropout=0.0)
    return model, _randn(gen, 2, 3, 64, 64)


# --------------------------------------------------------------------------- torch_geometric

def _pyg(cls: str, **kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        import torch
        from torch_geometric import nn as gnn

        nodes = 24
        x = torch.randn(nodes, 16, generator=gen)
        src = torch.randint(0, nodes, (64,), generator=gen)
        dst = torch.randint(0, nodes, (64,), generator=gen)
        edge_index = torch.stack([torch.cat([src, dst]), torch.cat([dst, src])])
        if cls == "MLP":
            return gnn.MLP([16, 32, 32, 8], norm="batch_norm", dropout=0.0), (x,)
        model = getattr(gnn.models, cls)(in_channels=16, hidden_channels=32, num_layers=3, out_channels=8,
                                         norm="batch_norm", **kw)
        return model, (x, edge_index)
    return build


# --------------------------------------------------------------------------- the families

_BD.update({
    "ATCNet": (8, 512, 128.0, {}), "AttentionBaseNet": (8, 512, 128.0, {}), "ContraWR": (8, 512, 128.0, {}),
    "CTNet": (8, 512, 128.0, {}), "Deep4Net": (8, 512, 128.0, {}), "DeepSleepNet": (8, 512, 128.0, {}),
    "EEGConformer": (8, 512, 128.0, {}), "EEGInceptionERP": (8, 512, 128.0, {}),
    "EEGInceptionMI": (8, 512, 128.0, {}), "EEGITNet": (8, 512, 128.0, {}), "EEGMiner": (8, 512, 128.0, {}),
    "EEGNet": (8, 512, 128.0, {}), "EEGNeX": (8, 512, 128.0, {}), "EEGTCNet": (8, 512, 128.0, {}),
    "HybridNet": (2, 3000, 100.0, {}), "SCCNet": (8, 512, 128.0, {}), "ShallowFBCSPNet": (8, 512, 128.0, {}),
    "SincShallowNet": (8, 512, 128.0, {}), "SSTDPN": (8, 512, 128.0, {}), "SPARCNet": (8, 512, 128.0, {}),
    "TCFormer": (8, 512, 128.0, {}), "TIDNet": (8, 512, 128.0, {}), "TSception": (8, 512, 128.0, {}),
    "USleep": (8, 512, 128.0, {}),
})

MORE_FAMILIES: Dict[str, Dict[str, Entry]] = {
    "bd": {name: ("eeg", _bd(name)) for name in _BD},
    "effnet": {
        "b0-dynamic-same": ("classification", _effnet("efficientnet-b0", image_size=None)),
        "b0": ("classification", _effnet("efficientnet-b0", image_size=64)),
        "b1-dynamic-same": ("classification", _effnet("efficientnet-b1", image_size=None)),
        "b2": ("classification", _effnet("efficientnet-b2", image_size=64)),
        "b3-dynamic-same": ("classification", _effnet("efficientnet-b3", image_size=None)),
        "b1": ("classification", _effnet("efficientnet-b1", image_size=64)),
        "b3": ("classification", _effnet("efficientnet-b3", image_size=64)),
        "b4-dynamic-same": ("classification", _effnet("efficientnet-b4", image_size=None)),
    },
    "dna": {
        "PlainConvUNet-2d": ("segmentation", _dna("PlainConvUNet", 2)),
        "PlainConvUNet-3d": ("segmentation", _dna("PlainConvUNet", 3)),
        "PlainConvUNet-2d-nonlin-first": ("segmentation", _dna("PlainConvUNet", 2, nonlin_first=True)),
        "PlainConvUNet-2d-deep-supervision": ("segmentation", _dna("PlainConvUNet", 2, deep_supervision=True)),
        "ResidualEncoderUNet-2d": ("segmentation", _dna("ResidualEncoderUNet", 2)),
        "ResidualEncoderUNet-3d": ("segmentation", _dna("ResidualEncoderUNet", 3)),
        "ResidualUNet-2d": ("segmentation", _dna("ResidualUNet", 2)),
        "PlainConvUNet-3d-nonlin-first": ("segmentation", _dna("PlainConvUNet", 3, nonlin_first=True)),
    },
    "xrv": {
        "DenseNet": ("classification", _xrv_densenet),
    },
    "clip": {
        "ModifiedResNet-1111": ("embedding", _clip([1, 1, 1, 1], 16)),
        "ModifiedResNet-2222": ("embedding", _clip([2, 2, 2, 2], 16)),
        "ModifiedResNet-locked": ("embedding", _clip([1, 1, 1, 1], 16, lock=True)),
    },
    "facenet": {"InceptionResnetV1": ("embedding", _facenet)},
    "effdet": {
        "efficientdet_d0": ("detection", _effdet("efficientdet_d0")),
        "tf_efficientdet_d0": ("detection", _effdet("tf_efficientdet_d0")),
        "tf_efficientdet_lite0": ("detection", _effdet("tf_efficientdet_lite0")),
        "efficientdet_q0": ("detection", _effdet("efficientdet_q0")),
    },
    "lightly": {
        "SimCLRProjectionHead": ("ssl-head", _lightly_head("SimCLRProjectionHead", input_dim=32, hidden_dim=64,
                                                            output_dim=16, num_layers=3)),
        "BarlowTwinsProjectionHead": ("ssl-head", _lightly_head("BarlowTwinsProjectionHead", 32, 64, 16)),
        "BYOLProjectionHead": ("ssl-head", _lightly_head("BYOLProjectionHead", 32, 64, 16)),
        "BYOLPredictionHead": ("ssl-head", _lightly_head("BYOLPredictionHead", 32, 64, 16)),
        "MoCoProjectionHead": ("ssl-head", _lightly_head("MoCoProjectionHead", input_dim=32, hidden_dim=64,
                                                          output_dim=16, num_layers=3, batch_norm=True)),
        "NNCLRProjectionHead": ("ssl-head", _lightly_head("NNCLRProjectionHead", 32, 64, 16)),
        "NNCLRPredictionHead": ("ssl-head", _lightly_head("NNCLRPredictionHead", 32, 64, 16)),
        "SimSiamProjectionHead": ("ssl-head", _lightly_head("SimSiamProjectionHead", 32, 64, 16)),
        "SimSiamPredictionHead": ("ssl-head", _lightly_head("SimSiamPredictionHead", 32, 64, 16)),
        "SMoGProjectionHead": ("ssl-head", _lightly_head("SMoGProjectionHead", 32, 64, 16)),
        "DINOProjectionHead-bn": ("ssl-head", _lightly_head("DINOProjectionHead", input_dim=32, hidden_dim=64,
                                                             bottleneck_dim=16, output_dim=32, batch_norm=True)),
        "MSNProjectionHead": ("ssl-head", _lightly_head("MSNProjectionHead", 32, 64, 16)),
        "TiCoProjectionHead": ("ssl-head", _lightly_head("TiCoProjectionHead", 32, 64, 16)),
        "VICRegProjectionHead": ("ssl-head", _lightly_head("VICRegProjectionHead", input_dim=32, hidden_dim=64,
                                                            output_dim=16, num_layers=3)),
        "ResNetGenerator-18": ("classification", _lightly_resnet("resnet-18")),
        "ResNetGenerator-50": ("classification", _lightly_resnet("resnet-50")),
    },
    "sb": {
        "ECAPA_TDNN": ("speaker", _sb("ECAPA_TDNN", "ECAPA_TDNN", (2, 50, 24), input_size=24, lin_neurons=32,
                                      channels=[32, 32, 32, 32, 96], attention_channels=16, se_channels=16,
                                      res2net_scale=4)),
        "Xvector": ("speaker", _sb("Xvector", "Xvector", (2, 50, 24), in_channels=24,
                                   tdnn_channels=[32, 32, 32, 32, 64], lin_neurons=32)),
        "ResNet": ("speaker", _sb("ResNet", "ResNet", (2, 48, 24), input_size=24, channels=[16, 16, 32, 32],
                                  block_sizes=[1, 1, 1, 1], lin_neurons=32)),
        "CRDNN": ("asr", _sb("CRDNN", "CRDNN", (2, 40, 24), input_shape=[None, None, 24], cnn_channels=[8, 16],
                             rnn_layers=1, rnn_neurons=16, dnn_neurons=32, dropout=0.0,
                             rnn_class="speechbrain.nnet.RNN.LSTM")),
    },
    "smp3d": {f"{a}/{e}": ("segmentation", _smp3d(a, e)) for a in ("Unet", "FPN", "Linknet", "PSPNet", "MAnet")
              for e in ("resnet18", "efficientnet-b0")},
    "td": {
        "resnet20": ("classification", _td("resnet20")),
        "resnet32": ("classification", _td("resnet32")),
        "resnet44": ("classification", _td("resnet44")),
        "wide_resnet16_8": ("classification", _td("wide_resnet16_8")),
    },
    "timm3d": {name: ("classification", _timm3d(name)) for name in (
        "resnet18", "resnet26d", "efficientnet_b0", "densenet121",
        "mixnet_s", "tf_efficientnet_b0")},
    "vitp": {
        "LeViT": ("classification", _levit),
        "MobileViT": ("classification", _mobilevit),
        "MaxViT": ("classification", _maxvit),
        "XCiT": ("classification", _xcit),
        "CvT": ("classification", _cvt),
    },
    "pyg": {
        "GIN": ("graph", _pyg("GIN")),
        "GCN": ("graph", _pyg("GCN")),
        "GraphSAGE": ("graph", _pyg("GraphSAGE")),
        "GAT": ("graph", _pyg("GAT", heads=2)),
        "MLP": ("graph", _pyg("MLP")),
    },
}


def build_more(family: str, name: str, gen: Any) -> Built:
    """A network of :data:`MORE_FAMILIES` (no weights) and its example inputs."""
    offline()
    return MORE_FAMILIES[family][name][1](gen)
