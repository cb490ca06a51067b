"""``convbn.passes.tracing.trace``: traces that would mislead, partial tracing, what a replaced module
keeps, and validation -- through both passes (``convert`` and ``fold``).

Every model is small and hand-written (or a real MONAI network), run against an eager copy:
float64 models at 1e-10 (outputs, input and parameter gradients with random upstream
gradients, running statistics, ``num_batches_tracked``, two steps), real float32 models at
float32 tolerance.
"""
from __future__ import annotations

import copy
import io
import warnings
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

import convbn
from convbn.passes.graph.graph_module import installed
from convbn import FusedChain
from convbn.passes.graph.hooks import hook_reason
from convbn.passes.tracing.trace import LayerTracer, TraceHazard, trace

DT = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- helpers


def cbr(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


def build(factory: Callable[[], nn.Module], seed: int = 0, dtype: torch.dtype = DT) -> nn.Module:
    torch.manual_seed(seed)
    model = factory().to(dtype)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm) and m.running_mean is not None:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
    return model


def inp(*shape: int, seed: int = 1, dtype: torch.dtype = DT) -> Tensor:
    return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def step(model: nn.Module, x: Tensor, seed: int) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = model(x)
    out.backward(torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed + 100)))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def assert_same_training(eager: nn.Module, fast: nn.Module, x: Tensor, steps: int = 2, tol: Any = TOL) -> None:
    for s in range(steps):
        oe, ge, pe = step(eager, x, s)
        of, gf, pf = step(fast, x, s)
        torch.testing.assert_close(of, oe, **tol)
        torch.testing.assert_close(gf, ge, **tol)
        assert pf.keys() == pe.keys()
        for n in pe:
            torch.testing.assert_close(pf[n], pe[n], **tol, msg=lambda m: f"grad {n}: {m}")
        be, bf = dict(eager.named_buffers()), dict(fast.named_buffers())
        assert be.keys() == bf.keys()
        for n in be:
            torch.testing.assert_close(bf[n], be[n], **tol, msg=lambda m: f"buffer {n}: {m}")


def num_chained(model: nn.Module) -> int:
    return sum(len(m.layers) for _, m in convbn.fused_modules(model) if isinstance(m, FusedChain))


# --------------------------------------------------------------------------- trace hazards


class UpCatAdd(nn.Module):
    """MONAI UpCat's pattern: the skip connection is taken only if ``torch.jit.isinstance``
    says it is a tensor -- which a ``torch.fx`` proxy is not."""

    def __init__(self) -> None:
        super().__init__()
        self.a = cbr(3, 4)
        self.b = cbr(4, 4)

    def forward(self, x: Tensor, skip: Any = None) -> Tensor:
        y = self.a(x)
        skip = y * 2 if skip is None else skip
        if skip is not None and torch.jit.isinstance(skip, torch.Tensor):
            y = y + skip
        return self.b(y)


class UpCatCat(nn.Module):
    """Same with a concatenation: without the skip the next conv gets the wrong channel count."""

    def __init__(self, check: Callable[[Any], bool]) -> None:
        super().__init__()
        self.check = check
        self.a = cbr(3, 4)
        self.b = cbr(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.a(x)
        skip = -y
        if self.check(skip):
            y = torch.cat([y, skip], dim=1)
        return self.b(y)


class Outer(nn.Module):
    """The hazard one level down: the parent is traced around it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.stem = cbr(3, 3)
        self.inner = inner
        self.head = cbr(4, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.inner(self.stem(x)))


HAZARDS: Dict[str, Callable[[], nn.Module]] = {
    "jit.isinstance-add (same shapes)": UpCatAdd,
    "jit.isinstance-cat (different shapes)": lambda: UpCatCat(lambda t: torch.jit.isinstance(t, torch.Tensor)),
    "isinstance-cat": lambda: UpCatCat(lambda t: isinstance(t, torch.Tensor)),
    "torch.is_tensor-cat": lambda: UpCatCat(torch.is_tensor),
    "nested jit.isinstance-add": lambda: Outer(UpCatAdd()),
}


@pytest.mark.parametrize("with_inputs", [False, True])
@pytest.mark.parametrize("name", list(HAZARDS))
def test_trace_hazards_convert_exactly(name: str, with_inputs: bool) -> None:
    eager = build(HAZARDS[name])
    x = inp(2, 3, 6, 6)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x if with_inputs else None)
    assert_same_training(eager, fast, x)
    report = fast.convbn_report
    # each asks about a tensor the graph computed: answered True as eager answers, traced whole
    # (Note: [is_tensor on a traced tensor is True]); a question on an input: test_hazard_is_raised_...
    assert not report.untraced, report
    assert len(report.pairs) == (4 if name.startswith("nested") else 2), report


@pytest.mark.parametrize("name", list(HAZARDS))
def test_trace_hazards_fold_exactly(name: str) -> None:
    eager = build(HAZARDS[name]).eval()
    x = inp(2, 3, 6, 6)
    folded = convbn.fold(eager, example_inputs=x)
    torch.testing.assert_close(folded(x), eager(x), **TOL)
    assert len(folded.convbn_report.folded) >= 2


class AskInput(nn.Module):
    """Asks whether an input is a tensor: a symbolic trace cannot know (a number in eager)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = cbr(4, 4)

    def forward(self, x: Tensor, skip: Any) -> Tensor:
        y = self.a(x)
        if torch.jit.isinstance(skip, torch.Tensor):
            y = y + skip
        return y


class OuterAsk(Outer):
    def forward(self, x: Tensor) -> Tensor:
        s = self.stem(x)
        return self.head(self.inner(s, s.size(1)))  # an int in eager: not a tensor


def test_hazard_is_raised_inside_the_module_that_makes_it() -> None:
    with pytest.raises(TraceHazard, match="torch.jit.isinstance"):
        trace(AskInput())
    assert not trace(UpCatAdd()).opaque  # asked of a computed tensor: answered, no hazard
    t = trace(OuterAsk(AskInput()))
    assert list(t.opaque) == ["inner"] and "TraceHazard" in t.opaque["inner"]
    assert any(n.op == "call_module" and n.target == "inner" for n in t.graph.nodes)


def test_isinstance_inside_torch_and_on_other_types_is_not_a_hazard() -> None:
    class Fine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = cbr(3, 4)
            self.scale = 2.0

        def forward(self, x: Tensor) -> Tensor:
            if isinstance(self.scale, float):  # not a traced value: fine
                x = x * self.scale
            return F.relu(self.body(x))

    t = trace(Fine())
    assert not t.opaque


class TypeCheckSkip(nn.Module):
    """``type(t) is torch.Tensor`` is not seen by any hazard check: only validation catches it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = cbr(3, 4)
        self.b = cbr(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.a(x)
        if type(y) is torch.Tensor:
            y = y + y.flip(-1)
        return self.b(y)


def test_validation_with_example_inputs_converts_the_misleading_part_finer() -> None:
    eager = build(lambda: Outer2(TypeCheckSkip()))
    x = inp(2, 3, 6, 6)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)
    report = fast.convbn_report
    assert any("differs from eager" in why for _, why in report.untraced), report
    assert report.validated  # the finer parts were validated
    assert len(report.pairs) >= 2
    assert_same_training(eager, fast, x)


class Outer2(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.stem = cbr(3, 3)
        self.inner = inner
        self.head = cbr(4, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.inner(self.stem(x)))


def test_without_example_inputs_the_first_call_validates_and_falls_back() -> None:
    eager = build(TypeCheckSkip)
    x = inp(2, 3, 6, 6)
    fast = convbn.convert(copy.deepcopy(eager))
    with pytest.warns(RuntimeWarning, match="differs from the original on its first call"):
        assert_same_training(eager, fast, x, steps=1)
    assert_same_training(eager, fast, x)  # from then on: the original, exactly


class _DoubleGrad(torch.autograd.Function):
    """Identity forward, gradient doubled in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return 2 * g


class GradOnlySkip(TypeCheckSkip):
    """``type(t) is torch.Tensor`` hides a branch from the trace that changes only the
    backward: outputs agree, gradients do not."""

    def forward(self, x: Tensor) -> Tensor:
        y = self.a(x)
        if type(y) is torch.Tensor:
            y = _DoubleGrad.apply(y)
        return self.b(y)


def test_first_call_under_no_grad_compares_outputs_only() -> None:
    eager = build(GradOnlySkip)
    x = inp(2, 3, 6, 6)
    fast = convbn.convert(copy.deepcopy(eager))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            torch.testing.assert_close(fast(x), eager(x), rtol=0, atol=0)
    assert not fast.forward.fallback  # the first-call check compares outputs only: the rewrite stays


def test_first_call_validation_passes_silently_and_changes_no_state() -> None:
    eager = build(lambda: nn.Sequential(cbr(3, 4), nn.Dropout(0.3), cbr(4, 4)))
    x = inp(2, 3, 6, 6)
    fast = convbn.convert(copy.deepcopy(eager))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training(eager, fast, x)  # dropout: the RNG stream is eager's
    assert num_chained(fast) == 2


# --------------------------------------------------------------------------- partial tracing


class DataDependent(nn.Module):
    """Untraceable: Python control flow on a tensor value."""

    def forward(self, x: Tensor) -> Tensor:
        return x * 2 if float(x.sum()) > 0 else x


class Across(nn.Module):
    """A conv -> BN pair of the root whose data flows *around* an untraceable child."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.odd = DataDependent()
        self.bn = nn.BatchNorm2d(4)
        self.tail = cbr(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)
        return self.tail(F.relu(self.bn(y))) + self.odd(y)


def test_untraceable_child_is_a_leaf_and_siblings_still_fuse() -> None:
    eager = build(Across)
    x = inp(2, 3, 6, 6)
    fast = convbn.convert(copy.deepcopy(eager))
    # the conv has 2 users: bn cannot join it, but it heads the chain of tail (bn -> relu -> tail.0)
    assert num_chained(fast) == 2 and {p.bn for p in fast.convbn_report.pairs} == {"bn", "tail.1"}
    eager2 = build(lambda: nn.Sequential(cbr(3, 4), DataDependent(), cbr(4, 4)))
    fast2 = convbn.convert(copy.deepcopy(eager2))
    assert type(fast2) is nn.Sequential and installed(fast2) is not None and num_chained(fast2) == 2
    assert_same_training(eager2, fast2, x)
    assert_same_training(eager, fast, x)


def drop_path(x: Tensor, p: float, training: bool) -> Tensor:
    """A helper that cannot be traced in training mode (``len`` of a proxy's shape)."""
    if not training:
        return x
    shape = [x.shape[0]] + [1] * (len(x.shape) - 1)
    return x / (1 - p) * torch.floor(torch.rand(shape, dtype=x.dtype) + (1 - p))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.bn2(self.conv2(F.silu(self.bn1(self.conv1(x)))))
        return x + drop_path(y, 0.3, self.training)


def test_untraceable_helper_function_runs_as_one_call_and_mode_switches_stay_exact() -> None:
    eager = build(lambda: nn.Sequential(cbr(3, 4), Block(), Block()))
    x = inp(4, 3, 6, 6)
    fast = convbn.convert(copy.deepcopy(eager))
    assert num_chained(fast) == 5 and not fast.convbn_report.untraced
    assert_same_training(eager, fast, x)  # drop_path's random mask: eager's RNG stream
    for model in (eager, fast):
        model.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), eager(x), **TOL)  # eval: drop_path is off, as in eager
    for model in (eager, fast):
        model.train()
    assert_same_training(eager, fast, x)


# --------------------------------------------------------------------------- attributes and metadata


class Windowed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = cbr(4, 4)
        self.window = 4

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


class ReadsChildAttribute(nn.Module):
    """Untraceable root reading a plain attribute of a child that gets converted."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = cbr(3, 4)
        self.child = Windowed()

    def forward(self, x: Tensor) -> Tensor:
        y = self.child(self.stem(x))
        if float(y.mean()) > -1e9:  # data-dependent: the root cannot be traced
            y = y * self.child.window
        return y


def test_plain_attributes_of_a_replaced_child_are_kept() -> None:
    eager = build(ReadsChildAttribute)
    x = inp(2, 3, 6, 6)
    fast = convbn.convert(copy.deepcopy(eager))
    assert type(fast.child) is type(eager.child) and installed(fast.child) is not None and fast.child.window == 4
    assert_same_training(eager, fast, x)
    for clone in (copy.deepcopy(fast), _saved_and_loaded(fast)):
        assert clone.child.window == 4
        assert_same_training(copy.deepcopy(eager), clone, x, steps=1)
    folded = convbn.fold(copy.deepcopy(eager).eval(), example_inputs=x)
    assert folded.child.window == 4


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


class Versioned(nn.Module):
    """MNASNet's pattern: ``_version = 2`` and an old layout read from version-1 checkpoints."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(cbr(3, 4), cbr(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any],
                              strict: bool, missing: List[str], unexpected: List[str], errors: List[str]) -> None:
        if local_metadata.get("version", 1) < 2:  # old checkpoints had the layers one level up
            for key in [k for k in state_dict if k.startswith(prefix + "layers.")]:
                state_dict[prefix + "old." + key[len(prefix + "layers."):]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)


class VersionedChild(nn.Module):
    """An untraceable root whose child (replaced by a GraphModule) has its own ``_version``."""

    def __init__(self) -> None:
        super().__init__()
        self.child = Versioned()

    def forward(self, x: Tensor) -> Tensor:
        y = self.child(x)
        return y if float(y.sum()) > -1e9 else -y


@pytest.mark.parametrize("factory", [Versioned, VersionedChild])
def test_state_dict_metadata_versions_kept_and_checkpoints_load_both_ways(factory: Callable[[], nn.Module]) -> None:
    eager = build(factory)
    fast = convbn.convert(copy.deepcopy(eager))
    assert num_chained(fast) == 2
    meta_e, meta_f = eager.state_dict()._metadata, fast.state_dict()._metadata
    for key, value in meta_e.items():
        assert meta_f[key] == value, key
    for clone in (copy.deepcopy(fast), _saved_and_loaded(fast)):
        assert {k: clone.state_dict()._metadata[k] for k in meta_e} == dict(meta_e)
    folded = convbn.fold(copy.deepcopy(eager).eval(), example_inputs=inp(2, 3, 6, 6))
    assert folded.state_dict()._metadata[""]["version"] == meta_e[""]["version"]
    other = build(factory, seed=5)
    other.load_state_dict(fast.state_dict(), strict=True)  # converted -> original
    fast.load_state_dict(build(factory, seed=6).state_dict(), strict=True)  # original -> converted
    x = inp(2, 3, 6, 6)
    assert_same_training(build(factory, seed=6), fast, x, steps=1)


def test_hook_reason_names_parametrizations_and_pruning() -> None:
    conv = nn.Conv2d(3, 4, 3)
    assert hook_reason(conv) is None
    torch.nn.utils.weight_norm(conv)
    assert "weight_norm" in hook_reason(conv)
    conv2 = nn.Conv2d(3, 4, 3)
    import torch.nn.utils.prune as prune

    prune.l1_unstructured(conv2, "weight", 0.5)
    assert "prune" in hook_reason(conv2)


# --------------------------------------------------------------------------- fold's tolerance


def deep_offset_net(seed: int, depth: int = 8, width: int = 8) -> nn.Module:
    """Conv biases of 300-600 that each BatchNorm's running mean cancels: float32 eager
    itself is off the exact result by ~1e-3 relative, folding by about as much."""
    torch.manual_seed(seed)
    layers: List[nn.Module] = []
    c = 3
    for _ in range(depth):
        layers += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width, momentum=1.0), nn.ReLU()]
        c = width
    net = nn.Sequential(*layers)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                m.bias.uniform_(300.0, 600.0)
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
        net(torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(99)))  # statistics from data
    return net.eval()


@pytest.mark.parametrize("seed", [0, 1])
def test_fold_tolerance_follows_float32_eager_error(seed: int) -> None:
    net = deep_offset_net(seed)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    folded = convbn.fold(net, example_inputs=x)
    check = folded.convbn_report.check
    assert check.passed and len(folded.convbn_report.folded) == 8
    assert check.max_abs_diff > 1e-4 * max(1.0, net(x).abs().max().item())  # beyond the old fixed tolerance
    exact = copy.deepcopy(net).double()(x.double())
    # the folded float32 model is as close to the exact result as eager float32 is
    assert (folded(x).double() - exact).abs().max() <= 2 * (net(x).double() - exact).abs().max()


def test_fold_check_still_catches_a_wrong_fold_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    import convbn.passes.fold.directions as fold_mod  # where the graph folder calls the fold maths

    net = deep_offset_net(0, depth=2)
    real = fold_mod.fold_bn_into_preceding

    def off_by_a_bit(*args: Any, **kwargs: Any) -> Tuple[Tensor, Tensor]:
        w, b = real(*args, **kwargs)
        return w * 1.01, b

    monkeypatch.setattr(fold_mod, "fold_bn_into_preceding", off_by_a_bit)
    with pytest.warns(RuntimeWarning, match="differ"):  # caught: the model comes back unfolded
        left = convbn.fold(net, example_inputs=torch.randn(2, 3, 16, 16))
    assert not left.convbn_report.folded and all("differ" in o.reason for o in left.convbn_report.skipped)


# --------------------------------------------------------------------------- real MONAI networks

monai_nets = pytest.importorskip("monai.networks.nets")


def close_scaled(actual: Tensor, expected: Tensor, what: str, floor: float = 0.0, rtol: float = 5e-4) -> None:
    """float32 closeness relative to the tensor's own scale (at least ``floor``): the fused
    SiLU is recomputed by formula, so EfficientNet's gradients differ by float32 rounding."""
    scale = max(float(expected.abs().max()) if expected.numel() else 0.0, floor)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


REAL: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...], int]] = {
    "BasicUNet": (lambda: monai_nets.BasicUNet(spatial_dims=2, in_channels=1, out_channels=2,
                                               features=(4, 4, 8, 8, 16, 4), norm="batch"), (2, 1, 32, 32), 18),
    "FlexibleUNet": (lambda: monai_nets.FlexibleUNet(in_channels=1, out_channels=2, backbone="efficientnet-b0",
                                                     pretrained=False, spatial_dims=2), (2, 1, 64, 64), 58),
    "EfficientNetBN": (lambda: monai_nets.EfficientNetBN("efficientnet-b0", pretrained=False, spatial_dims=2,
                                                         in_channels=3, num_classes=10), (2, 3, 64, 64), 49),
}


@pytest.mark.parametrize("name", list(REAL))
def test_real_monai_networks_convert_and_fold_exactly(name: str) -> None:
    factory, shape, pairs = REAL[name]
    eager = build(factory, dtype=torch.float32)
    x = inp(*shape, dtype=torch.float32)
    fast = convbn.convert(copy.deepcopy(eager))
    assert len([p for p in fast.convbn_report.pairs if p.bn]) == pairs, fast.convbn_report  # fused BatchNorms
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the first-call validation passes
        oe, ge, pe = step(eager, x, 0)
        of, gf, pf = step(fast, x, 0)
    close_scaled(of, oe, "output")
    close_scaled(gf, ge, "input grad")
    floor = 1e-3 * max(float(g.abs().max()) for g in pe.values())
    assert pf.keys() == pe.keys()
    for n in pe:
        close_scaled(pf[n], pe[n], f"grad {n}", floor=floor)
    for (n, b), b2 in zip(eager.named_buffers(), fast.buffers()):
        close_scaled(b2.double(), b.double(), f"buffer {n}")
    folded = convbn.fold(copy.deepcopy(eager).eval(), example_inputs=x)
    assert len(folded.convbn_report.folded) >= pairs
    with torch.no_grad():
        close_scaled(folded(x), eager.eval()(x), "folded output", rtol=1e-4)


def test_fold_falls_back_to_child_by_child_where_the_whole_fold_differs() -> None:
    eager = build(lambda: Outer2(TypeCheckSkip())).eval()
    x = inp(2, 3, 6, 6)
    with pytest.warns(RuntimeWarning, match="child by child"):
        folded = convbn.fold(eager, example_inputs=x)
    report = folded.convbn_report
    assert any("folded child by child" in why for _, why in report.untraced), report
    assert report.check.passed and len(report.folded) >= 2
    torch.testing.assert_close(folded(x), eager(x), **TOL)


class _ConvOwnForward(nn.Conv2d):
    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.weight, self.bias)


class _LinearSubclass(nn.Linear):
    """Keeps torch's forward: a leaf like nn.Linear."""


class _ConstantEvalNormAct(nn.BatchNorm2d):
    """Its own forward, not recognised as a norm-act (training is a constant False)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                   self.eps))


@pytest.mark.parametrize("training", [True, False])
def test_one_leaf_policy_for_both_passes(training: bool) -> None:
    """LayerTracer (convert and fold): layers with torch's forward and BatchNorms are leaves,
    a conv with its own forward is traced into; an unrecognised BatchNorm subclass is a leaf
    in training (convert) and traced into in eval (fold: its constant batch norm folds)."""
    model = nn.Sequential(_ConvOwnForward(3, 4, 1), _ConstantEvalNormAct(4), nn.BatchNorm2d(4), _LinearSubclass(5, 5))
    t = trace(model, LayerTracer, training=training)
    calls = [(n.op, n.target if n.op == "call_module" else getattr(n.target, "__name__", n.target))
             for n in t.graph.nodes if n.op in ("call_module", "call_function")]
    middle = [("call_module", "1")] if training else [("call_function", "batch_norm"), ("call_function", "relu")]
    assert calls == [("call_function", "conv2d"), *middle, ("call_module", "2"), ("call_module", "3")]
