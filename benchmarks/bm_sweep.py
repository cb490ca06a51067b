"""Sweep over real third-party models: convert and fold never break them, and how much they fuse.

Five model libraries the tests do not use (installed from the package index, no weights):
``segmentation_models_pytorch`` (encoder-decoder segmentation nets, ``smp``), ``ultralytics``
(YOLO detection / segmentation / pose / oriented boxes / classification models built from
their yaml configs, ``yolo``), ``pytorchcv`` (ImageNet, CIFAR, segmentation, pose,
detection nets, ``cv``), ``geffnet`` (EfficientNet / MixNet / MobileNetV3 / MNASNet
generations with memory-efficient custom-autograd activations, CondConv and TF "same"
padding, ``gen``) and ``pretrainedmodels`` (Inception, NASNet, SE-ResNeXt, Xception, DPN,
``pm``); and two libraries run for the first time later (:mod:`sweep_new_libs`): Hugging Face
``transformers`` 5.x vision / audio / speech models built from small configs (ResNet,
MobileNetV1 with TF "SAME" padding computed from shapes, MobileNetV2, EfficientNet, RegNet,
MobileViT, UperNet, CvT, RT-DETR, D-FINE, the DETR family with frozen BatchNorms,
FastSpeech2-Conformer, CLAP audio, Wav2Vec2-Conformer, ``hf``) and ``kornia`` 0.9 feature /
line / contrib networks without weights (HardNet, SOSNet, OriNet, AffNet, XFeat, SOLD2,
TinyViT, DeDoDe, ``kornia``); and fourteen more libraries, one family each
(:mod:`sweep_more_libs`: ``braindecode`` EEG nets ``bd``, ``efficientnet_pytorch`` ``effnet``,
nnU-Net's ``dynamic_network_architectures`` ``dna``, ``torchxrayvision`` ``xrv``, ``open_clip``
``clip``, ``facenet_pytorch`` ``facenet``, ``effdet``, ``lightly``, ``speechbrain`` ``sb``,
``segmentation_models_pytorch_3d`` ``smp3d``, ``torchdistill`` ``td``, ``timm_3d`` ``timm3d``,
``vit_pytorch`` ``vitp``, ``torch_geometric`` ``pyg``); and seven families whose nets normalise per
sample (:mod:`sweep_norm_libs`: MONAI ``monai``, nnU-Net with InstanceNorm ``dnanorm``, ``diffusers``
``diff``, ConvNeXt ``convnext``, detection heads ``dethead``, GroupNorm ResNets ``gnresnet``, and
BatchNorm controls from the same libraries ``bnctl``), and eight more (:mod:`sweep_norm_more`:
``pytorch3dunet`` ``p3dunet``, fepegar's ``unet`` ``fepunet``, ``torchcfm`` ``cfm``,
``taming-transformers`` ``taming``, ``denoising-diffusion-pytorch`` ``ddpm``,
``video-diffusion-pytorch`` ``vdiff``, ``transformers`` ConvNext ``hfconvnext``, MONAI nets the first
family does not build ``monai2``), and seven more (:mod:`sweep_norm_third`: ``demucs``,
``segment-anything`` ``sam``, ``encodec``, ``audio-diffusion-pytorch`` / ``a-unet`` ``aunet``,
``x-unet`` ``xunet``, ``vocos``, ``asteroid``), and seven more (:mod:`sweep_norm_fourth`:
``dalle2-pytorch`` ``dalle2``, ``med-seg-diff-pytorch`` ``medsegdiff``, ``muse-maskgit-pytorch`` ``muse``,
``imagen-pytorch`` ``imagen``, ``segformer-pytorch`` ``segformer``; BatchNorm: ``resnest``, ``openunmix``
``umx``), and timm's per-sample-norm families (:mod:`sweep_norm_fifth`: ``timmnorm``), and three from diffusers' and
transformers' code (:mod:`sweep_norm_sixth`: video / 3-D ``diff2``, speech encoders ``hfaudio``, vision nets
``hfvision2``), counted per kind of norm (a second table:
norms called, fused and running, report, float64 decisions, peak). Each model runs in its own subprocess with a time limit,
on a small input (batch 2; 64 x 64 images, 32 x 32 for CIFAR nets, the model's own size where
it needs one), float32, CPU, one thread:

* ``convert``: :func:`convbn.convert` with ``example_inputs`` (and ``convert-noei``: without),
  one training step of the converted model against the eager model's: outputs, every
  parameter's gradient, every buffer (running statistics, ``num_batches_tracked``). Errors
  are ``max|a - b| / max(1, max|b|)`` per tensor; above the float32 tolerance the step is
  compared again in float64 (``where rounding is in doubt``) and judged there.
* ``BN called / fused``: BatchNorm modules called in the eager training step, and those the
  converted model no longer calls as modules (they ran inside a fused chain) -- the fused
  path ran; ``report fused``: the BatchNorms its report lists as fused; ``report > ran``: of
  those, the ones the converted step still called as modules (the report says more than
  runs); the converted model then takes a second step, and the same counts are taken there
  (``fused_ran_next``, ``report_not_run_next``: without ``example_inputs`` the first call is
  the check, run by the eager modules).
* ``frozen BN-like``: modules that compute a BatchNorm from buffers only (``weight``,
  ``bias``, ``running_mean``, ``running_var`` buffers, no parameters, not a ``_BatchNorm``;
  DETR-style frozen BatchNorms), called in the eager step / still called after convert /
  still called by the folded model (neither fused nor folded while the last two equal the
  first).
* ``fold``: :func:`convbn.fold` (eval mode, with ``example_inputs``; ``fold-noei``: without,
  ``check=False``), outputs against eager eval; ``folded``: BatchNorms folded.
* ``peak``: exact peak of live tensor bytes over one training step
  (:func:`convbn.memory.timeline`), converted (with ``example_inputs``) against eager.

A failure is a raise of the pass or of the returned model, or a mismatch. Each model's record
(with the error text and its traceback's last line) goes to the JSON file; the markdown table
per family goes to stdout.

Set-up (once, in the dev environment of ``scripts/setup.sh``; ``--no-deps`` because some of
these libraries would resolve another torch)::

    pip install --no-deps -r benchmarks/requirements-sweep.txt

Run::

    python benchmarks/bm_sweep.py                              # all models, 2 jobs
    python benchmarks/bm_sweep.py --family smp --limit 5       # a part
    python benchmarks/bm_sweep.py --models cv:resnet10 --jobs 1
    python benchmarks/bm_sweep.py --list                       # the model labels
    python benchmarks/bm_sweep.py --family hf kornia --jobs 1  # the two libraries added next
    python benchmarks/bm_sweep.py --family bd effnet dna xrv clip facenet effdet lightly sb smp3d td timm3d vitp pyg
    python benchmarks/bm_sweep.py --family p3dunet fepunet cfm taming ddpm vdiff hfconvnext monai2 --per-model
    python benchmarks/bm_sweep.py --family demucs sam encodec aunet xunet vocos asteroid --per-model

Set-up (``--no-deps``: each would otherwise resolve another torch; ``pyproject.toml``'s
``sweep`` extra lists the first five)::

    pip install --no-deps segmentation_models_pytorch==0.6.0 ultralytics==8.4.190 pytorchcv==0.0.74 \
        opencv-python-headless==5.0.0.93 geffnet==1.0.2 pretrainedmodels==0.7.4 six munch
    pip install --no-deps transformers==5.24.0 tokenizers==0.23.3 huggingface_hub==2.4.0 safetensors regex
    pip install --no-deps kornia==0.9.0 kornia_rs==0.2.0
    # the fourteen of sweep_more_libs.py and what they import: requirements-sweep.txt's last block
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))

__all__ = ["MODELS", "run_one", "markdown", "per_model", "main"]

# --------------------------------------------------------------------------- the models

SMP_ARCHS = ["Unet", "UnetPlusPlus", "FPN", "PSPNet", "DeepLabV3", "DeepLabV3Plus", "Linknet", "MAnet", "PAN",
             "UPerNet"]
SMP_ENCODERS = ["resnet18", "mobilenet_v2", "efficientnet-b0", "timm-regnetx_002"]

YOLO_CONFIGS = [
    "yolov3-tiny", "yolov5n", "yolov5n-p6", "yolov6n", "yolov8n", "yolov8n-seg", "yolov8n-pose", "yolov8n-cls",
    "yolov8n-obb", "yolov8n-ghost", "yolov8n-p2", "yolov8n-p6", "yolov8-cls-resnet50", "yolov9t", "yolov9c-seg",
    "yolov10n", "yolo11n", "yolo11n-seg", "yolo11n-pose", "yolo11n-cls", "yolo11n-obb", "yolo12n", "yolo12n-seg",
    "yolo12n-cls", "yolo26n", "yolo26n-seg", "yolo26n-pose", "yolo26n-cls", "yolo26n-obb", "rtdetr-l",
]

CV_CIFAR = [
    "resnet20_cifar10", "preresnet20_cifar10", "resnext29_32x4d_cifar10", "seresnet20_cifar10",
    "sepreresnet20_cifar10", "pyramidnet110_a48_cifar10", "densenet40_k12_cifar10", "densenet40_k12_bc_cifar10",
    "xdensenet40_2_k24_bc_cifar10", "wrn16_10_cifar10", "ror3_56_cifar10", "shakeshakeresnet20_2x16d_cifar10",
    "shakedropresnet20_cifar10", "diaresnet20_cifar10", "diapreresnet20_cifar10", "resdropresnet20_cifar10",
    "nin_cifar10", "msdnet22_cifar10",
]
CV_IMAGENET = [
    "resnet10", "resnet18_wd4", "preresnet10", "preresnet18_wd4", "sharesnet18", "diracnet18v2", "diapreresnet10",
    "bam_resnet18", "cbam_resnet18", "resnesta18", "resnestabc14", "selecsls42", "dla34", "dla46c", "dpn68",
    "hardnet39ds", "hardnet68ds", "peleenet", "vovnet27s", "condensenet74_c4_g4", "mobilenet_wd4", "mobilenetb_wd4",
    "fdmobilenet_wd4", "mobilenetv3_small_w7d20", "mobilenetv3_large_w7d20", "mnasnet_small", "mnasnet_a1",
    "proxylessnas_mobile", "fbnet_cb", "spnasnet", "efficientnet_b0", "mixnet_s", "ghostnet", "shufflenet_g1_wd4",
    "shufflenetv2_wd2", "shufflenetv2b_wd2", "menet108_8x1_g3", "igcv3_wd4", "sqnxt23_w1", "sqnxt23v5_w1",
    "squeezenet_v1_1", "channelnet", "dicenet_wd5", "espnetv2_wd2", "regnetx002", "regnetx004",
    "hrnet_w18_small_v1", "octresnet10_ad2", "darts", "bagnet9", "airnet50_1x64d_r2", "scnet50",
]
CV_SEGMENTATION = [
    "fastscnn_cityscapes", "sinet_cityscapes", "cgnet_cityscapes", "lednet_cityscapes", "enet_cityscapes",
    "erfnet_cityscapes", "esnet_cityscapes", "edanet_cityscapes", "fpenet_cityscapes", "dabnet_cityscapes",
    "bisenet_resnet18_celebamaskhq", "icnet_resnetd50b_cityscapes", "fcn8sd_resnetd50b_voc",
]
GEN_MODELS = [
    "efficientnet_b0", "efficientnet_es", "efficientnet_lite0", "efficientnet_cc_b0_4e", "mixnet_s", "mixnet_m",
    "tf_mixnet_s", "mnasnet_a1", "mnasnet_small", "semnasnet_050", "fbnetc_100", "spnasnet_100", "mobilenetv2_100",
    "mobilenetv2_110d", "mobilenetv3_large_100", "mobilenetv3_rw", "mobilenetv3_small_minimal_100",
    "tf_efficientnet_b0", "tf_efficientnet_lite0", "tf_mobilenetv3_small_100",
]
PM_MODELS = ["bninception", "se_resnet50", "se_resnext50_32x4d", "xception", "nasnetamobile", "dpn68b", "inceptionv4",
             "cafferesnet101"]
CV_OTHER = ["simplepose_resnet18_coco", "lwopenpose2d_mobilenet_cmupan_coco", "ibppose_coco", "centernet_resnet18_voc"]

sys.path.insert(0, HERE)  # sweep_new_libs beside this file, also when imported as a module
from sweep_new_libs import HF_MODELS, KORNIA_MODELS, build_hf, build_kornia  # noqa: E402
from sweep_more_libs import MORE_FAMILIES, build_more  # noqa: E402
from sweep_norm_libs import (NORM_FAMILIES, build_norm, count_norms, norm_hooks, norm_markdown,  # noqa: E402
                             norm_per_model)

FAMILIES = ["smp", "yolo", "cv", "gen", "pm", "hf", "kornia", *MORE_FAMILIES, *NORM_FAMILIES]

#: label -> (family, name, task)
MODELS: Dict[str, Tuple[str, str, str]] = {}
for _e in SMP_ENCODERS:  # encoder-major: --limit N takes N architectures with the first encoder
    for _a in SMP_ARCHS:
        MODELS[f"smp:{_a}/{_e}"] = ("smp", f"{_a}/{_e}", "segmentation")
for _c in YOLO_CONFIGS:
    _task = ("segmentation" if "seg" in _c else "pose" if "pose" in _c else "classification" if "cls" in _c
             else "detection")
    MODELS[f"yolo:{_c}"] = ("yolo", _c, _task)
_CV_ORDER: List[Tuple[str, str]] = []
for _i in range(max(len(CV_CIFAR), len(CV_IMAGENET), len(CV_SEGMENTATION), len(CV_OTHER))):  # interleaved: --limit
    for _group, _task in ((CV_CIFAR, "classification"), (CV_IMAGENET, "classification"),
                          (CV_SEGMENTATION, "segmentation"), (CV_OTHER, "")):
        if _i < len(_group):
            _CV_ORDER.append((_group[_i], _task or ("detection" if "centernet" in _group[_i] else "pose")))
for _n, _t in _CV_ORDER:
    MODELS[f"cv:{_n}"] = ("cv", _n, _t)
for _n in GEN_MODELS:
    MODELS[f"gen:{_n}"] = ("gen", _n, "classification")
for _n in PM_MODELS:
    MODELS[f"pm:{_n}"] = ("pm", _n, "classification")
for _n, (_t, _) in HF_MODELS.items():
    MODELS[f"hf:{_n}"] = ("hf", _n, _t)
for _n, (_t, _) in KORNIA_MODELS.items():
    MODELS[f"kornia:{_n}"] = ("kornia", _n, _t)
for _f, _entries in [*MORE_FAMILIES.items(), *NORM_FAMILIES.items()]:
    for _n, (_t, _) in _entries.items():
        MODELS[f"{_f}:{_n}"] = (_f, _n, _t)


def _import_zoo() -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from zoo import import_torchvision_without_fake_kernels

    import_torchvision_without_fake_kernels()


def _eager_runs(model: Any, inputs: Tuple[Any, ...]) -> bool:
    import torch

    try:
        with torch.no_grad():
            model.eval()(*inputs)
        return True
    except Exception:  # noqa: BLE001 - this input size does not fit: try the next
        return False
    finally:
        model.train()


def build(family: str, name: str) -> Tuple[Any, Tuple[Any, ...]]:
    """The model (training mode, seeded) and its example inputs (a tuple)."""
    import torch

    _import_zoo()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if family == "smp":
        import segmentation_models_pytorch as smp

        arch, encoder = name.split("/")
        model = getattr(smp, arch)(encoder_name=encoder, encoder_weights=None, classes=3)
        for size in (64, 128, 256):  # PAN pools a 64 x 64 input down to nothing
            x = (torch.randn(2, 3, size, size, generator=gen),)
            if _eager_runs(model, x):
                break
        return model.train(), x
    if family == "yolo":
        os.environ.setdefault("YOLO_OFFLINE", "1")
        from ultralytics.nn import tasks

        cfg = tasks.yaml_model_load(f"{name}.yaml")
        kind = tasks.guess_model_task(cfg)
        cls = {"detect": tasks.DetectionModel, "segment": tasks.SegmentationModel, "pose": tasks.PoseModel,
               "classify": tasks.ClassificationModel, "obb": tasks.OBBModel}.get(kind, tasks.DetectionModel)
        if name.startswith("rtdetr"):
            cls = tasks.RTDETRDetectionModel
        model = cls(cfg, verbose=False)
        return model.train(), (torch.randn(2, 3, 64, 64, generator=gen),)
    if family == "cv":
        from pytorchcv.model_provider import get_model

        sizes = [32] if ("cifar" in name or "svhn" in name) else [64, 128]
        for size in sizes:
            for kwargs in ({"in_size": (size, size)}, {}):
                try:
                    model = get_model(name, pretrained=False, **kwargs)
                except (TypeError, AssertionError):  # no in_size argument, or not this size
                    continue
                x = (torch.randn(2, 3, size, size, generator=gen),)
                if _eager_runs(model, x):
                    return model.train(), x
        model = get_model(name, pretrained=False)
        size = getattr(model, "in_size", (224, 224))
        return model.train(), (torch.randn(2, 3, *size, generator=gen),)
    if family == "gen":
        import geffnet

        model = geffnet.create_model(name, pretrained=False)
        return model.train(), (torch.randn(2, 3, 64, 64, generator=gen),)
    if family == "pm":
        import pretrainedmodels

        model = pretrainedmodels.__dict__[name](num_classes=1000, pretrained=None)
        for size in (64, 128, 224, 299):
            x = (torch.randn(2, 3, size, size, generator=gen),)
            if _eager_runs(model, x):
                return model.train(), x
        return model.train(), (torch.randn(2, 3, 299, 299, generator=gen),)
    if family in ("hf", "kornia"):
        model, x = (build_hf if family == "hf" else build_kornia)(name, gen)
        return model.train(), x
    if family in MORE_FAMILIES:
        model, x = build_more(family, name, gen)
        return model.train(), x
    if family in NORM_FAMILIES:
        model, x = build_norm(family, name, gen)
        return model.train(), x
    raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")


# --------------------------------------------------------------------------- one model

TOL = {"float32": 2e-3, "float64": 1e-7}


def _leaves(out: Any) -> List[Any]:
    import torch

    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _loss(out: Any) -> Any:
    """A loss touching every output element with a fixed random weight (same on both sides)."""
    import torch

    gen = torch.Generator().manual_seed(7)
    total = 0
    for t in _leaves(out):
        w = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
        total = total + (t * w).sum() / max(1, t.numel()) ** 0.5
    return total


def _err(a: Any, b: Any) -> float:
    import torch

    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return float("inf")
    if a.shape != b.shape:
        return float("inf")
    if not a.is_floating_point():
        return float((a != b).any())
    a, b = a.double(), b.double()
    if not torch.isfinite(b).all():
        return 0.0 if torch.equal(torch.isfinite(a), torch.isfinite(b)) else float("inf")
    return float((a - b).abs().max() / max(1.0, float(b.abs().max()))) if b.numel() else 0.0


def _frozen_bn_like(m: Any) -> bool:
    """A module computing a BatchNorm from buffers only (a frozen BatchNorm), not a ``_BatchNorm``."""
    from torch.nn.modules.batchnorm import _BatchNorm

    own = dict(m.named_buffers(recurse=False))
    return (not isinstance(m, _BatchNorm) and not any(True for _ in m.parameters(recurse=False))
            and all(k in own for k in ("weight", "bias", "running_mean", "running_var")))


def _bn_hooks(model: Any, frozen: bool = False) -> Tuple[set, List[Any]]:
    """Names of the BatchNorms called in training mode (``frozen``: of the frozen BN-like modules,
    in any mode) from now on, and the hook handles."""
    from torch.nn.modules.batchnorm import _BatchNorm

    called: set = set()
    handles = []
    for name, m in model.named_modules():
        if (_frozen_bn_like(m) if frozen else isinstance(m, _BatchNorm)):
            def hook(mod: Any, args: Any, out: Any, name: str = name) -> None:
                if frozen or mod.training:
                    called.add(name)
            hook.convbn_observer = True  # type: ignore[attr-defined]  # an observer: fused layers stay fused
            handles.append(m.register_forward_hook(hook))
    return called, handles


def _step(model: Any, inputs: Tuple[Any, ...]) -> Dict[str, Any]:
    """One training step (seeded), its output leaves, gradients and buffers by state_dict key."""
    import torch

    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    out = model(*inputs)
    loss = _loss(out)
    chains = _chain_calls(loss)
    loss.backward()
    state = model.state_dict(keep_vars=True)
    return {"out": [t.detach() for t in _leaves(out)], "chain_calls": chains,
            "grads": {k: v.grad for k, v in state.items() if isinstance(v, torch.nn.Parameter)},
            "buffers": {k: v.detach().clone() for k, v in state.items() if not isinstance(v, torch.nn.Parameter)}}


def _chain_calls(loss: Any) -> Dict[str, int]:
    """Fused chain Functions in ``loss``'s autograd graph, by node name (the fused path ran)."""
    found: Dict[str, int] = collections.Counter()
    seen: Dict[int, Any] = {}  # nodes kept alive: a freed node's id could be reused
    stack = [getattr(loss, "grad_fn", None)]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if type(node).__name__.endswith("ChainFunctionBackward"):
            found[type(node).__name__] += 1
        stack.extend(n for n, _ in node.next_functions)
    return dict(found)


def _compare(ref: Dict[str, Any], got: Dict[str, Any]) -> Dict[str, float]:
    out = max([_err(a, b) for a, b in zip(got["out"], ref["out"])] or [0.0])
    if len(got["out"]) != len(ref["out"]):
        out = float("inf")
    grads = max([_err(got["grads"].get(k), g) for k, g in ref["grads"].items()] or [0.0])
    bufs = max([_err(got["buffers"].get(k), b) for k, b in ref["buffers"].items()] or [0.0])
    return {"out": out, "grad": grads, "buffer": bufs}


def _short(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" [{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}]" if tb else ""
    text = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}{where}"
    inner = exc.__cause__ or exc.__context__
    return text + (f" <- {_short(inner)}" if inner is not None and inner is not exc else "")


#: failure causes, first match wins: (label, regular expression over the error text)
CAUSES = [
    ("frozen parameter (hook on a tensor without grad)", r"doesn't require gradient"),
    ("module replaced: class attribute / property lost", r"object has no attribute"),
    ("module replaced: container not iterable / indexable", r"not iterable|not subscriptable|object is not callable"),
    ("module replaced: bare nn.Module without forward", r"_forward_unimplemented|missing the required \"forward\""),
    ("trace hazard (isinstance / control flow on a proxy)", r"isinstance|symbolically traced variables cannot"),
    ("traced graph differs from the module's own code at run time (trace hazard)", r"\[graph_module\.py:\d+\]$"),
    ("gradients differ from eager", r"mismatch: .*grad"),
    ("outputs / buffers differ from eager", r"mismatch"),
    ("timeout", r"^over \d+ s"),
]


def cause(error: str) -> str:
    """The cause a failure's error text names (:data:`CAUSES`), else ``other: <text>``."""
    for label, pattern in CAUSES:
        if re.search(pattern, error):
            return label
    return "other: " + error[:120]


def _norms_gone(eager: Dict[str, str], now: Dict[str, str], reported: set) -> Dict[str, int]:
    """Per kind: the per-sample norms the eager step called that the report lists as fused and
    the converted step no longer calls as modules (they ran inside a fused chain). A norm module
    with its own forward may be traced into its parent's graph and so not be called as a module
    while left unfused: the report decides those (an outcome for a functional call names the
    module it sits in after ``in``)."""
    fused = {name.rpartition(" in ")[2] for name in reported}
    return dict(collections.Counter(kind for name, kind in eager.items() if name not in now and name in fused))


def _check_convert(model: Any, inputs: Tuple[Any, ...], with_inputs: bool, ref: Dict[str, Any],
                   called_eager: set, dtype: str, norms_eager: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    import torch

    import convbn

    res: Dict[str, Any] = {"ok": False, "dtype": dtype}
    norms_eager = norms_eager or {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            conv = convbn.convert(copy.deepcopy(model), example_inputs=inputs if with_inputs else None)
    except Exception as exc:  # noqa: BLE001 - recorded as a convert failure
        res["error"] = "convert raised: " + _short(exc)
        return res
    report = getattr(conv, "convbn_report", None)
    reported = {o.batchnorm for o in getattr(report, "outcomes", []) if o.result == "fused"}
    res["report_fused"] = len(reported)
    called, handles = _bn_hooks(conv)
    frozen, frozen_handles = _bn_hooks(conv, frozen=True)
    norms, norm_handles = norm_hooks(conv)
    try:
        got = _step(conv, inputs)
    except Exception as exc:  # noqa: BLE001
        res["error"] = "converted model raised: " + _short(exc)
        return res
    finally:
        for h in handles + frozen_handles + norm_handles:
            h.remove()
    res["norm_fused_ran"] = _norms_gone(norms_eager, norms, reported)
    res["chain_calls"] = got["chain_calls"]
    res["norm_report_fused"] = len({n.rpartition(" in ")[2] for n in reported} & set(norms_eager))
    res["still_called"] = len(called)
    res["fused_ran"] = len(called_eager - called)
    res["report_not_run"] = sorted(reported & called)  # listed as fused, yet called as a module
    res["frozen_still_called"] = len(frozen)
    errs = _compare(ref, got)
    try:  # a second step: what runs once the first call's checks are behind
        called_next, handles = _bn_hooks(conv)
        norms_next, norm_handles = norm_hooks(conv)
        handles += norm_handles
        _step(conv, inputs)
        reported_next = {o.batchnorm for o in getattr(conv.convbn_report, "outcomes", []) if o.result == "fused"}
        res["norm_fused_ran_next"] = _norms_gone(norms_eager, norms_next, reported_next)
        reported = {o.batchnorm for o in getattr(conv.convbn_report, "outcomes", []) if o.result == "fused"}
        res["fused_ran_next"] = len(called_eager - called_next)
        res["report_fused_next"] = len(reported)  # listed at the same moment as what ran is counted
        res["report_not_run_next"] = sorted(reported & called_next)
    except Exception as exc:  # noqa: BLE001
        res["next_step_error"] = _short(exc)
    finally:
        for h in handles:
            h.remove()
    res.update({f"{k}_err": v for k, v in errs.items()})
    res["ok"] = max(errs.values()) <= TOL[dtype]
    if not res["ok"]:
        res["error"] = "mismatch: " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items() if v > TOL[dtype])
    res["conv"] = conv
    if report is not None:
        reasons = collections.Counter(re.sub(r"'[^']*'", "'…'", o.reason)[:120]
                                      for o in report.outcomes if o.result == "left")
        res["left_reasons"] = dict(reasons.most_common(5))
        res["untraced"] = [f"{m}: {str(e)[:160]}" for m, e in list(getattr(report, "untraced", []))[:5]]
    return res


def _fold_error(model: Any, inputs: Tuple[Any, ...], with_inputs: bool, res: Dict[str, Any]) -> Optional[float]:
    """Folded against eager eval, ``max`` of :func:`_err` over the outputs (``None``: recorded an error)."""
    import torch

    import convbn

    ev = copy.deepcopy(model).eval()
    with torch.no_grad():
        torch.manual_seed(123)
        ref = _leaves(ev(*inputs))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if with_inputs:
                    folded = convbn.fold(copy.deepcopy(ev), example_inputs=inputs)
                else:
                    folded = convbn.fold(copy.deepcopy(ev), check=False)
        except Exception as exc:  # noqa: BLE001 - recorded as a fold failure
            res["error"] = "fold raised: " + _short(exc)
            return None
        rep = getattr(folded, "convbn_report", None)
        res["folded"] = len({o.batchnorm for o in getattr(rep, "folded", [])})
        if rep is not None:
            reasons = collections.Counter(re.sub(r"'[^']*'", "'…'", o.reason)[:120] for o in rep.skipped)
            res["left_reasons"] = dict(reasons.most_common(5))
        frozen, handles = _bn_hooks(folded, frozen=True)
        try:
            torch.manual_seed(123)
            got = _leaves(folded(*inputs))
        except Exception as exc:  # noqa: BLE001
            res["error"] = "folded model raised: " + _short(exc)
            return None
        finally:
            for h in handles:
                h.remove()
        res["frozen_still_called"] = len(frozen)
    return max([_err(a, b) for a, b in zip(got, ref)] or [0.0]) if len(got) == len(ref) else float("inf")


def _check_fold(model: Any, inputs: Tuple[Any, ...], with_inputs: bool) -> Dict[str, Any]:
    """fold against eager eval in float32; where that exceeds 1e-3, judged again in float64
    (a model whose outputs jump with rounding, such as a top-k selection of queries, makes
    float32 differences that say nothing about the fold)."""
    import torch

    res: Dict[str, Any] = {"ok": False, "dtype": "float32"}
    err = _fold_error(model, inputs, with_inputs, res)
    if err is None:
        return res
    if err > 1e-3:
        res64: Dict[str, Any] = {}
        to64 = lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        err64 = _fold_error(copy.deepcopy(model).double(), tuple(to64(a) for a in inputs), with_inputs, res64)
        if err64 is not None and err64 <= TOL["float64"]:
            res.update(dtype="float64", out_err32=err)
            err = err64
    res["out_err"] = err
    res["ok"] = err <= (1e-3 if res["dtype"] == "float32" else TOL["float64"])
    if not res["ok"]:
        res["error"] = f"mismatch: out {err:.2g}"
    return res


def run_one(label: str, peak: bool = True) -> Dict[str, Any]:
    """Every check on one model; a JSON-able record."""
    import torch
    from torch.nn.modules.batchnorm import _BatchNorm

    torch.set_num_threads(1)
    family, name, task = MODELS[label]
    rec: Dict[str, Any] = {"label": label, "family": family, "task": task}
    t0 = time.time()
    try:
        model, inputs = build(family, name)
    except Exception as exc:  # noqa: BLE001 - the library cannot build it here: not counted
        rec["skipped"] = "build: " + _short(exc)
        return rec
    rec["input"] = [list(t.shape) for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    rec["bns"] = sum(isinstance(m, _BatchNorm) for m in model.modules())
    rec["frozen_bns"] = sum(_frozen_bn_like(m) for m in model.modules())
    rec["norms"] = count_norms(model)
    snapshot = copy.deepcopy(model.state_dict())
    try:
        eager = copy.deepcopy(model)
    except Exception as exc:  # noqa: BLE001 - every check here works on copies: not counted
        rec["skipped"] = "deepcopy of the model: " + _short(exc)
        return rec
    called, handles = _bn_hooks(eager)
    frozen, frozen_handles = _bn_hooks(eager, frozen=True)
    norms, norm_handles = norm_hooks(eager)
    try:
        ref = _step(eager, inputs)
    except Exception as exc:  # noqa: BLE001 - eager itself does not train on this input: not counted
        rec["skipped"] = "eager: " + _short(exc)
        return rec
    for h in handles + frozen_handles + norm_handles:
        h.remove()
    if any(p.grad is not None for p in model.parameters()):
        # the copy's forward reached the original's modules (a forward closing over them, as
        # a-unet's functional modules do): no check on copies would be one of this model
        rec["skipped"] = "deepcopy of the model is not independent: its step wrote gradients into the original"
        return rec
    rec["norm_called"] = dict(collections.Counter(norms.values()))
    rec["bn_called"] = len(called)
    rec["frozen_called"] = len(frozen)
    times = {"build+eager": round(time.time() - t0, 1)}
    ref64 = None
    for key, with_inputs in (("convert", True), ("convert_noei", False)):
        model.load_state_dict(snapshot)
        res = _check_convert(model, inputs, with_inputs, ref, called, "float32", norms)
        if not res["ok"] and str(res.get("error", "")).startswith("mismatch"):
            # rounding in doubt: judge the step in float64
            m64 = copy.deepcopy(model).double()
            m64.load_state_dict(snapshot)
            m64 = m64.double()
            x64 = torch.utils._pytree.tree_map(  # lists of feature maps too (detection heads)
                lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, inputs)
            if ref64 is None:
                ref64 = _step(copy.deepcopy(m64), x64)
            res64 = _check_convert(m64, x64, with_inputs, ref64, called, "float64", norms)
            res64.pop("conv", None)
            res["float64"] = {k: v for k, v in res64.items() if k.endswith("_err") or k in ("ok", "error")}
            res["ok"] = res64["ok"]
            if res["ok"]:
                res.pop("error", None)
        conv = res.pop("conv", None)
        if key == "convert" and peak and conv is not None:
            from convbn.memory import timeline

            try:
                model.load_state_dict(snapshot)
                e = copy.deepcopy(model)
                pe = timeline(e, *inputs).peak
                conv.zero_grad(set_to_none=True)  # as the fresh eager copy: no gradient before the step
                pc = timeline(conv, *inputs).peak
                rec["peak"] = {"eager": pe, "converted": pc}
            except Exception as exc:  # noqa: BLE001
                rec["peak"] = {"error": _short(exc)}
        rec[key] = res
        times[key] = round(time.time() - t0 - sum(times.values()), 1)
    model.load_state_dict(snapshot)
    rec["fold"] = _check_fold(model, inputs, True)
    times["fold"] = round(time.time() - t0 - sum(times.values()), 1)
    rec["fold_noei"] = _check_fold(model, inputs, False)
    times["fold_noei"] = round(time.time() - t0 - sum(times.values()), 1)
    rec["times"] = times
    rec["seconds"] = round(time.time() - t0, 1)
    return rec


# --------------------------------------------------------------------------- driver

def _run_subprocess(labels: List[str], timeout: float, peak: bool) -> List[Dict[str, Any]]:
    """Run ``labels`` in one subprocess (imports paid once); a model that times out or crashes
    it is recorded so, and the rest of the chunk runs again in a fresh subprocess."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", YOLO_OFFLINE="1",
               YOLO_CONFIG_DIR=os.environ.get("YOLO_CONFIG_DIR", "/tmp/bm_sweep_yolo_config"))
    records: List[Dict[str, Any]] = []
    todo = list(labels)
    while todo:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", *todo] + ([] if peak else ["--no-peak"])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        done: Dict[str, Dict[str, Any]] = {}
        timer = threading.Timer(timeout, proc.kill)  # restarted per model below
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith("{"):
                    rec = json.loads(line)
                    done[rec["label"]] = rec
                    timer.cancel()
                    timer = threading.Timer(timeout, proc.kill)
                    timer.start()
            proc.wait()
        finally:
            timer.cancel()
        err = (proc.stderr.read() if proc.stderr else "").strip().splitlines()[-1:] or ["(no output)"]
        for label in todo:
            if label in done:
                records.append(done[label])
        rest = [lb for lb in todo if lb not in done]
        if rest:  # the first model not done is the one that stopped the subprocess
            bad = rest[0]
            fam, _, task = MODELS[bad]
            why = ({"timeout": f"over {timeout:.0f} s"} if proc.returncode == -9
                   else {"crash": f"exit {proc.returncode}: {err[0][:300]}"})
            records.append({"label": bad, "family": fam, "task": task, **why})
            rest = rest[1:]
        todo = rest
    return records


def _failed(rec: Dict[str, Any], key: str) -> bool:
    """The check ``key`` failed (a crash fails every check; a timeout is counted apart)."""
    return "timeout" not in rec and ("crash" in rec or not rec.get(key, {}).get("ok", False))


def markdown(records: List[Dict[str, Any]], command: str) -> str:
    fams: Dict[str, List[Dict[str, Any]]] = collections.defaultdict(list)
    for r in records:
        fams[r["family"]].append(r)
    lines = [f"Command: `{command}`", "",
             "| family | models | convert fail | convert-noei fail | fold fail | fold-noei fail | BN called | "
             "fused (ran) | fused (ran, noei 2nd step) | fused (report) | report > ran (ei / noei; noei 2nd step) | folded | frozen BN-like called / after convert / "
             "after fold | max out / grad / buffer err | above eager peak (median peak x eager) | timeout | skipped |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]

    def row(name: str, rs: List[Dict[str, Any]]) -> str:
        run = [r for r in rs if "skipped" not in r]
        called = sum(r.get("bn_called", 0) for r in run)
        ran = sum(r.get("convert", {}).get("fused_ran", 0) for r in run)
        nxt = [r.get("convert_noei", {}).get("fused_ran_next") for r in run]
        next_text = (f"{sum(n or 0 for n in nxt)} ({sum(n or 0 for n in nxt) / max(called, 1):.0%})"
                     if any(n is not None for n in nxt) else "-")
        rep = sum(r.get("convert", {}).get("report_fused", 0) for r in run)
        over = [sum(len(r.get(k, {}).get(f, [])) for r in run)
                for k, f in (("convert", "report_not_run"), ("convert_noei", "report_not_run"),
                             ("convert_noei", "report_not_run_next"))]
        measured = any("report_not_run" in r.get("convert", {}) for r in run)  # older records: not measured
        over_text = f"{over[0]} / {over[1]}; {over[2]}" if measured else "-"
        frozen = [sum(r.get("frozen_called", 0) for r in run),
                  sum(r.get("convert", {}).get("frozen_still_called", 0) for r in run),
                  sum(r.get("fold", {}).get("frozen_still_called", 0) for r in run)]
        frozen_text = " / ".join(map(str, frozen)) if any("frozen_called" in r for r in run) else "-"
        folded = sum(r.get("fold", {}).get("folded", 0) for r in run)
        bns = sum(r.get("bns", 0) for r in run)
        errs = [max((r.get(k, {}).get(f"{e}_err", 0.0) for k in ("convert", "convert_noei")
                     if r.get(k, {}).get("dtype") == "float32" and "float64" not in r.get(k, {})), default=0.0)
                for r in run for e in ("out", "grad", "buffer")]
        mx = [max(errs[i::3], default=0.0) for i in range(3)]
        above = sum(1 for r in run if isinstance(r.get("peak"), dict) and "eager" in r["peak"]
                    and r["peak"]["converted"] > r["peak"]["eager"])
        ratios = sorted(r["peak"]["converted"] / r["peak"]["eager"] for r in run
                        if isinstance(r.get("peak"), dict) and r["peak"].get("eager"))
        above_text = f"{above} (median {ratios[len(ratios) // 2]:.2f}x)" if ratios else str(above)
        return (f"| {name} | {len(run)} | {sum(_failed(r, 'convert') for r in run)} | "
                f"{sum(_failed(r, 'convert_noei') for r in run)} | {sum(_failed(r, 'fold') for r in run)} | "
                f"{sum(_failed(r, 'fold_noei') for r in run)} | {called} | {ran} ({ran / max(called, 1):.0%}) | {next_text} | "
                f"{rep} | {over_text} | {folded} / {bns} ({folded / max(bns, 1):.0%}) | "
                f"{frozen_text} | "
                f"{mx[0]:.1e} / {mx[1]:.1e} / {mx[2]:.1e} | {above_text} | {sum('timeout' in r for r in run)} | "
                f"{len(rs) - len(run)} |")

    for fam in sorted(fams):
        lines.append(row(fam, fams[fam]))
    lines.append(row("**all**", records))
    return "\n".join(lines)


def _count(res: Dict[str, Any], key: str) -> Any:
    """``len(res[key])``, or ``-`` where the record does not have it (not measured)."""
    return len(res[key]) if key in res else "-"


def per_model(records: List[Dict[str, Any]]) -> str:
    """One row per model: BatchNorms called / fused and running / reported fused (with and without
    ``example_inputs``), reported but not run, folded, frozen BN-like modules, peak against eager."""
    lines = ["| model | BN called | fused ran (ei / noei; noei 2nd step) | report fused (ei / noei) | "
             "report > ran (ei / noei; noei 2nd step) | folded / BNs | frozen BN-like called / after convert / after fold | peak x eager | failed |",
             "|---|---:|---|---|---|---|---|---:|---|"]
    for r in records:
        if "skipped" in r:
            lines.append(f"| {r['label']} | skipped: {r['skipped'][:80]} ||||||||")
            continue
        c, n = r.get("convert", {}), r.get("convert_noei", {})
        pk = r.get("peak", {})
        ratio = f"{pk['converted'] / pk['eager']:.2f}" if "eager" in pk and pk["eager"] else "-"
        bad = ",".join(k for k in ("convert", "convert_noei", "fold", "fold_noei") if _failed(r, k))
        bad = "timeout" if "timeout" in r else bad
        lines.append(
            f"| {r['label']} | {r.get('bn_called', '-')} | {c.get('fused_ran', '-')} / {n.get('fused_ran', '-')}; "
            f"{n.get('fused_ran_next', '-')} | {c.get('report_fused', '-')} / {n.get('report_fused', '-')} | "
            f"{_count(c, 'report_not_run')} / {_count(n, 'report_not_run')}; {_count(n, 'report_not_run_next')} | "
            f"{r.get('fold', {}).get('folded', '-')} / {r.get('bns', '-')} | "
            f"{r.get('frozen_called', '-')} / {c.get('frozen_still_called', '-')} / "
            f"{r.get('fold', {}).get('frozen_still_called', '-')} | {ratio} | {bad or '-'} |")
    return "\n".join(lines)


def causes_table(records: List[Dict[str, Any]]) -> str:
    """Failures counted by cause (:func:`cause`) and pass."""
    keys = ("convert", "convert_noei", "fold", "fold_noei")
    counts: Dict[str, Dict[str, int]] = collections.defaultdict(lambda: collections.Counter())
    for r in records:
        if "skipped" in r:
            continue
        for key in keys:
            if "timeout" in r:
                continue
            if "crash" in r:
                counts[cause(r["crash"])][key] += 1
            elif key in r and not r[key].get("ok", False):
                counts[cause(r[key].get("error", "?"))][key] += 1
    lines = ["| cause | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for c in sorted(counts, key=lambda c: -sum(counts[c].values())):
        lines.append(f"| {c} | " + " | ".join(str(counts[c][k]) for k in keys) + " |")
    return "\n".join(lines)


def failures(records: List[Dict[str, Any]]) -> str:
    """One line per failing check: label, pass, error text."""
    out = []
    for r in records:
        for key in ("timeout", "crash", "skipped"):
            if key in r:
                out.append(f"- {r['label']}: {key}: {r[key]}")
        for key in ("convert", "convert_noei", "fold", "fold_noei"):
            if key in r and not r[key].get("ok", False):
                out.append(f"- {r['label']}: {key}: {r[key].get('error', '?')}")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="*", choices=FAMILIES, help="only these families")
    parser.add_argument("--models", nargs="*", help="only labels containing one of these strings")
    parser.add_argument("--limit", type=int, help="at most this many models (per family with --family)")
    parser.add_argument("--jobs", type=int, default=2, help="models run at once (one subprocess each)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "bm_sweep.json"), help="output file")
    parser.add_argument("--no-peak", action="store_true", help="skip the peak measurement")
    parser.add_argument("--list", action="store_true", help="print the labels and exit")
    parser.add_argument("--chunk", type=int, default=4, help="models per subprocess (same family)")
    parser.add_argument("--report", help="print the tables of a JSON / JSONL file written before, and exit")
    parser.add_argument("--per-model", action="store_true", help="also print one table row per model")
    parser.add_argument("--one", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        for label in args.one:
            print(json.dumps(run_one(label, peak=not args.no_peak), default=float), flush=True)
        return 0
    labels = [lb for lb in MODELS if (not args.family or MODELS[lb][0] in args.family)
              and (not args.models or any(s in lb for s in args.models))]
    if args.limit is not None:
        per: Dict[str, int] = collections.Counter()
        kept = []
        for lb in labels:
            if per[MODELS[lb][0]] < args.limit:
                per[MODELS[lb][0]] += 1
                kept.append(lb)
        labels = kept
    selection = "".join(f" --{k} {' '.join(v) if isinstance(v, list) else v}" for k, v in
                        (("family", args.family), ("models", args.models), ("limit", args.limit)) if v)
    if args.list:
        print("\n".join(labels))
        return 0
    if args.report:
        with open(args.report) as f:
            text = f.read()
        records = json.loads(text) if text.lstrip().startswith("[") else [json.loads(ln) for ln in text.splitlines() if ln]
        latest = {r["label"]: r for r in records}  # a model run twice: its last record
        records = [latest[lb] for lb in labels if lb in latest]  # the models --family / --models / --limit pick
        print(markdown(records, f"python benchmarks/bm_sweep.py --report {args.report}{selection}"))
        print("\n" + norm_markdown(records, f"python benchmarks/bm_sweep.py --report {args.report}{selection}"))
        if args.per_model:
            print("\n" + per_model(records) + "\n\n" + norm_per_model(records))
        print("\n" + causes_table(records) + "\n")
        print(failures(records))
        return 0

    t0 = time.time()

    def chunk(group: List[str]) -> List[Dict[str, Any]]:
        recs = _run_subprocess(group, args.timeout, not args.no_peak)
        for rec in recs:
            bad = [k for k in ("convert", "convert_noei", "fold", "fold_noei") if _failed(rec, k)]
            print(f"{rec['label']}: {rec.get('seconds', '?')} s" + (
                " skipped" if "skipped" in rec else f" FAIL {','.join(bad)}" if bad else ""), file=sys.stderr, flush=True)
        return recs

    groups: List[List[str]] = []
    for lb in labels:
        if groups and len(groups[-1]) < args.chunk and MODELS[groups[-1][0]][0] == MODELS[lb][0]:
            groups[-1].append(lb)
        else:
            groups.append([lb])
    open(args.json + "l", "w").close()  # one line per model as it finishes (a run cut short keeps them)
    lock = threading.Lock()

    def chunk_logged(group: List[str]) -> List[Dict[str, Any]]:
        recs = chunk(group)
        with lock, open(args.json + "l", "a") as f:
            for rec in recs:
                f.write(json.dumps(rec, default=float) + "\n")
        return recs

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        records = [r for recs in pool.map(chunk_logged, groups) for r in recs]
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(records, f, indent=1, default=float)
    command = "python benchmarks/bm_sweep.py" + selection
    print(markdown(records, command))
    print("\n" + norm_markdown(records, command))
    if args.per_model:
        print("\n" + per_model(records) + "\n\n" + norm_per_model(records))
    print(f"\n{len(records)} models in {time.time() - t0:.0f} s wall ({args.jobs} jobs)\n")
    print(causes_table(records) + "\n")
    print(failures(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
