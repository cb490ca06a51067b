"""Tests for convbn.fold (inference BatchNorm folding): numbers, structure, report, safety."""
from __future__ import annotations

import copy
import operator
from typing import Callable, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import convbn.passes.fold.directions as fold_mod  # where the graph folder calls the fold maths
from convbn.bench.models import MNISTNet
from convbn.nn.sync import SyncBatchNorm
from convbn.passes.fold.api import FoldReport, fold, fold_conv_bn_modules

from adversarial_models import BNDoingMore, ConvOutputUsedTwice, DataDependent, FunctionalConv, SharedBN  # shared with test_convert

TOL = {torch.float32: 1e-4, torch.float64: 1e-10}


# ------------------------------------------------------------------------------- helpers


def randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial running stats and affine parameters, so a fold is really tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                if m.running_mean is not None:
                    m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=g) - 0.5)
                    m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) * 1.5 + 0.5)
                if m.weight is not None:
                    m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                    m.bias.copy_(torch.rand(m.bias.shape, generator=g) - 0.5)
    return model


def bn_modules(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


def bn_names(model: nn.Module):
    return {n for n, m in model.named_modules() if isinstance(m, _BatchNorm)}


def assert_same(ref: torch.Tensor, out: torch.Tensor) -> None:
    tol = TOL[ref.dtype] * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(out, ref, rtol=0, atol=tol)


def run(model: nn.Module, x):
    with torch.no_grad():
        return model(*x) if isinstance(x, tuple) else model(x)


def report_of(model: nn.Module) -> FoldReport:
    report = model.convbn_report
    assert isinstance(report, FoldReport)
    return report


def accounted(model: nn.Module, report: FoldReport) -> None:
    """Every BatchNorm module of the original model has an entry in the report."""
    names = {a.batchnorm for a in report.outcomes}
    missing = bn_names(model) - names
    assert not missing, f"report misses {missing}\n{report}"


def state(model: nn.Module):
    return {k: v.clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- real models


def _monai_resnet(depth: int) -> nn.Module:
    from monai.networks.nets import resnet18, resnet50

    make = {18: resnet18, 50: resnet50}[depth]
    return make(spatial_dims=2, n_input_channels=3, conv1_t_stride=2, num_classes=10)


def _monai_densenet() -> nn.Module:
    from monai.networks.nets import DenseNet121

    return DenseNet121(spatial_dims=2, in_channels=3, out_channels=10)


def _monai_unet() -> nn.Module:
    from monai.networks.nets import UNet

    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(16, 32, 64, 128),
                strides=(2, 2, 2), norm="batch")


def _efficientnet_b0() -> nn.Module:
    from efficientnet_pytorch import EfficientNet

    return EfficientNet.from_name("efficientnet-b0")


REAL_MODELS = {
    # name: (factory, input shape, every BN foldable?)
    "monai_resnet18": (lambda: _monai_resnet(18), (2, 3, 64, 64), True),
    "monai_resnet50": (lambda: _monai_resnet(50), (2, 3, 64, 64), True),
    "monai_densenet121": (_monai_densenet, (1, 3, 64, 64), False),  # pre-activation BNs stay
    "monai_unet3d": (_monai_unet, (1, 1, 32, 32, 32), True),
    "efficientnet_b0": (_efficientnet_b0, (2, 3, 64, 64), True),
    "mnist": (MNISTNet, (2, 1, 28, 28), True),
}


@pytest.mark.parametrize("name", list(REAL_MODELS))
def test_real_model_matches_unfused(name: str) -> None:
    pytest.importorskip("monai")
    pytest.importorskip("efficientnet_pytorch")
    factory, shape, all_foldable = REAL_MODELS[name]
    torch.manual_seed(0)
    model = randomize_bn(factory()).eval()
    x = torch.randn(shape)
    ref = run(model, x)
    before = state(model)

    folded = fold(model, example_inputs=x)
    out = run(folded, x)
    assert_same(ref, out)

    report = report_of(folded)
    accounted(model, report)
    assert report.check is not None and report.check.ran and report.check.passed
    assert len(report.folded) > 0
    remaining = bn_modules(folded)
    if all_foldable:
        assert remaining == [], str(report)
        assert not report.skipped, str(report)
    else:
        # every BN left in the model is one the report says it skipped: in DenseNet the
        # pre-activation BNs (cat/pool -> BN -> ReLU -> conv); the conv1 -> norm2 pairs fold
        assert len(remaining) == len({a.batchnorm for a in report.skipped})
        for action in report.skipped:
            assert "ReLU" in action.reason, action
        assert all(not n.endswith("norm2") for n in bn_names(folded))
    # input model untouched (inplace=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert_same(ref, run(model, x))


def test_real_model_float64_exact() -> None:
    pytest.importorskip("monai")
    torch.manual_seed(0)
    model = randomize_bn(_monai_resnet(18)).double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    folded = fold(model, example_inputs=x)
    assert_same(run(model, x), run(folded, x))
    assert report_of(folded).check.tolerance <= 1e-10 * max(1.0, run(model, x).abs().max().item()) + 1e-30


# ---------------------------------------------------------------- small adversarial models


class ReusedConv(nn.Module):
    """One conv applied twice; a BN on the first path only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x)) + self.conv(x * 2)


def test_reused_conv_folds_into_fresh_copy() -> None:
    model = randomize_bn(ReusedConv()).eval()
    x = torch.randn(2, 3, 8, 8)
    w_before = model.conv.weight.clone()
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    (action,) = report_of(folded).outcomes
    assert action.folded and "fresh copy" in action.reason
    # the original conv (still used unfolded on the second path) keeps its weights
    assert torch.equal(folded.conv.weight, w_before)
    # rewritten in place: the BatchNorm stays in the tree (the unfolded path is the class's
    # own forward), the graph no longer calls it
    assert not any(n.op == "call_module" and n.target == "bn" for n in folded.forward.graph.nodes)


@pytest.mark.parametrize("inplace", [False, True])
def test_reused_conv_never_mutated_even_inplace(inplace: bool) -> None:
    model = randomize_bn(ReusedConv()).eval()
    x = torch.randn(2, 3, 8, 8)
    ref = run(model, x)
    conv_w = model.conv.weight.detach().clone()
    folded = fold(model, inplace=inplace)
    assert torch.equal(model.conv.weight, conv_w)
    assert_same(ref, run(folded, x))


def test_conv_output_with_other_users_is_not_folded() -> None:
    model = randomize_bn(ConvOutputUsedTwice()).eval()
    x = torch.randn(2, 3, 8, 8)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    (action,) = report_of(folded).outcomes
    assert not action.folded and "also used" in action.reason
    assert len(bn_modules(folded)) == 1


class BNThenConv(nn.Module):
    def __init__(self, padding=0, padding_mode="zeros", groups=1) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4)
        self.conv = nn.Conv2d(4, 6, 3, padding=padding, padding_mode=padding_mode, groups=groups)

    def forward(self, x):
        return self.conv(self.bn(x))


@pytest.mark.parametrize(
    "padding,padding_mode,groups",
    [(0, "zeros", 1), ("valid", "zeros", 1), (0, "zeros", 2), (1, "reflect", 1), (2, "replicate", 2),
     (1, "circular", 1)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bn_before_conv_folds_when_exact(padding, padding_mode, groups, dtype) -> None:
    model = randomize_bn(BNThenConv(padding, padding_mode, groups)).to(dtype).eval()
    x = torch.randn(2, 4, 9, 9, dtype=dtype)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    (action,) = report_of(folded).outcomes
    assert action.folded and action.direction == "following" and action.layer == "conv"
    assert bn_modules(folded) == []


@pytest.mark.parametrize("padding", [1, "same", (0, 1)])
def test_bn_before_zero_padded_conv_is_not_folded(padding) -> None:
    model = randomize_bn(BNThenConv(padding)).eval()
    x = torch.randn(2, 4, 9, 9)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    (action,) = report_of(folded).outcomes
    assert not action.folded and "zero-pads" in action.reason
    assert len(bn_modules(folded)) == 1


class BNThenFunctionalConv(nn.Module):
    """BN -> ``F.conv2d`` on the module's own weight (as efficientnet_pytorch writes convs)."""

    def __init__(self, padding, kernel: int = 3) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(4)
        self.weight = nn.Parameter(torch.randn(6, 4, kernel, kernel) / 6)
        self.padding = padding

    def forward(self, x):
        return F.conv2d(self.bn(x), self.weight, None, 1, self.padding)


@pytest.mark.parametrize("padding, kernel, folds", [
    (0, 3, True), ("valid", 3, True), ("same", 1, True), ((0, 0), 3, True),
    (1, 3, False), ("same", 3, False), ((0, 1), 3, False),
])
def test_functional_conv_after_bn_folds_only_without_zero_padding(padding, kernel, folds) -> None:
    """The module and the functional conv share one zero-padding test."""
    model = randomize_bn(BNThenFunctionalConv(padding, kernel)).eval()
    x = torch.randn(2, 4, 9, 9)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    (action,) = report_of(folded).outcomes
    assert action.folded == folds, action
    assert folds or "zero-pads" in action.reason


def test_zero_padding_fold_would_really_be_wrong() -> None:
    """Why padded convs are refused: folding anyway changes the border."""
    model = randomize_bn(BNThenConv(1)).eval()
    x = torch.randn(2, 4, 9, 9)
    w, b = fold_mod.fold_bn_into_following(model.conv.weight, model.conv.bias, model.bn.running_mean,
                                          model.bn.running_var, model.bn.eps, model.bn.weight, model.bn.bias)
    wrong = F.conv2d(x, w, b, padding=1)
    ref = run(model, x)
    assert (wrong - ref)[..., 0, :].abs().max() > 1e-3  # border differs
    torch.testing.assert_close(wrong[..., 1:-1, 1:-1], ref[..., 1:-1, 1:-1], rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "make,shape",
    [
        (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), (2, 4, 5, 5)),
        (lambda: nn.ConvTranspose2d(4, 6, 3, padding=1, output_padding=1, stride=2, groups=2, bias=False), (2, 4, 5, 5)),
        (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), (2, 3, 7)),
        (lambda: nn.ConvTranspose3d(2, 4, 2, stride=2, groups=2), (1, 2, 3, 4, 5)),
        (lambda: nn.Conv1d(3, 4, 3, dilation=2), (2, 3, 11)),
        (lambda: nn.Conv3d(2, 4, 3, padding=1, groups=2, bias=False), (1, 2, 4, 5, 6)),
    ],
)
def test_layer_then_bn_folds(make: Callable[[], nn.Module], shape: Tuple[int, ...]) -> None:
    layer = make()
    out_ch = layer.out_channels
    bn = {3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)](out_ch)
    model = randomize_bn(nn.Sequential(layer, bn, nn.ReLU())).eval()
    x = torch.randn(shape)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    (action,) = report_of(folded).outcomes
    assert action.folded and action.direction == "preceding" and action.layer == "0"
    assert bn_modules(folded) == []


def test_linear_bn1d_folds() -> None:
    model = randomize_bn(nn.Sequential(nn.Linear(8, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.BatchNorm1d(5),
                                       nn.Linear(5, 3))).eval()
    x = torch.randn(4, 8)
    folded = fold(model)  # infers a (2, 8) input from the first Linear
    assert_same(run(model, x), run(folded, x))
    actions = report_of(folded).outcomes
    assert [a.direction for a in actions] == ["preceding", "following"]
    assert bn_modules(folded) == []


def test_linear_bn1d_needs_shapes() -> None:
    """Without a sample run fold() cannot know the BN normalises the Linear's features."""
    model = randomize_bn(nn.Sequential(nn.Linear(8, 5), nn.BatchNorm1d(5))).eval()
    folded = fold(model, check=False)
    (action,) = report_of(folded).outcomes
    assert not action.folded and "example_inputs" in action.reason
    assert report_of(folded).check is None


def test_linear_bn1d_on_3d_input_is_not_folded() -> None:
    """BatchNorm1d on (N, L, F) normalises dim 1 (L), not the Linear's features F."""
    model = randomize_bn(nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5))).eval()
    x = torch.randn(3, 5, 6)  # L == out_features == 5: channel counts alone cannot tell
    folded = fold(model, example_inputs=x)
    assert_same(run(model, x), run(folded, x))
    (action,) = report_of(folded).outcomes
    assert not action.folded and "3" in action.reason


class FunctionalBN(nn.Module):
    def __init__(self, torch_op: bool) -> None:
        super().__init__()
        self.torch_op = torch_op
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("mean", torch.rand(4) - 0.5)
        self.register_buffer("var", torch.rand(4) + 0.5)
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)
        self.beta = nn.Parameter(torch.rand(4) - 0.5)

    def forward(self, x):
        y = self.conv(x)
        if self.torch_op:
            return torch.batch_norm(y, self.gamma, self.beta, self.mean, self.var, False, 0.1, 1e-3, False)
        return F.batch_norm(y, self.mean, self.var, self.gamma, self.beta, False, 0.1, 1e-3)


@pytest.mark.parametrize("torch_op", [False, True])
def test_functional_batch_norm_folds(torch_op: bool) -> None:
    model = FunctionalBN(torch_op).eval()
    x = torch.randn(2, 3, 8, 8)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    (action,) = report_of(folded).outcomes
    assert action.folded and "call" in action.batchnorm
    assert all(n.target not in (F.batch_norm, torch.batch_norm) for n in folded.forward.graph.nodes)


def test_functional_conv_folds() -> None:
    model = randomize_bn(FunctionalConv()).eval()
    x = torch.randn(2, 3, 8, 8)
    weights = [p.detach().clone() for p in model.parameters()]
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    assert [a.folded for a in report_of(folded).outcomes] == [True, True]
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert bn_modules(folded) == []


class MyBN(nn.BatchNorm2d):
    """A user subclass keeping torch's forward."""


class MyBNAct(nn.BatchNorm2d):
    """A user subclass with its own forward (like timm's BatchNormAct2d)."""

    def forward(self, x):
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return F.relu(x)


class WrapsBN(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.inner = nn.BatchNorm2d(c)

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("make_bn", [MyBN, MyBNAct, WrapsBN, nn.SyncBatchNorm, SyncBatchNorm])
def test_wrapped_and_subclassed_bn_fold(make_bn) -> None:
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(make_bn(4)), nn.ReLU())).eval()
    x = torch.randn(2, 3, 8, 8)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    report = report_of(folded)
    accounted(model, report)
    assert [a.folded for a in report.outcomes] == [True], str(report)
    assert bn_modules(folded) == []


class HasUntraceableChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        self.branchy = DataDependent()
        self.conv = nn.Conv2d(4, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(self.branchy(self.stem(x)[:, :3])))


def test_untraceable_top_level_is_folded_part_by_part() -> None:
    model = randomize_bn(DataDependent()).eval()
    folded = fold(model)
    for seed in range(4):  # both branches
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed)) + (seed - 2)
        assert_same(run(model, x), run(folded, x))
    report = report_of(folded)
    accounted(model, report)
    assert report.untraced and report.untraced[0][0] == ""
    by_name = {a.batchnorm: a for a in report.outcomes}
    assert by_name["a.0.1"].folded and by_name["a.1.1"].folded and by_name["b.0.1"].folded
    assert not by_name["bn"].folded and "could not be traced" in by_name["bn"].reason
    assert isinstance(folded, DataDependent) and len(bn_modules(folded)) == 1


def test_untraceable_submodule_stays_opaque_and_is_folded_inside() -> None:
    model = randomize_bn(HasUntraceableChild()).eval()
    x = torch.randn(2, 3, 10, 10)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    report = report_of(folded)
    accounted(model, report)
    by_name = {a.batchnorm: a for a in report.outcomes}
    assert by_name["stem.1"].folded and by_name["bn"].folded
    assert by_name["branchy.a.0.1"].folded and by_name["branchy.a.1.1"].folded and by_name["branchy.b.0.1"].folded
    assert not by_name["branchy.bn"].folded
    assert any(name == "branchy" for name, _ in report.untraced)


def test_nested_sequentials() -> None:
    inner = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3)), nn.Sequential(nn.Sequential(nn.BatchNorm2d(4))))
    model = randomize_bn(nn.Sequential(nn.Sequential(inner, nn.ReLU()), nn.Sequential(nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2)))).eval()
    x = torch.randn(2, 3, 8, 8)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    assert len(report_of(folded).folded) == 2 and bn_modules(folded) == []


def test_bn_module_called_twice() -> None:
    model = randomize_bn(SharedBN()).eval()
    x = torch.randn(2, 3, 8, 8)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    assert [a.layer for a in report_of(folded).outcomes] == ["c1", "c2"]
    assert bn_modules(folded) == []


# ------------------------------------------------------------------------- negative cases


def test_bn_subclass_doing_more_folds_its_batch_norm_and_keeps_the_rest() -> None:
    # super().forward(x) is recognised as the standard batch norm; the "* 2 + 1" after it stays
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), BNDoingMore(4))).eval()
    x = torch.randn(2, 3, 8, 8)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    report = report_of(folded)
    accounted(model, report)
    assert [a.folded for a in report.outcomes] == [True]
    assert any(n.op == "call_function" and n.target is operator.mul for n in folded.forward.graph.nodes)


def test_bn_in_training_mode_is_left_alone() -> None:
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))).eval()
    model[1].train()
    x = torch.randn(2, 3, 8, 8)
    stats = model[1].running_mean.clone()
    folded = fold(model)
    # the check ran the train-mode BN twice but restored its running stats
    assert torch.equal(folded.get_submodule("1").running_mean, stats)
    report = report_of(folded)
    by_name = {a.batchnorm: a for a in report.outcomes}
    assert not by_name["1"].folded and "training mode" in by_name["1"].reason
    assert by_name["3"].folded
    assert len(bn_modules(folded)) == 1
    model.eval()
    folded.eval()
    assert_same(run(model, x), run(folded, x))


def test_bn_without_running_stats_is_left_alone() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)).eval()
    x = torch.randn(2, 3, 8, 8)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    (action,) = report_of(folded).outcomes
    assert not action.folded and "track_running_stats=False" in action.reason
    assert len(bn_modules(folded)) == 1


def test_bad_inputs() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        fold(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="TorchScript"):
        fold(torch.jit.script(nn.Sequential(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1)).eval()))
    with pytest.raises(ValueError, match=r"model.eval\(\)"):
        fold(nn.Sequential(nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1)))


def test_check_reports_when_no_input_can_be_inferred() -> None:
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 5 * 5, 2))).eval()
    folded = fold(model)  # needs 7x7 inputs; no guess fits
    report = report_of(folded)
    assert report.check is not None and not report.check.ran
    assert "example_inputs" in report.check.note
    assert report.folded
    x = torch.randn(2, 3, 7, 7)
    assert_same(run(model, x), run(folded, x))


# ------------------------------------------------------------------------------ API contract


def test_input_model_unchanged_and_inplace_modifies() -> None:
    model = randomize_bn(MNISTNet()).eval()
    x = torch.randn(2, 1, 28, 28)
    ref = run(model, x)
    before = state(model)
    folded = fold(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(run(model, x), ref)
    assert all(p is not q for p in folded.parameters() for q in model.parameters()
               if p.shape == q.shape and p.shape == model.conv1.weight.shape)

    folded_inplace = fold(model, inplace=True)
    assert_same(ref, run(folded_inplace, x))
    assert not torch.equal(model.conv1.weight, before["conv1.weight"])


def test_report_str_lists_every_bn() -> None:
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                       nn.BatchNorm2d(4, track_running_stats=False))).eval()
    text = str(report_of(fold(model)))
    assert "1 folded, 1 skipped" in text and "track_running_stats" in text and "check: passed" in text


def test_check_catches_a_wrong_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    real = fold_mod.fold_bn_into_preceding

    def broken(*args, **kwargs):
        w, b = real(*args, **kwargs)
        return w * 1.01, b

    monkeypatch.setattr(fold_mod, "fold_bn_into_preceding", broken)
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).eval()
    x = torch.randn(2, 3, 8, 8)
    with pytest.warns(RuntimeWarning, match="differ"):
        left = fold(model)  # the check caught it: the model as it was, the reason in its report
    assert not report_of(left).folded and "differ" in report_of(left).skipped[0].reason
    assert_same(run(model, x), run(left, x))
    folded = fold(model, check=False)  # the same bug goes unnoticed without the check
    assert (run(folded, x) - run(model, x)).abs().max() > 1e-3


def test_fold_conv_bn_modules_helper() -> None:
    conv = nn.ConvTranspose2d(4, 6, 3, groups=2)
    bn = randomize_bn(nn.Sequential(nn.BatchNorm2d(6)))[0].eval()
    fused = fold_conv_bn_modules(conv, bn)
    assert isinstance(fused, nn.ConvTranspose2d) and fused.weight is not conv.weight
    x = torch.randn(2, 4, 5, 5)
    assert_same(run(nn.Sequential(conv, bn), x), run(fused, x))
    with pytest.raises(ValueError, match="training mode"):
        fold_conv_bn_modules(conv, nn.BatchNorm2d(6))
    with pytest.raises(ValueError, match="channels"):
        fold_conv_bn_modules(conv, nn.BatchNorm2d(5).eval())
    with pytest.raises(TypeError):
        fold_conv_bn_modules(nn.ReLU(), bn)


# ----------------------------------------------------------------- scripting and export


@pytest.mark.parametrize("name", ["mnist", "monai_resnet18"])
def test_folded_model_scripts_and_exports(name: str) -> None:
    if name.startswith("monai"):
        pytest.importorskip("monai")
    factory, shape, _ = REAL_MODELS[name]
    model = randomize_bn(factory()).eval()
    x = torch.randn(shape)
    folded = fold(model, example_inputs=x)
    ref = run(model, x)
    scripted = torch.jit.script(folded)
    assert_same(ref, run(scripted, x))
    exported = torch.export.export(folded, (x,))
    assert_same(ref, run(exported.module(), x))


# ------------------------------------------------------------------------------ benchmark


def test_inference_bench_smoke() -> None:
    from convbn.bench.inference import rows_to_markdown, run_inference_bench
    from convbn.bench.models import build_model, parse_spec

    assert parse_spec("monai:resnet50(spatial_dims=2,n_input_channels=3)") == (
        "monai", "resnet50", {"spatial_dims": 2, "n_input_channels": 3})
    with pytest.raises(ValueError, match="source"):
        build_model("nosuch:bad-name")  # not a module:callable spelling: an unknown source
    with pytest.raises(ImportError, match="nosuch"):
        build_model("nosuch:net")  # module:callable whose module does not import
    rows = run_inference_bench(["mnist"], batch_size=2, repeats=2, warmup=1, progress=False)
    by_variant = {r.variant: r for r in rows}
    assert set(by_variant) == {"unfused", "fx fuse", "convbn.fold", "fold + jit.script"}
    assert by_variant["convbn.fold"].batchnorms_left == 0
    assert by_variant["convbn.fold"].max_abs_diff < 1e-4
    assert "convbn.fold" in rows_to_markdown(rows)


def test_a_spec_whose_library_is_missing_names_the_spec_and_the_package(monkeypatch) -> None:
    import sys

    from convbn.bench.models import build_model

    for name in [n for n in sys.modules if n == "monai" or n.startswith("monai.")] + ["monai"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed (imported or not)
    spec = "monai:resnet18(spatial_dims=5)"
    with pytest.raises(ImportError) as info:
        build_model(spec)
    assert repr(spec) in str(info.value) and "'monai', which is not installed" in str(info.value)


class AliasedAndTied(nn.Module):
    """``a`` and ``b`` are the same conv object; ``c`` shares its weight with ``d``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 3, 1)
        self.b = self.a
        self.c = nn.Conv2d(3, 3, 1)
        self.d = nn.Conv2d(3, 3, 1)
        self.d.weight = self.c.weight
        self.bn_a, self.bn_c = nn.BatchNorm2d(3), nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn_a(self.a(x)) + self.b(x) + self.bn_c(self.c(x)) + self.d(x)


@pytest.mark.parametrize("inplace", [False, True])
def test_aliased_module_and_tied_weights_are_not_mutated(inplace: bool) -> None:
    model = randomize_bn(AliasedAndTied()).eval()
    x = torch.randn(2, 3, 5, 5)
    ref = run(model, x)
    a_w, c_w = model.a.weight.detach().clone(), model.c.weight.detach().clone()
    folded = fold(model, inplace=inplace)
    assert_same(ref, run(folded, x))
    assert torch.equal(model.a.weight, a_w)  # aliased: called twice, never mutated
    assert torch.equal(model.d.weight, c_w)  # d still sees the unfolded shared weight
    assert all(a.folded for a in report_of(folded).outcomes)


def test_conv_bn_bn_chain_folds_twice() -> None:
    model = randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm2d(4))).double().eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    folded = fold(model)
    assert_same(run(model, x), run(folded, x))
    assert [a.layer for a in report_of(folded).outcomes] == ["0", "0"] and bn_modules(folded) == []


class _Jump(nn.Module):
    """conv -> BN, then a step: ``y + 100 * (y > t)``. Rounding near ``t`` becomes a jump of 100."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.register_buffer("t", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(x))
        return y + 100.0 * (y > self.t).to(y.dtype)


def test_fold_check_judges_a_jump_in_float64_not_as_a_bug() -> None:
    """A threshold between eager's and the fold's float32 value of one element (with eager's
    float64 value on eager's side): float32 outputs differ by 100 there, which no rounding
    slack explains; the float64 fold equals the float64 original, so fold passes and says why
    (Note: [a fold checked in float64])."""
    torch.manual_seed(0)
    model = _Jump()
    x = torch.randn(2, 3, 8, 8)
    for _ in range(2):
        model(x)
    model.eval()
    with torch.no_grad():
        y32 = model.bn(model.conv(x))
        f32 = fold(copy.deepcopy(model), check=False)
        m64 = copy.deepcopy(model).double()
        y64 = m64.bn(m64.conv(x.double()))
    # the folded pre-step value: run the folded model with t far away and subtract the step
    f32.t.fill_(1e9)
    with torch.no_grad():
        folded32 = f32(x)
    differ = (folded32 != y32).flatten().nonzero().flatten().tolist()
    chosen = None
    for i in differ:
        a, b, e = y32.flatten()[i].item(), folded32.flatten()[i].item(), y64.flatten()[i].item()
        t = torch.tensor((a + b) / 2, dtype=torch.float32).item()  # the buffer is float32
        if not min(a, b) < t < max(a, b):
            continue  # adjacent floats: nothing strictly between
        others = torch.cat([y32.flatten()[:i], y32.flatten()[i + 1:]])
        if (e > t) == (a > t) and not ((others - t).abs() < 1e-4).any():
            chosen = t
            break
    assert chosen is not None, "no element whose fold rounds across a threshold (pick another seed)"
    model.t.fill_(chosen)
    folded = fold(copy.deepcopy(model), example_inputs=x)
    assert "folded in float64 it equals the float64 original" in folded.convbn_report.check.note
    assert folded.convbn_report.check.passed
    with torch.no_grad():
        assert (folded(x) - model(x)).abs().max().item() == 100.0  # the jump is real in float32


def test_inplace_unchecked_fold_has_no_first_call_check_against_overwritten_weights() -> None:
    """``inplace=True`` may overwrite the original's weights, so an unchecked in-place fold
    installs no first-call check against the module's own forward: its first call is the
    fold's, silently (the float64 fold check relies on this, see test above)."""
    import warnings

    class Net(nn.Module):  # a traced forward (a Sequential folds module by module)
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.bn(self.conv(x)))

    model = Net()
    randomize_bn(nn.Sequential(model.bn))
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    ref = run(copy.deepcopy(model), x)
    folded = fold(model, inplace=True, check=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(run(folded, x), ref)


def test_fold_states_its_stages_in_order() -> None:
    """fold runs named stages in order, and the graph folder's stages hand values on:
    matching returns the sites without touching the graph, folding then rewrites it."""
    from convbn.passes.fold import api, stages
    from convbn.passes.fold.folder import FoldContext, GraphFolder
    from convbn.passes.fold.match import FoldSite
    from convbn.passes.report.fold_report import FoldReport
    from convbn.passes.report.outcome import BNOutcome

    assert [s.__name__ for s in api.FOLD_STAGES] == ["fold_graphs", "account", "check_folded"]
    assert [s.__name__ for s in stages.GRAPH_STAGES] == ["canonicalise", "match", "fold_sites", "tidy"]

    net = randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.BatchNorm2d(4),
                                     nn.BatchNorm2d(4, track_running_stats=False))).eval()
    gm = torch.fx.symbolic_trace(net)
    before = str(gm.graph)
    folder = GraphFolder(gm, net, "", FoldContext(FoldReport(), False, {}, {}))
    found = stages.match(folder, stages.canonicalise(folder, None))
    assert str(gm.graph) == before and not folder.ctx.report.outcomes  # matching changed nothing
    assert [type(s) for s in found] == [FoldSite, FoldSite, BNOutcome]
    norm_act = stages.fold_sites(folder, found)
    stages.tidy(folder, norm_act)
    # the second BatchNorm read the first; once that folded it reads the conv and folds too
    assert [(o.batchnorm, o.result) for o in folder.ctx.report.outcomes] == [("1", "folded"), ("2", "folded"),
                                                                             ("3", "left")]
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(gm(x), net(x))
