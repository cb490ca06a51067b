"""BatchNorm written any way (issue 10, items 1 and 5): convert() fuses and fold() folds the
batch-norm computation of modules that are not plain ``nn.BatchNorm2d`` leaves.

Replicas of common third-party shapes, written from scratch: a norm+act ``BatchNorm2d``
subclass with ``drop`` / ``act`` children and the bookkeeping ``_BatchNorm.forward`` does
(momentum float and ``None``), a ``SyncBatchNorm`` + act subclass calling
``super().forward``, a frozen BatchNorm holding only buffers, a module calling
``F.batch_norm`` on its own tensors, and an unknown ``_BatchNorm`` subclass that only adds
attributes. Then real models where they import here.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

import convbn
from convbn.passes.bn.frozen import frozen_bn_ranks, recognise_frozen_norm_act
from convbn.passes.bn.recognise import recognise_norm_act

STRATEGIES = ("recompute_bn", "recompute_conv", "auto")
TOL = dict(rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- replicas


class NormAct2d(nn.BatchNorm2d):
    """BatchNorm2d + dropout + activation in one module (the norm-act layer shape)."""

    def __init__(self, num_features: int, momentum=0.1, drop: float = 0.0, act: Callable[[], nn.Module] = nn.ReLU,
                 **kwargs) -> None:
        super().__init__(num_features, momentum=momentum, **kwargs)
        self.drop = nn.Dropout(drop) if drop else nn.Identity()
        self.act = act()

    def forward(self, x: Tensor) -> Tensor:
        torch._assert(x.ndim == 4, "NormAct2d expects a 4-D input")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats
        x = F.batch_norm(x, self.running_mean if keep else None, self.running_var if keep else None,
                         self.weight, self.bias, use_batch, factor, self.eps)
        return self.act(self.drop(x))


class SyncNormAct(nn.SyncBatchNorm):
    """SyncBatchNorm whose forward adds an activation after ``super().forward``."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(super().forward(x))


class FrozenBN2d(nn.Module):
    """A BatchNorm with fixed statistics and affine parameters, all buffers."""

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.rand(num_features) + 0.5)
        self.register_buffer("bias", torch.randn(num_features))
        self.register_buffer("running_mean", torch.randn(num_features))
        self.register_buffer("running_var", torch.rand(num_features) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)


class FrozenNormAct2d(FrozenBN2d):
    """A frozen BatchNorm followed by its own dropout and activation children."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.drop = nn.Identity()
        self.act = nn.Hardswish()

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight.reshape(1, -1, 1, 1), self.bias.reshape(1, -1, 1, 1)
        rm, rv = self.running_mean.reshape(1, -1, 1, 1), self.running_var.reshape(1, -1, 1, 1)
        scale = w * (rv + self.eps).rsqrt()
        return self.act(self.drop(x * scale + (b - rm * scale)))


class FunctionalBN(nn.Module):
    """Holds BatchNorm tensors without being a ``_BatchNorm``; calls ``F.batch_norm`` on them."""

    def __init__(self, num_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(num_features) + 0.5)
        self.bias = nn.Parameter(torch.randn(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x: Tensor) -> Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.2, 1e-3)


class TaggedBN(nn.BatchNorm2d):
    """A BatchNorm2d subclass the pass has never seen that only adds an attribute."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.tag = "mine"


KINDS: Dict[str, Callable[[int], nn.Module]] = {
    "norm-act": lambda c: NormAct2d(c),
    "norm-act-momentum-none": lambda c: NormAct2d(c, momentum=None, act=nn.SiLU),
    "norm-act-dropout": lambda c: NormAct2d(c, drop=0.3),
    "sync-norm-act": lambda c: SyncNormAct(c),
    "frozen": lambda c: FrozenBN2d(c),
    "frozen-norm-act": lambda c: FrozenNormAct2d(c),
    "functional": lambda c: FunctionalBN(c),
    "unknown-subclass": lambda c: TaggedBN(c),
}


def make_net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), KINDS[kind](4), nn.Conv2d(4, 5, 3))
    for m in net.modules():  # non-trivial affine parameters and statistics
        if isinstance(m, _BatchNorm):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 1.5)
    return net.double()


def inputs() -> Tensor:
    return torch.randn(2, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def run_step(model: nn.Module, x: Tensor, seed: int, upstream: bool) -> Tuple[Tensor, Dict[str, Tensor]]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = model(x)
    if upstream:
        g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(100 + seed))
        (out * g).sum().backward()
    else:
        out.sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_steps(eager: nn.Module, fast: nn.Module, x: Tensor, steps: int = 3) -> None:
    for s in range(steps):
        for upstream in (True, False):
            out_e, g_e = run_step(eager, x, s, upstream)
            out_f, g_f = run_step(fast, x, s, upstream)
            torch.testing.assert_close(out_f, out_e, **TOL)
            assert g_f.keys() == g_e.keys()
            for n in g_e:
                torch.testing.assert_close(g_f[n], g_e[n], **TOL, msg=lambda m: f"step {s} grad {n}: {m}")
            be, bf = dict(eager.named_buffers()), dict(fast.named_buffers())
            assert bf.keys() == be.keys()
            for n in be:  # running statistics and num_batches_tracked
                torch.testing.assert_close(bf[n], be[n], **TOL, msg=lambda m: f"step {s} buffer {n}: {m}")


# ----------------------------------------------------------------------------- convert


def bn_rows(report: Any) -> list:
    """The report rows that fuse a BatchNorm (a convolution ending a chain has a row without one)."""
    return [p for p in report.pairs if p.bn]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_convert_fuses_and_matches_eager(kind: str, strategy: str) -> None:
    eager = make_net(kind)
    model = copy.deepcopy(eager)
    fast = convbn.convert(model, strategy=strategy, example_inputs=inputs())
    report = fast.convbn_report
    assert [(p.conv, p.bn) for p in bn_rows(report)] == [("0", "1")], report
    if report.eager_fallback:  # auto's never-above-eager last resort on this tiny net: reported as what runs
        assert strategy == "auto" and report.skipped, report
        assert all(o.reason.startswith("fallback: the fused step measured") for o in report.skipped), report
    else:
        assert not report.skipped, report
    assert list(fast.state_dict()) == list(eager.state_dict())
    assert all(a is b for a, b in zip(fast.parameters(), model.parameters()))
    x = inputs()
    assert_same_steps(eager, fast, x)
    eager.eval()
    fast.eval()
    assert_same_steps(eager, fast, x, steps=1)


@pytest.mark.parametrize("kind", ["norm-act", "norm-act-momentum-none"])
def test_norm_act_tail_is_fused_as_the_layers_activation(kind: str) -> None:
    fast = convbn.convert(make_net(kind), strategy="recompute_bn")
    (pair,) = bn_rows(fast.convbn_report)
    assert pair.activation in ("relu", "silu")


def test_hook_registered_on_a_norm_act_module_after_conversion_runs_as_in_eager() -> None:
    eager = make_net("norm-act")
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    seen: List[Tensor] = []
    for model in (eager, fast):
        model.get_submodule("1").register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    x = inputs()
    assert_same_steps(eager, fast, x, steps=1)
    assert len(seen) == 4  # once per forward, in both models
    torch.testing.assert_close(seen[1], seen[0], **TOL)


def test_norm_act_with_track_running_stats_false_and_no_affine() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), NormAct2d(4, affine=False, track_running_stats=False)).double()
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv")
    assert [p.bn for p in bn_rows(fast.convbn_report)] == ["1"]
    assert_same_steps(eager, fast, inputs())


class PreScaledBN(nn.BatchNorm2d):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x * 2.0)


class WrongMomentumBN(NormAct2d):
    def forward(self, x: Tensor) -> Tensor:
        return self.act(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                     self.training, 0.5, self.eps))


class ModeDependentTailBN(NormAct2d):
    def forward(self, x: Tensor) -> Tensor:
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                         self.momentum if self.training else 0.0, self.eps)
        if self.training:
            self.num_batches_tracked.add_(1)
            return self.act(x)
        return x


@pytest.mark.parametrize("module, words", [
    (PreScaledBN(4), "not applied to the module's input"),
    (WrongMomentumBN(4), "momentum=0.5"),
    (ModeDependentTailBN(4), "differs between training and eval"),
], ids=["pre-scaled", "wrong-momentum", "mode-dependent-tail"])
def test_unrecognised_subclass_stays_and_says_why(module: nn.Module, words: str) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), module, nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)).double()
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn", example_inputs=inputs())
    report = fast.convbn_report
    assert [p.bn for p in bn_rows(report)] == ["3"]
    reasons = {s.bn: s.reason for s in report.skipped}
    assert words in reasons["1"], reasons
    assert_same_steps(eager, fast, inputs(), steps=2)


def test_recogniser_accepts_the_replicas_and_frozen_detection_is_numerical() -> None:
    assert recognise_norm_act(NormAct2d(3)).reason is None
    assert recognise_norm_act(NormAct2d(3, momentum=None)).reason is None
    assert recognise_norm_act(SyncNormAct(3)).reason is None
    assert frozen_bn_ranks(FrozenBN2d(3)) == (4,)
    assert frozen_bn_ranks(FrozenNormAct2d(3)) == ()  # not a batch norm as a whole ...
    assert recognise_frozen_norm_act(FrozenNormAct2d(3)).ranks == (4,)  # ... but before its children

    class AlmostFrozen(FrozenBN2d):  # forgets eps: not a batch norm
        def forward(self, x: Tensor) -> Tensor:
            scale = self.weight * self.running_var.rsqrt()
            return x * scale.reshape(1, -1, 1, 1) + (self.bias - self.running_mean * scale).reshape(1, -1, 1, 1)

    assert frozen_bn_ranks(AlmostFrozen(3)) == ()
    assert frozen_bn_ranks(nn.BatchNorm2d(3)) == ()  # a real BatchNorm is no frozen one


# ----------------------------------------------------------------------------- fold


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "norm-act-dropout"] + ["norm-act-dropout"])
def test_fold_folds_and_keeps_the_tail(kind: str) -> None:
    eager = make_net(kind).eval()
    x = inputs()
    folded = convbn.fold(eager, example_inputs=x)
    report = folded.convbn_report
    assert [(a.batchnorm, a.folded, a.layer) for a in report.outcomes] == [("1", True, "0")], report
    assert report.check.ran and report.check.passed
    torch.testing.assert_close(folded(x), eager(x), **TOL)
    assert not any(k.startswith("1.running") for k in folded.state_dict())
    tail = dict(folded.named_modules()).get("1")
    if isinstance(KINDS[kind](4), (NormAct2d, SyncNormAct, FrozenNormAct2d)):
        assert isinstance(tail.act, nn.Module)  # the activation is kept, the BN gone
        assert not isinstance(tail, _BatchNorm)


def test_fold_reports_pre_activation_as_not_foldable() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1)).eval()
    folded = convbn.fold(model, example_inputs=torch.randn(1, 3, 8, 8))
    (action,) = folded.convbn_report.outcomes
    assert not action.folded
    assert "ReLU" in action.reason and "pre-activation" in action.reason, action.reason


# ----------------------------------------------------------------------------- real models


def _timm_model(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from zoo import timm_or_skip

        return timm_or_skip().create_model(name, pretrained=False)
    return make


def _efficientnet_pytorch() -> nn.Module:
    efficientnet = pytest.importorskip("efficientnet_pytorch")
    return efficientnet.EfficientNet.from_name("efficientnet-b0")


REAL: Dict[str, Callable[[], nn.Module]] = {
    "timm-efficientnet_b0": _timm_model("efficientnet_b0"),
    "timm-mobilenetv3_small_100": _timm_model("mobilenetv3_small_100"),
    "timm-regnetx_002": _timm_model("regnetx_002"),
}


def _bn_count(model: nn.Module) -> int:
    return sum(isinstance(m, _BatchNorm) for m in model.modules())


@pytest.mark.parametrize("name", list(REAL))
def test_real_norm_act_models_fuse_every_batchnorm(name: str) -> None:
    torch.manual_seed(0)
    eager = REAL[name]()
    x = torch.randn(2, 3, 32, 32)
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn", example_inputs=x)
    report = fast.convbn_report
    assert len(bn_rows(report)) == _bn_count(eager), [s.reason for s in report.skipped][:3]
    out_e, g_e = run_step(eager, x, 0, True)
    out_f, g_f = run_step(fast, x, 0, True)
    torch.testing.assert_close(out_f, out_e, rtol=1e-4, atol=1e-4)
    for n in g_e:
        torch.testing.assert_close(g_f[n], g_e[n], rtol=1e-3, atol=1e-4, msg=lambda m: f"grad {n}: {m}")
    for (n, a), b in zip(eager.named_buffers(), fast.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"buffer {n}: {m}")


@pytest.mark.parametrize("name", list(REAL))
def test_real_norm_act_models_fold(name: str) -> None:
    torch.manual_seed(0)
    eager = REAL[name]().eval()
    folded = convbn.fold(eager, example_inputs=torch.randn(1, 3, 32, 32))
    report = folded.convbn_report
    assert report.check.passed
    assert len(report.folded) == _bn_count(eager), report
    assert _bn_count(folded) == 0


def test_efficientnet_pytorch_still_fuses_everything() -> None:
    eager = _efficientnet_pytorch()
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn", example_inputs=torch.randn(2, 3, 32, 32))
    assert len(bn_rows(fast.convbn_report)) == _bn_count(eager)


def test_torchvision_frozen_batchnorm_fuses_and_folds() -> None:
    from zoo import torchvision_or_skip

    ops = torchvision_or_skip().ops
    torch.manual_seed(0)
    frozen = ops.FrozenBatchNorm2d(4)
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean"):
            getattr(frozen, name).normal_()
        frozen.running_var.uniform_(0.5, 1.5)
    eager = nn.Sequential(nn.Conv2d(3, 4, 3), frozen, nn.ReLU(), nn.Conv2d(4, 4, 1)).double()
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_conv", example_inputs=inputs())
    assert [(p.bn, p.activation) for p in bn_rows(fast.convbn_report)] == [("1", "relu")]
    assert_same_steps(eager, fast, inputs(), steps=2)
    folded = convbn.fold(eager.eval(), example_inputs=inputs())
    assert [(a.batchnorm, a.folded) for a in folded.convbn_report.outcomes] == [("1", True)]
    assert isinstance(dict(folded.named_modules())["1"], nn.Identity)  # in place: the folded BN's slot


def test_functional_batchnorm_reads_the_models_tensors_after_to_and_assign_load() -> None:
    eager = make_net("functional")
    fast = convbn.convert(copy.deepcopy(eager), strategy="recompute_bn")
    state = {k: v.clone() + (0.5 if "running" in k else 0.0) for k, v in eager.state_dict().items()}
    eager.load_state_dict(state)
    fast.load_state_dict(state, assign=True)
    eager.float()
    fast.float()
    x = inputs().float()
    torch.testing.assert_close(fast(x), eager(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.state_dict()["1.running_mean"], eager.state_dict()["1.running_mean"])
