"""Issue 24: one definition of a step's peak, never above eager, the largest batch that fits.

The step is the standard loop (``zero_grad(set_to_none=True)``, forward, loss, backward,
``optimizer.step()``), measured by :func:`convbn.memory.timeline` above what is live after
``zero_grad``; weight gradients count (Note: [a step's peak]).
"""
import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import convbn
from convbn.autograd.chain import ChainFunction
from convbn.memory import tensor_peak, timeline
from convbn.memory.budget import parse_memory, resident_bytes


def _net(channels, act=nn.ReLU, frozen=(), head=True):
    layers = []
    for i, (cin, cout) in enumerate(zip(channels, channels[1:])):
        conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        if i in frozen:
            conv.weight.requires_grad_(False)
        layers += [conv, nn.BatchNorm2d(cout), act()]
    if head:
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels[-1], 10)]
    return nn.Sequential(*layers)


def _timeline(model, x, accumulate):
    model.train()
    for p in model.parameters():
        p.grad = None
    if accumulate:
        model(x).float().mean().backward()  # the micro-batch before: .grad exists
    return timeline(model, x, accumulate=accumulate)


def _peak(model, x, accumulate):
    return _timeline(model, x, accumulate).peak


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _fused(model):
    """The chains ran and fused every pair (the fused path is what is measured)."""
    report = model.convbn_report
    assert report.pairs and all(p.strategy in ("recompute_bn", "recompute_conv") for p in report.pairs)
    return report


# ---------------------------------------------------------------------------- the definition


def test_hookless_meter_equals_torchs_memtracker_on_eager():
    """The meter is MemTracker without its gradient hooks: on an eager step (where hooks change
    nothing) the totals are equal to the byte."""
    torch.manual_seed(0)
    model = _net((3, 16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3, 16, 16)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).mean().backward()
        opt.step()

    step()
    got = []
    for hooks in (True, False):
        opt.zero_grad(set_to_none=True)
        with tensor_peak(model, opt, hooks=hooks) as tp:
            step()
        got.append(tp.result.peak)
    assert got[0] == got[1] > 0
    assert timeline(model, x, loss_fn=lambda o: o.mean(), optimizer=opt).peak == got[0]


def test_step_peak_counts_weight_gradients_and_starts_after_zero_grad():
    """Gradients left from the step before are freed by zero_grad before the baseline: the
    peak is the same whether they existed or not, and it includes the new gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU())
    x = torch.randn(2, 256)
    none = timeline(model, x).peak
    model(x).mean().backward()
    assert timeline(model, x).peak == none
    weight_grads = sum(p.numel() * 4 for p in model.parameters())
    assert none >= weight_grads


# ---------------------------------------------------------------------------- never above eager


@pytest.mark.parametrize("accumulate", [False, True])
def test_weight_heavy_chain_never_peaks_above_eager(accumulate):
    """Wide convs on a tiny input (weights dominate): chains used to hold every weight
    gradient of the chain until their backward returned (1.8x eager accumulating on
    ResNet-18 at 32x32); now each is accumulated as eager's engine does."""
    torch.manual_seed(0)
    base = _net((8, 128, 128, 128, 128))
    x = torch.randn(2, 8, 4, 4)
    fused = convbn.convert(copy.deepcopy(base), example_inputs=x)
    report = _fused(fused)
    assert report.num_chains == 1 and len(report.pairs) == 4
    eager, tl = _timeline(base, x, accumulate), _timeline(fused, x, accumulate)
    assert tl.peak <= eager.peak
    assert any(p.op.startswith("ChainFunctionBackward/") for p in tl.points)
    for a, b in zip(_grads(base), _grads(fused)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _observed(model, x, **backward_kw):
    seen = []
    w = next(model.parameters())
    h1 = w.register_hook(lambda g: seen.append(("hook", g.clone())))
    h2 = w.register_post_accumulate_grad_hook(lambda p: seen.append(("post", p.grad.clone())))
    try:
        model(x).mean().backward(**backward_kw)
    finally:
        h1.remove()
        h2.remove()
    return seen


def test_accumulating_in_the_chain_keeps_autograds_semantics():
    """Tensor hooks see the real gradient, post-accumulate hooks the final ``.grad``;
    ``autograd.grad`` and ``backward(inputs=...)`` leave ``.grad`` alone; an existing
    ``.grad`` is added to in place (the same tensor, as AccumulateGrad does)."""
    torch.manual_seed(0)
    base = _net((3, 8, 8), head=False)
    fused = convbn.convert(copy.deepcopy(base), strategy="recompute_conv")
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    a, b = _observed(base, x), _observed(fused, x)
    assert [k for k, _ in a] == [k for k, _ in b] == ["hook", "post"]
    for (_, ga), (_, gb) in zip(a, b):
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)
    fused.zero_grad(set_to_none=True)
    grads = torch.autograd.grad(fused(x).mean(), list(fused.parameters()))
    assert all(p.grad is None for p in fused.parameters()) and all(g.abs().sum() > 0 for g in grads[:1])
    fused(x).mean().backward(inputs=[x])
    assert all(p.grad is None for p in fused.parameters())
    fused(x).mean().backward()
    w = next(fused.parameters())
    held, first = w.grad, w.grad.clone()
    fused(x).mean().backward()
    assert w.grad is held and torch.allclose(w.grad, 2 * first, rtol=1e-5, atol=1e-6)
    assert isinstance(fused(x).grad_fn, ChainFunction._backward_cls)


_layer = st.tuples(st.sampled_from([4, 16, 64, 128]), st.sampled_from([nn.ReLU, nn.SiLU, nn.Identity]),
                   st.booleans())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(layers=[(128, nn.ReLU, False)] * 3, size=2, batch=2, accumulate=True, head=False)  # weights dominate
@example(layers=[(64, nn.SiLU, False), (64, nn.ReLU, True), (64, nn.ReLU, False)], size=2, batch=2,
         accumulate=False, head=True)
@given(layers=st.lists(_layer, min_size=1, max_size=4), size=st.sampled_from([2, 4, 16]),
       batch=st.sampled_from([2, 4]), accumulate=st.booleans(), head=st.booleans())
def test_converted_peak_never_above_eager(layers, size, batch, accumulate, head):
    """Random conv/BN/activation stacks, small and large inputs, frozen convs, gradients set
    to None or accumulated: the converted step's peak is at most eager's, to the byte."""
    torch.manual_seed(0)
    mods, cin = [], 3
    for cout, act, frozen in layers:
        conv = nn.Conv2d(cin, cout, 3, padding=1)
        conv.requires_grad_(not frozen)
        mods += [conv, nn.BatchNorm2d(cout), act()]
        cin = cout
    if head:
        mods += [nn.Flatten(), nn.Linear(cin * size * size, 10)]
    base = nn.Sequential(*mods)
    x = torch.randn(batch, 3, size, size)
    fused = convbn.convert(copy.deepcopy(base), example_inputs=x)
    assert len(fused.convbn_report.pairs) == len(layers)
    assert _peak(fused, x, accumulate) <= _peak(base, x, accumulate)


# ---------------------------------------------------------------------------- the largest batch


def test_parse_memory():
    assert parse_memory("16GiB") == 16 * 2**30
    assert parse_memory("1.5 MB") == 1_500_000
    assert parse_memory(4096) == 4096
    for bad in ("16 parsecs", "", "-1GiB", 0):
        with pytest.raises(ValueError, match="memory"):
            parse_memory(bad)
    with pytest.raises(TypeError, match="memory"):
        parse_memory([16])


def test_max_batch_is_measured_and_the_next_batch_does_not_fit():
    torch.manual_seed(0)
    net = _net((3, 16, 16, 16))
    opt = torch.optim.Adam(net.parameters())
    before = [p.detach().clone() for p in net.parameters()]
    fit = convbn.max_batch(net, torch.randn(2, 3, 16, 16), "3MiB", optimizer=opt)
    assert not opt.state and all(torch.equal(a, p) for a, p in zip(before, net.parameters()))  # untouched
    m, o = copy.deepcopy((net, opt))
    timeline(m, torch.randn(2, 3, 16, 16), optimizer=o)  # Adam's state exists, as in the search
    params = sum(p.numel() * 4 for p in net.parameters())
    assert fit.resident == resident_bytes(m, o) > resident_bytes(net) + 2 * params  # + both moments (and steps)
    for side, batch, peak in (("eager", fit.eager_batch, fit.eager_peak), ("convbn", fit.convbn_batch, fit.convbn_peak)):
        probes = fit.probes[side]
        assert batch > 2 and probes[batch] == peak and fit.resident + batch * fit.sample_bytes + peak <= fit.memory
        assert fit.resident + (batch + 1) * fit.sample_bytes + probes[batch + 1] > fit.memory
    assert fit.convbn_batch > fit.eager_batch
    assert fit.summary().startswith(f"in 3.0 MiB: eager trains batch {fit.eager_batch}, convbn batch {fit.convbn_batch}")
    # the converted model planned for that batch by convert(memory_limit=...), stepped by the user,
    # fits the memory by live tensors; max_batch's own plan also left room for the kernels' scratch,
    # which convert's planner does not count (BENCHMARKS.md "max_batch within its limit")
    x = torch.randn(fit.convbn_batch, 3, 16, 16)
    state, inputs = resident_bytes(m, o) - resident_bytes(m), x.nbytes  # the batch of inputs is in max_batch's memory
    m = convbn.convert(m, example_inputs=x, memory_limit=fit.memory - state - inputs)
    assert timeline(m, x, optimizer=o).peak <= fit.memory - fit.resident - inputs
    assert timeline(m, x, optimizer=o).peak <= fit.convbn_peak


def test_max_batch_and_memory_limit_reject_bad_arguments():
    net = _net((3, 8))
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(TypeError, match="nn.Module"):
        convbn.max_batch("net", x, "1GiB")
    with pytest.raises(ValueError, match="memory must be a number and a unit"):
        convbn.max_batch(net, x, "lots")
    with pytest.raises(TypeError, match="optimizer"):
        convbn.max_batch(net, x, "1GiB", optimizer="sgd")
    with pytest.raises(ValueError, match="memory_limit needs example_inputs"):
        convbn.convert(net, memory_limit="1GiB")
    with pytest.raises(ValueError, match="strategy='auto' only"):
        convbn.convert(net, memory_limit="1GiB", example_inputs=x, strategy="recompute_bn")
