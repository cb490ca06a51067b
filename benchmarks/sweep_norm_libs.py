"""Model libraries whose networks normalise per sample (GroupNorm, InstanceNorm, channel LayerNorm).

Families for ``bm_sweep.py``, each built from a library's own code without weights, on small
CPU inputs (batch 2):

* ``monai``: MONAI ``UNet`` (InstanceNorm, or GroupNorm; PReLU), ``BasicUNet`` (InstanceNorm ->
  LeakyReLU), ``DynUNet`` (InstanceNorm -> LeakyReLU, residual), ``SegResNet`` (GroupNorm ->
  ReLU -> Conv, pre-activation); 2-D and 3-D.
* ``dnanorm``: nnU-Net's ``dynamic_network_architectures`` U-Nets as nnU-Net builds them:
  ``InstanceNorm{2,3}d(affine=True)`` -> ``LeakyReLU``.
* ``diff``: ``diffusers`` ``UNet2DModel`` (ResBlocks GroupNorm -> SiLU -> Conv, with and without
  attention), ``UNet2DConditionModel`` (cross-attention), ``AutoencoderKL`` / ``VQModel``
  encoders-decoders, called with ``return_dict=False`` through a small wrapper module.
* ``convnext``: ConvNeXt-style classifiers (depthwise conv -> LayerNorm over channels -> MLP):
  timm ``convnext_*`` / ``convnextv2_*`` (the small ones with a 1x1-conv MLP after a
  ``LayerNorm2d``, and ``conv_mlp=False``: ``nn.LayerNorm`` channels-last, then ``nn.Linear``)
  and torchvision ``convnext_tiny`` (``Permute`` modules, channels-last ``nn.LayerNorm``).
* ``dethead``: detection heads with Conv -> GroupNorm -> ReLU towers: torchvision ``FCOSHead``
  and the GroupNorm ``RetinaNetHead`` of RetinaNet v2, on a list of FPN-like feature maps.
* ``gnresnet``: ResNets normalised by GroupNorm: timm ``resnet50_gn``, timm ``resnetv2`` BiT
  (GroupNorm + weight-standardised convs), torchvision ``resnet18`` with a GroupNorm
  ``norm_layer``.
* the eight families of :mod:`sweep_norm_more` (a second round of libraries) and the six of
  :mod:`sweep_norm_third` (a third round) and the seven of :mod:`sweep_norm_fourth` (a fourth round:
  five per-sample-norm libraries, two BatchNorm ones) and :mod:`sweep_norm_fifth`'s ``timmnorm`` (a fifth
  round: timm's per-sample-norm families never run before) and the three of :mod:`sweep_norm_sixth` (a sixth round:
  ``diffusers``' video / 3-D models ``diff2``, ``transformers``' audio encoders ``hfaudio`` and vision nets
  ``hfvision2``), merged into :data:`NORM_FAMILIES`.
* ``bnctl``: BatchNorm controls built from the same libraries (MONAI ``UNet`` / ``DynUNet``
  with BatchNorm, torchvision ``resnet18``), whose numbers must not move.

:func:`norm_kind` names what a called normalisation module computes (``group``,
``instance``, ``layer-channel``: a LayerNorm over one dimension of a 4-D / 5-D tensor, either
channels-last between permutes or a ``LayerNorm2d`` over dimension 1; ``layer-token``: a
LayerNorm on token sequences, outside this work; ``hand-written``: a library's own norm module,
``RMSNorm`` / ``LayerNorm`` written from tensor ops, counted apart from the three the fused share
is taken over); :func:`norm_hooks` records which ones a
training step calls as modules, so the sweep counts, per kind, the ones the converted model's
report lists as fused *and* its step no longer calls as modules (fused and running; a norm
module with its own forward can be traced into its parent's graph and so not be called while
left unfused, hence the report too), and the fused norm chain Functions in the step's graph.

Set-up (``--no-deps``: each would otherwise resolve another torch)::

    pip install --no-deps diffusers==0.42.1 dynamic-network-architectures==0.4.4

(MONAI, timm and torchvision are in the dev environment.)
"""
from __future__ import annotations

import collections
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

from sweep_norm_more import NORM_MORE_FAMILIES
from sweep_norm_fifth import NORM_FIFTH_FAMILIES
from sweep_norm_fourth import NORM_FOURTH_FAMILIES
from sweep_norm_sixth import NORM_SIXTH_FAMILIES
from sweep_norm_third import NORM_THIRD_FAMILIES

__all__ = ["NORM_FAMILIES", "NORM_KINDS", "build_norm", "count_norms", "norm_kind", "norm_hooks", "norm_markdown"]

Built = Tuple[Any, Tuple[Any, ...]]
Entry = Tuple[str, Callable[[Any], Built]]

#: the kinds :func:`norm_kind` names, in table order
NORM_KINDS = ("group", "instance", "layer-channel", "layer-token", "hand-written")


def _randn(gen: Any, *shape: int) -> Tuple[Any, ...]:
    import torch

    return (torch.randn(*shape, generator=gen),)


# --------------------------------------------------------------------------- counting

def _is_torch_norm(m: Any) -> bool:
    import torch.nn as nn
    from torch.nn.modules.instancenorm import _InstanceNorm

    return isinstance(m, (nn.GroupNorm, _InstanceNorm, nn.LayerNorm))


def _is_hand_written_norm(m: Any) -> bool:
    """A library's own normalisation module (``LayerNorm``, ``RMSNorm``, ``ChanLayerNorm``,
    ``LayerNorm2d``, asteroid's ``GlobLN`` ... written from tensor ops): its class name ends in
    ``Norm``, ``Norm1d`` / ``Norm2d`` / ``Norm3d`` or ``LN``, it is no torch norm nor BatchNorm, and it
    has no child modules (a ``PreNorm`` wrapper has one)."""
    import re

    from torch.nn.modules.batchnorm import _BatchNorm

    return (re.search(r"(Norm|LN)([123]d)?$", type(m).__name__) is not None and not _is_torch_norm(m)
            and not isinstance(m, _BatchNorm) and next(iter(m.children()), None) is None)


def _is_norm(m: Any) -> bool:
    return _is_torch_norm(m) or _is_hand_written_norm(m)


def norm_kind(m: Any, x: Any) -> str:
    """What the normalisation module ``m`` computes on its input ``x`` (:data:`NORM_KINDS`)."""
    import torch.nn as nn

    if _is_hand_written_norm(m):
        return "hand-written"
    if isinstance(m, nn.GroupNorm):
        return "group"
    if not isinstance(m, nn.LayerNorm):
        return "instance"
    return "layer-channel" if len(m.normalized_shape) == 1 and x.dim() >= 4 else "layer-token"


def norm_hooks(model: Any) -> Tuple[Dict[str, str], List[Any]]:
    """``name -> kind`` of the per-sample normalisation modules called from now on (filled as the
    model runs), and the hook handles to remove."""
    called: Dict[str, str] = {}
    handles = []
    for name, m in model.named_modules():
        if _is_norm(m):
            def hook(mod: Any, args: Any, name: str = name) -> None:
                if args and hasattr(args[0], "dim"):
                    called[name] = norm_kind(mod, args[0])
            hook.convbn_observer = True  # type: ignore[attr-defined]  # an observer: fused layers stay fused
            handles.append(m.register_forward_pre_hook(hook))
    return called, handles


def count_norms(model: Any) -> int:
    """Per-sample normalisation modules in ``model``."""
    return sum(_is_norm(m) for m in model.modules())


def norm_markdown(records: List[Dict[str, Any]], command: str) -> str:
    """Per family: norms called by kind, fused and running (no longer called as modules by the
    converted model, with ``example_inputs``; without, on its second step), reported fused,
    worst float32 error, failures, peak against eager."""
    fams: Dict[str, List[Dict[str, Any]]] = collections.defaultdict(list)
    for r in records:
        if any(r.get("norm_called", {}).values()):  # families with per-sample norms only
            fams[r["family"]].append(r)
    if not fams:
        return ""
    lines = [f"Command: `{command}`", "",
             "| family | models | norms called (" + " / ".join(NORM_KINDS) + ") | fused and running (ei) | "
             "fused and running (noei, 2nd step) | report fused (norms) | convert fail (ei / noei) | "
             "decided in float64 | peak x eager (median; max) |",
             "|---|---:|---|---|---|---:|---:|---:|---|"]
    for fam in sorted(fams) + ["**all**"]:
        rs = [r for f in fams for r in fams[f]] if fam == "**all**" else fams[fam]
        lines.append(_norm_row(fam, rs))
    return "\n".join(lines)


def _kinds(counts: List[Dict[str, int]]) -> List[int]:
    return [sum(c.get(k, 0) for c in counts) for k in NORM_KINDS]


def _fused_text(called: List[int], fused: List[int]) -> str:
    total, done = sum(called[:3]), sum(fused[:3])
    per = " / ".join(f"{f}" for f in fused)
    return f"{done} of {total} ({done / max(total, 1):.0%}); {per}"


def _norm_row(name: str, rs: List[Dict[str, Any]]) -> str:
    called = _kinds([r["norm_called"] for r in rs])
    ei = _kinds([r.get("convert", {}).get("norm_fused_ran", {}) for r in rs])
    noei = _kinds([r.get("convert_noei", {}).get("norm_fused_ran_next", {}) for r in rs])
    rep = sum(r.get("convert", {}).get("norm_report_fused", 0) for r in rs)
    fails = [sum("timeout" not in r and ("crash" in r or not r.get(k, {}).get("ok", False)) for r in rs)
             for k in ("convert", "convert_noei")]
    f64 = sum("float64" in r.get(k, {}) for r in rs for k in ("convert", "convert_noei"))
    ratios = sorted(r["peak"]["converted"] / r["peak"]["eager"] for r in rs
                    if isinstance(r.get("peak"), dict) and r["peak"].get("eager"))
    peak = f"{ratios[len(ratios) // 2]:.2f}x; {ratios[-1]:.2f}x" if ratios else "-"
    return (f"| {name} | {len(rs)} | {' / '.join(map(str, called))} | {_fused_text(called, ei)} | "
            f"{_fused_text(called, noei)} | {rep} | {fails[0]} / {fails[1]} | {f64} | {peak} |")


# --------------------------------------------------------------------------- MONAI

def _monai(name: str, dim: int, **kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        from monai.networks import nets

        size = (32,) * dim if dim == 3 else (64, 64)
        if name == "UNet":
            model = nets.UNet(spatial_dims=dim, in_channels=1, out_channels=2, channels=(8, 16, 32, 64),
                              strides=(2, 2, 2), num_res_units=2, **kw)
        elif name == "BasicUNet":
            model = nets.BasicUNet(spatial_dims=dim, in_channels=1, out_channels=2, features=(8, 8, 16, 32, 64, 8),
                                   **kw)
        elif name == "DynUNet":
            model = nets.DynUNet(spatial_dims=dim, in_channels=1, out_channels=2, kernel_size=[3, 3, 3, 3],
                                 strides=[1, 2, 2, 2], upsample_kernel_size=[2, 2, 2], filters=[8, 16, 32, 64], **kw)
        elif name == "SegResNet":
            model = nets.SegResNet(spatial_dims=dim, in_channels=1, out_channels=2, init_filters=8, **kw)
        else:
            raise ValueError(f"unknown MONAI net {name!r}")
        return model, _randn(gen, 2, 1, *size)
    return build


# --------------------------------------------------------------------------- nnU-Net

def _dna_in(arch: str, dim: int, **kw: Any) -> Callable[[Any], Built]:
    """sweep_more_libs' nnU-Net builder with InstanceNorm, nnU-Net's default."""
    from sweep_more_libs import _dna

    return _dna(arch, dim, norm_kind="instance", **kw)


# --------------------------------------------------------------------------- diffusers

def _tuple_output(model: Any, *extra: Any) -> Any:
    """``model`` called with ``return_dict=False`` and the extra tensors after the sample: what a
    training script's ``model(x, t, ...).sample`` computes, as a tuple the sweep's loss reads."""
    import torch.nn as nn

    class DiffusersTuple(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, sample: Any, *args: Any) -> Any:
            return self.inner(sample, *args, return_dict=False)

    return DiffusersTuple(model)


def _diff_unet(attention: bool, **kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        import torch
        from diffusers import UNet2DModel

        down = ("DownBlock2D", "AttnDownBlock2D" if attention else "DownBlock2D", "DownBlock2D")
        up = ("UpBlock2D", "AttnUpBlock2D" if attention else "UpBlock2D", "UpBlock2D")
        model = UNet2DModel(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(32, 64, 64),
                            down_block_types=down, up_block_types=up, layers_per_block=2, norm_num_groups=16,
                            **kw)
        t = torch.tensor([10, 500])
        return _tuple_output(model), (*_randn(gen, 2, 3, 32, 32), t)
    return build


def _diff_cond(gen: Any) -> Built:
    import torch
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=16)
    ctx = torch.randn(2, 7, 32, generator=gen)
    return _tuple_output(model), (*_randn(gen, 2, 4, 16, 16), torch.tensor([10, 500]), ctx)


def _diff_vae(kind: str) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        import diffusers

        cls = getattr(diffusers, kind)
        kw: Dict[str, Any] = dict(in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1,
                                  latent_channels=4, norm_num_groups=16,
                                  down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
        return _tuple_output(cls(**kw)), _randn(gen, 2, 3, 32, 32)
    return build


# --------------------------------------------------------------------------- timm / torchvision

def _timm(name: str, size: int = 64, **kw: Any) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, **kw), _randn(gen, 2, 3, size, size)
    return build


def _tv_convnext(gen: Any) -> Built:
    from torchvision.models import convnext_tiny

    return convnext_tiny(weights=None, num_classes=10), _randn(gen, 2, 3, 64, 64)


def _tv_resnet(norm: Optional[str]) -> Callable[[Any], Built]:
    def build(gen: Any) -> Built:
        import torch.nn as nn
        from torchvision.models import resnet18

        norm_layer = (lambda c: nn.GroupNorm(16, c)) if norm == "group" else None
        return resnet18(weights=None, num_classes=10, norm_layer=norm_layer), _randn(gen, 2, 3, 64, 64)
    return build


def _features(gen: Any, channels: int, sizes: Tuple[int, ...]) -> Tuple[Any, ...]:
    import torch

    return ([torch.randn(2, channels, s, s, generator=gen) for s in sizes],)


def _fcos_head(gen: Any) -> Built:
    from torchvision.models.detection.fcos import FCOSHead

    return FCOSHead(in_channels=64, num_anchors=1, num_classes=5, num_convs=4), _features(gen, 64, (16, 8, 4))


def _retina_v2_head(gen: Any) -> Built:
    import torch.nn as nn
    from torchvision.models.detection.retinanet import RetinaNetHead

    head = RetinaNetHead(in_channels=64, num_anchors=9, num_classes=5, norm_layer=partial(nn.GroupNorm, 16))
    return head, _features(gen, 64, (16, 8, 4))


# --------------------------------------------------------------------------- the families

NORM_FAMILIES: Dict[str, Dict[str, Entry]] = {
    "monai": {
        "UNet-2d-instance": ("segmentation", _monai("UNet", 2)),
        "UNet-3d-instance": ("segmentation", _monai("UNet", 3)),
        "UNet-3d-group": ("segmentation", _monai("UNet", 3, norm=("group", {"num_groups": 2}))),
        "UNet-2d-group": ("segmentation", _monai("UNet", 2, norm=("group", {"num_groups": 2}))),
        "UNet-3d-instance-leakyrelu": ("segmentation", _monai("UNet", 3, act="LEAKYRELU")),
        "BasicUNet-2d": ("segmentation", _monai("BasicUNet", 2)),
        "BasicUNet-3d": ("segmentation", _monai("BasicUNet", 3)),
        "DynUNet-2d": ("segmentation", _monai("DynUNet", 2)),
        "DynUNet-3d": ("segmentation", _monai("DynUNet", 3)),
        "DynUNet-3d-residual": ("segmentation", _monai("DynUNet", 3, res_block=True)),
        "DynUNet-3d-group": ("segmentation", _monai("DynUNet", 3, norm_name=("group", {"num_groups": 4}))),
        "SegResNet-2d": ("segmentation", _monai("SegResNet", 2)),
        "SegResNet-3d": ("segmentation", _monai("SegResNet", 3)),
    },
    "dnanorm": {
        "PlainConvUNet-2d-instance": ("segmentation", _dna_in("PlainConvUNet", 2)),
        "PlainConvUNet-3d-instance": ("segmentation", _dna_in("PlainConvUNet", 3)),
        "PlainConvUNet-3d-instance-nonlin-first": ("segmentation", _dna_in("PlainConvUNet", 3, nonlin_first=True)),
        "ResidualEncoderUNet-3d-instance": ("segmentation", _dna_in("ResidualEncoderUNet", 3)),
        "ResidualEncoderUNet-2d-instance": ("segmentation", _dna_in("ResidualEncoderUNet", 2)),
    },
    "diff": {
        "UNet2DModel": ("diffusion", _diff_unet(attention=False)),
        "UNet2DModel-attention": ("diffusion", _diff_unet(attention=True)),
        "UNet2DModel-resnet-time-scale-shift": ("diffusion", _diff_unet(attention=False,
                                                                        resnet_time_scale_shift="scale_shift")),
        "UNet2DConditionModel": ("diffusion", _diff_cond),
        "AutoencoderKL": ("autoencoder", _diff_vae("AutoencoderKL")),
        "VQModel": ("autoencoder", _diff_vae("VQModel")),
    },
    "convnext": {
        "timm-convnext_atto": ("classification", _timm("convnext_atto")),
        "timm-convnext_atto_ols": ("classification", _timm("convnext_atto_ols")),
        "timm-convnext_atto-channels-last-mlp": ("classification", _timm("convnext_atto", conv_mlp=False)),
        "timm-convnext_femto": ("classification", _timm("convnext_femto")),
        "timm-convnextv2_atto": ("classification", _timm("convnextv2_atto")),
        "tv-convnext_tiny": ("classification", _tv_convnext),
    },
    "dethead": {
        "tv-FCOSHead": ("detection", _fcos_head),
        "tv-RetinaNetHead-v2-gn": ("detection", _retina_v2_head),
    },
    "gnresnet": {
        "timm-resnet50_gn": ("classification", _timm("resnet50_gn")),
        "timm-resnetv2_50x1_bit": ("classification", _timm("resnetv2_50x1_bit")),
        "timm-resnetv2_101x1_bit": ("classification", _timm("resnetv2_101x1_bit")),
        "tv-resnet18-gn": ("classification", _tv_resnet("group")),
    },
    "bnctl": {
        "monai-UNet-3d-batch": ("segmentation", _monai("UNet", 3, norm="batch")),
        "monai-DynUNet-3d-batch": ("segmentation", _monai("DynUNet", 3, norm_name="batch")),
        "tv-resnet18": ("classification", _tv_resnet(None)),
    },
}


NORM_FAMILIES.update(NORM_MORE_FAMILIES)
NORM_FAMILIES.update(NORM_THIRD_FAMILIES)
NORM_FAMILIES.update(NORM_FOURTH_FAMILIES)
NORM_FAMILIES.update(NORM_FIFTH_FAMILIES)
NORM_FAMILIES.update(NORM_SIXTH_FAMILIES)


def build_norm(family: str, name: str, gen: Any) -> Built:
    """A network of :data:`NORM_FAMILIES` (no weights) and its example inputs."""
    from sweep_more_libs import offline

    offline()
    return NORM_FAMILIES[family][name][1](gen)


def norm_per_model(records: List[Dict[str, Any]]) -> str:
    """One row per model with per-sample norms: called by kind, fused and running (ei / noei 2nd
    step), the report's most common reasons for the ones left."""
    lines = ["| model | norms called (" + " / ".join(NORM_KINDS) + ") | fused ran (ei / noei 2nd step) | "
             "norm chain calls in the step's graph (ei) | convert ok (ei / noei) | peak x eager | "
             "left (report's reasons) |",
             "|---|---|---|---:|---|---:|---|"]
    for r in records:
        if "norm_called" not in r or not any(r["norm_called"].values()):
            continue
        c, n = r.get("convert", {}), r.get("convert_noei", {})
        called = " / ".join(str(r["norm_called"].get(k, 0)) for k in NORM_KINDS)
        pk = r.get("peak", {})
        ratio = f"{pk['converted'] / pk['eager']:.2f}" if isinstance(pk, dict) and pk.get("eager") else "-"
        reasons = "; ".join(f"{v}x {k}" for k, v in list(c.get("left_reasons", {}).items())[:2])
        lines.append(f"| {r['label']} | {called} | {sum(c.get('norm_fused_ran', {}).values())} / "
                     f"{sum(n.get('norm_fused_ran_next', {}).values())} | "
                     f"{c.get('chain_calls', {}).get('NormChainFunctionBackward', '-')} | {c.get('ok', '-')} / {n.get('ok', '-')} | "
                     f"{ratio} | {reasons[:160] or '-'} |")
    return "\n".join(lines)
