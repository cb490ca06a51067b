"""Any model a user brings (issue 22): convert and fold rewrite it in place and never break it.

From-scratch replicas of what broke on real third-party models: a parent reading a class
property of a converted child, a parent iterating / indexing / walking ``_modules`` of a
container (a detection family built from a list of layers), ``isinstance(x, dict)`` in a
forward, a custom ``autograd.Function`` with a random backward, a frozen parameter, and
the memory a convert call left behind.
"""
from __future__ import annotations

import copy
import gc
import io
import weakref
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

import convbn
from convbn import FusedChain
from convbn.passes.graph.graph_module import installed
from fusion_checks import assert_chain_ran
from test_trace import build, inp

DT = torch.float64


class ConvBNAct(nn.Module):
    """The detection family's element: a plain Conv -> BN -> activation module."""

    def __init__(self, cin: int, cout: int, k: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.bn(self.conv(x)))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(ConvBNAct(3, 4), ConvBNAct(4, 6))

    @property
    def out_channels(self) -> int:  # a class property the parent reads
        return self.body[-1].conv.out_channels

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


class LayerList(nn.Module):
    """Untraceable (data-dependent branch); reaches its children every other way than a call."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.model = nn.Sequential(ConvBNAct(6, 6), ConvBNAct(6, 6, 1))  # iterated, never called
        self.blocks = nn.ModuleList([ConvBNAct(6, 6), ConvBNAct(6, 6)])  # indexed
        self.extra = nn.Module()  # walked through ``_modules``
        self.extra.add_module("p", ConvBNAct(6, 6))
        self.head = nn.Conv2d(self.encoder.out_channels, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.encoder(x)
        assert self.encoder.out_channels == 6
        for m in self.model:
            x = m(x)
        for i in range(len(self.blocks)):
            x = self.blocks[i](x)
        for m in self.extra._modules.values():
            x = m(x)
        if float(x.mean()) > -1e9:  # data-dependent: the root cannot be traced
            x = x * 1.0
        return self.head(x)


class DictInput(nn.Module):
    """``isinstance(x, dict)``: a proxy and a tensor answer alike; the model traces whole."""

    def __init__(self) -> None:
        super().__init__()
        self.a = ConvBNAct(3, 4)
        self.b = ConvBNAct(4, 4)

    def forward(self, x: Any) -> Tensor:
        if isinstance(x, dict):
            x = x["image"]
        if isinstance(x, (list, tuple)):
            x = x[0]
        return self.b(self.a(x))


class Shake(torch.autograd.Function):
    """Shake-shake: the forward averages, the backward draws a fresh random mix."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
        return (a + b) / 2

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tuple[Tensor, Tensor]:
        beta = torch.rand(g.shape[0], 1, 1, 1, dtype=g.dtype)
        return g * beta, g * (1 - beta)


class ShakeSetup(torch.autograd.Function):
    """The same with ``setup_context`` (forward without ``ctx``)."""

    @staticmethod
    def forward(a: Tensor, b: Tensor) -> Tensor:
        return (a + b) / 2

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.batch = inputs[0].shape[0]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tuple[Tensor, Tensor]:
        beta = torch.rand(ctx.batch, 1, 1, 1, dtype=g.dtype)
        return g * beta, g * (1 - beta)


shake_alias = Shake.apply  # bound at import, before any trace


class ShakeNet(nn.Module):
    """``reach``: how the forward calls the Function: ``Shake.apply`` itself, a bound ``apply``
    kept on the instance (``self.shake = Shake.apply``) or at module level, or a
    ``setup_context``-style Function's ``apply`` kept on the instance."""

    def __init__(self, reach: str = "apply") -> None:
        super().__init__()
        self.a = ConvBNAct(3, 4)
        self.b = ConvBNAct(3, 4)
        self.c = ConvBNAct(4, 4)
        self.reach = reach
        self.shake = ShakeSetup.apply if reach == "setup_context" else Shake.apply

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.a(x), self.b(x)
        if self.reach == "apply":
            mixed = Shake.apply(a, b)
        elif self.reach == "module alias":
            mixed = shake_alias(a, b)
        else:
            mixed = self.shake(a, b)
        return self.c(mixed)


class Frozen(nn.Module):
    """A frozen layer (fine-tuning) and a fixed mask parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvBNAct(3, 4)
        self.mask = nn.Parameter(torch.ones(1, 4, 1, 1), requires_grad=False)
        self.body = ConvBNAct(4, 4)
        for p in self.stem.parameters():
            p.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(self.stem(x) * self.mask)


def bn_names(model: nn.Module) -> List[str]:
    return [n for n, m in model.named_modules() if isinstance(m, _BatchNorm)]


def chain_calls(model: nn.Module) -> Dict[str, int]:
    """Count each fused chain's calls (a forward hook on every fused module)."""
    counts: Dict[str, int] = {}
    for name, m in convbn.fused_modules(model):
        if isinstance(m, FusedChain):
            counts[name] = 0
            m.register_forward_hook(lambda mod, a, o, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def step(model: nn.Module, x: Tensor, seed: int = 0) -> Tuple[Tensor, Dict[str, Tensor], Tensor]:
    """One training step with the global RNG seeded (forward and backward draw alike)."""
    xx = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = model(xx)
    out.backward(torch.ones_like(out) + out.detach().sin())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return out.detach(), grads, xx.grad


def assert_same_step(eager: nn.Module, fast: nn.Module, x: Tensor) -> None:
    """Outputs, every gradient, input gradient, running stats and num_batches_tracked equal eager's."""
    oe, ge, xe = step(eager, x)
    of, gf, xf = step(fast, x)
    torch.testing.assert_close(of, oe, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(xf, xe, rtol=1e-9, atol=1e-9)
    assert gf.keys() == ge.keys()
    for n in ge:
        torch.testing.assert_close(gf[n], ge[n], rtol=1e-9, atol=1e-9, msg=lambda m: f"grad {n}: {m}")
    be, bf = dict(eager.named_buffers()), dict(fast.named_buffers())
    assert be.keys() == bf.keys()
    for n in be:
        torch.testing.assert_close(bf[n], be[n], rtol=1e-9, atol=1e-9, msg=lambda m: f"buffer {n}: {m}")


def fused_bns(report: Any) -> List[str]:
    return sorted(o.batchnorm for o in report.outcomes if o.result == "fused")


# ---------------------------------------------------------------- the model stays the user's


@pytest.mark.parametrize("with_inputs", [False, True])
def test_convert_keeps_class_properties_iteration_indexing_and_walks(with_inputs: bool) -> None:
    eager = build(LayerList)
    x = inp(2, 3, 8, 8)
    model = copy.deepcopy(eager)
    kw = {"example_inputs": x} if with_inputs else {}
    fast = convbn.convert(model, **kw)
    report = fast.convbn_report
    # the user's classes everywhere; containers iterate and index as before
    assert type(fast) is LayerList and type(fast.encoder) is Encoder and fast.encoder.out_channels == 6
    assert [type(m) for m in fast.model] == [ConvBNAct, ConvBNAct] and len(fast.blocks) == 2
    assert list(fast.extra._modules) == ["p"]
    assert [n for n, _ in fast.named_modules()] == [n for n, _ in eager.named_modules()]
    assert list(fast.state_dict()) == list(eager.state_dict())
    # every BatchNorm fused: also those of the containers the root iterates, indexes and walks
    assert fused_bns(report) == sorted(bn_names(eager)), report
    calls = chain_calls(fast)
    assert_same_step(eager, fast, x)
    # each element runs its own fused chain (the iterated elements are never called by a graph)
    for name in ("model.0", "model.1", "blocks.0", "blocks.1", "extra.p", "encoder"):
        assert any(n.startswith(name + ".") and c for n, c in calls.items()), (name, calls)


def test_convert_inplace_keeps_every_module_object() -> None:
    model = build(LayerList)
    before = {n: m for n, m in model.named_modules()}
    fast = convbn.convert(model, inplace=True)
    assert fast is model
    assert all(fast.get_submodule(n) is m for n, m in before.items())
    assert installed(fast.model[0]) is not None  # its rewritten graph runs as its forward


def test_explain_and_fold_keep_the_model_and_fold_everything() -> None:
    eager = build(LayerList).eval()
    x = inp(2, 3, 8, 8)
    report = convbn.explain(copy.deepcopy(eager).train(), example_inputs=x)
    assert fused_bns(report) == sorted(bn_names(eager))
    folded = convbn.fold(eager, example_inputs=x)
    assert type(folded) is LayerList and folded.encoder.out_channels == 6 and len(folded.blocks) == 2
    assert sorted(o.batchnorm for o in folded.convbn_report.outcomes if o.result == "folded") == sorted(bn_names(eager))
    assert not any(isinstance(m, _BatchNorm) for m in folded.modules())  # folded away: no BN runs
    with torch.no_grad():
        torch.testing.assert_close(folded(x), eager(x), rtol=1e-9, atol=1e-9)
    # fold without checking: the result still runs (its first call checks itself)
    unchecked = convbn.fold(eager, check=False)
    with torch.no_grad():
        torch.testing.assert_close(unchecked(x), eager(x), rtol=1e-9, atol=1e-9)


def test_converted_model_survives_deepcopy_and_torch_save() -> None:
    eager = build(LayerList)
    x = inp(2, 3, 8, 8)
    fast = convbn.convert(copy.deepcopy(eager))
    buf = io.BytesIO()
    torch.save(fast, buf)
    buf.seek(0)
    for clone in (copy.deepcopy(fast), torch.load(buf, weights_only=False)):
        assert type(clone) is LayerList and installed(clone.model[0]) is not None
        assert fused_bns(clone.convbn_report) == sorted(bn_names(eager))
        calls = chain_calls(clone)
        assert_same_step(copy.deepcopy(eager), clone, x)
        for name in ("model.0", "model.1", "blocks.0", "blocks.1", "extra.p", "encoder"):
            assert any(n.startswith(name + ".") and c for n, c in calls.items()), (name, calls)


# ---------------------------------------------------------------- trace hazards, exactly


def test_isinstance_dict_in_forward_traces_whole() -> None:
    eager = build(DictInput)
    x = inp(2, 3, 6, 6)
    for kw in ({}, {"example_inputs": x}):
        fast = convbn.convert(copy.deepcopy(eager), **kw)
        report = fast.convbn_report
        assert report.untraced == [] and report.traced == [""], report.untraced
        assert fused_bns(report) == ["a.bn", "b.bn"] and report.num_chains == 1
        calls = chain_calls(fast)
        assert_same_step(eager, fast, x)
        assert list(calls) == ["convbn_chain0"] and calls["convbn_chain0"] >= 1
    folded = convbn.fold(copy.deepcopy(eager).eval(), example_inputs=x)
    assert folded.convbn_report.untraced == [] and len(folded.convbn_report.folded) == 2


@pytest.mark.parametrize("reach", ["apply", "instance attribute", "module alias", "setup_context"])
def test_custom_function_with_random_backward_is_never_inlined(reach: str) -> None:
    eager = build(lambda: ShakeNet(reach))
    x = inp(2, 3, 6, 6)
    fn = ShakeSetup if reach == "setup_context" else Shake
    for kw in ({}, {"example_inputs": x}):
        fast = convbn.convert(copy.deepcopy(eager), **kw)
        assert fused_bns(fast.convbn_report) == ["a.bn", "b.bn", "c.bn"]
        graph = fast.forward.graph
        assert any(getattr(n.target, "cls", None) is fn for n in graph.nodes)  # one opaque call
        assert fn.__dict__["forward"].__func__.__qualname__ == f"{fn.__name__}.forward"  # restored after tracing
        calls = chain_calls(fast)
        assert_same_step(eager, fast, x)  # the backward's random mix drawn alike: same gradients
        assert len(calls) == 3 and all(calls.values())


def test_without_example_inputs_the_first_backward_checks_gradients(monkeypatch) -> None:
    """The net under the tracer: with the Function inlined again (mutant: no opaque Functions
    while tracing), outputs still match on the first call, but the first backward's check
    finds the gradients differ, warns, and the next calls run the original forward."""
    import contextlib

    import convbn.passes.tracing.trace as trace_module

    monkeypatch.setattr(trace_module, "opaque_functions", contextlib.nullcontext)
    eager = build(ShakeNet)
    ref = copy.deepcopy(eager)
    x = inp(4, 3, 6, 6)
    fast = convbn.convert(copy.deepcopy(eager))
    assert not any(getattr(n.target, "cls", None) is Shake for n in fast.forward.graph.nodes)  # inlined
    with pytest.warns(RuntimeWarning, match="training step differs from the original's on its first backward"):
        step(fast, x)
    step(ref, x)  # the same state on both sides again (running statistics)
    assert fast.forward.fallback
    assert_same_step(ref, fast, x)  # the original forward now: eager's gradients


def test_first_backward_check_passes_silently_and_runs_once() -> None:
    eager = build(ShakeNet)
    x = inp(4, 3, 6, 6)
    fast = convbn.convert(copy.deepcopy(eager))
    assert fast.forward.backward_check is not None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_step(eager, fast, x)
    assert fast.forward.backward_check is None and not fast.forward.fallback  # checked, once
    assert_chain_ran(fast(x.clone().requires_grad_()))


# ---------------------------------------------------------------- frozen parameters


def test_frozen_parameters_are_measured_and_fused() -> None:
    eager = build(Frozen)
    x = inp(2, 3, 6, 6)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=x)  # raised: hook on a frozen tensor
    report = fast.convbn_report
    assert fused_bns(report) == ["body.bn", "stem.bn"] and report.saved_bytes < report.eager_saved_bytes
    calls = chain_calls(fast)
    assert_same_step(eager, fast, x)
    assert calls and all(calls.values())
    assert convbn.explain(copy.deepcopy(eager), example_inputs=x).measured_peak_bytes > 0


# ---------------------------------------------------------------- nothing left behind


def cbr(cin: int, cout: int) -> nn.Sequential:
    """Conv -> BN -> ReLU: ReLU saves its *output* (what closed the cycle through autograd)."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


class Gate(nn.Module):
    """Conv -> BN -> ReLU, then Conv -> BN -> sigmoid: both activations save their *output*,
    which a saved-tensors hook returning the tensor itself tied into a cycle through autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.a = cbr(3, 16)
        self.b = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Sigmoid())

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _converted_copy_dies(**kwargs: Any) -> bool:
    x = torch.randn(4, 3, 64, 64)
    fast = convbn.convert(copy.deepcopy(Gate()), example_inputs=x, **kwargs)
    assert fast.convbn_report.pairs
    refs = [weakref.ref(p) for p in fast.parameters()] + [weakref.ref(fast)]
    refs += [weakref.ref(m) for _, m in convbn.fused_modules(fast)]
    del fast
    gc.collect()
    return all(r() is None for r in refs)


def test_convert_measuring_saved_bytes_leaves_nothing_alive() -> None:
    """The saved-tensors measurement (every strategy with example_inputs) keeps nothing alive."""
    assert _converted_copy_dies(strategy="recompute_conv"), "the converted copy is still referenced"


def test_convert_auto_leaves_no_parameter_alive() -> None:
    """auto measures step peaks with torch's MemTracker, whose ModTracker left a cycle
    through autograd nodes holding the measured copy's parameters (convbn now removes its
    hooks when the measurement ends)."""
    assert _converted_copy_dies(), "the converted copy's parameters are still referenced"


@pytest.mark.parametrize("measure", ["tensor_peak", "timeline"])
def test_step_measurement_leaves_no_parameter_alive(measure: str) -> None:
    """Conv -> BN -> ReLU under torch's own ModTracker keeps the convolution's weight and bias
    alive (an "all"-mode multi-grad hook stored on the node its closure holds); convbn's
    meters remove those hooks when the step ends."""
    from convbn.memory.peaks import tensor_peak
    from convbn.memory.timelines import timeline

    def step() -> List[weakref.ref]:
        net = cbr(3, 8)
        x = torch.randn(2, 3, 16, 16)
        if measure == "tensor_peak":
            with tensor_peak(net) as tp:
                net(x).sum().backward()
            assert tp.result.peak > 0
        else:
            assert timeline(net, x).peak > 0
        return [weakref.ref(p) for p in net.parameters()]

    refs = step()
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4


def test_convert_leaves_memory_flat() -> None:
    x = torch.randn(4, 3, 64, 64)
    model = Gate()
    # memory stays flat over repeated converts (each measures steps on ~4 MB of activations)
    for _ in range(3):  # warm-up: allocator pools, lazily built kernels
        convbn.convert(model, example_inputs=x)
    gc.collect()
    start = _rss()
    for _ in range(20):
        convbn.convert(model, example_inputs=x)
    gc.collect()
    grown = _rss() - start
    assert grown < 40 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 20 converts"
