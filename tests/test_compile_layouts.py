"""``torch.compile`` of converted models in every layout (issue 25).

One compiled model holds, per strategy and per dims (1d, 2d, 3d), converted Conv -> BN -> act
chains fed by a channels_last ``requires_grad`` input, by outputs of pooling and ``cat``,
with weights in either layout, run once in float32 and once under bf16 autocast. It is
compiled once (``fullgraph=True``) for the whole module (compiling is the slow part); each
test checks its own (strategy, dims, dtype) part against the same model run eagerly and
unconverted: outputs, parameter gradients, the input's gradient and running stats, and that
the compiled step ran the chains' custom ops (Note: [the chain ops' output strides]).
"""
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import convbn

STRATEGIES = ["auto", "recompute_bn", "recompute_conv"]
DIMS = [1, 2, 3]
DTYPES = ["fp32", "bf16"]


def _stack(dims: int, cin: int) -> nn.Sequential:
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
    bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]
    return nn.Sequential(conv(cin, 8, 3, padding=1), bn(8), nn.ReLU(),
                         conv(8, 8, 3, padding=1, bias=False), bn(8), nn.SiLU())


class _Part(nn.Module):
    """One strategy's layers: a 1d stack on a reduction of the input, a 2d one on ``cat`` of
    the channels_last input and its max pool, a 3d one on a channels_last_3d stack; the conv
    weights channels_last where ``cl_weights``."""

    def __init__(self, cl_weights: bool) -> None:
        super().__init__()
        self.s1, self.s2, self.s3 = _stack(1, 3), _stack(2, 6), _stack(3, 3)
        if cl_weights:
            self.s2.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor, bf16: bool):
        x2 = torch.cat([x, F.max_pool2d(x, 3, 1, 1)], 1)
        # CPU bf16 Conv3d backward in channels_last_3d gives wrong weight gradients in eager
        # PyTorch itself (torch 2.13): contiguous there
        fmt = torch.contiguous_format if bf16 else torch.channels_last_3d
        x3 = torch.stack([x, 2 * x], 2).contiguous(memory_format=fmt)
        return {1: self.s1(x.mean(3)), 2: self.s2(x2), 3: self.s3(x3)}


class _Model(nn.Module):
    def __init__(self, parts) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(parts)

    def forward(self, x: torch.Tensor):
        out = {}
        for s, part in self.parts.items():
            for d, y in part(x, False).items():
                out[(s, d, "fp32")] = y
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for s, part in self.parts.items():
                for d, y in part(x, True).items():
                    out[(s, d, "bf16")] = y
        return out


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def run():
    """Eager and compiled-converted models after one step from the same state."""
    torch.manual_seed(0)
    parts = {s: _Part(cl_weights=(s != "recompute_bn")) for s in STRATEGIES}
    eager = _Model(copy.deepcopy(parts))
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    # example inputs: ``auto`` plans now, not on the first (compiled) call
    fused = _Model({s: convbn.convert(copy.deepcopy(p), strategy=s, example_inputs=(x, False)) for s, p in parts.items()})
    plain = copy.deepcopy(fused)  # the converted model, not compiled
    reports = {s: fused.parts[s].convbn_report for s in STRATEGIES}
    compiled = torch.compile(fused, fullgraph=True)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    warn = _Warnings()
    root = logging.getLogger("torch")
    root.addHandler(warn)
    try:
        outs = {}
        xs.append(x.clone().requires_grad_())
        for name, model, xi in (("fused", compiled, xs[0]), ("eager", eager, xs[1]), ("plain", plain, xs[2])):
            outs[name] = _step(model, xi)
    finally:
        root.removeHandler(warn)
    state = {k: [t.grad.clone() if t.grad is not None else None for t in m.parameters()] + [b.clone() for b in m.buffers()]
             for k, m in (("fused", fused), ("eager", eager), ("plain", plain))}
    # a second compiled step, profiled: the chains' custom ops are what ran
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(compiled, x.clone().requires_grad_())
    calls = {e.key: e.count for e in prof.key_averages()}
    return dict(eager=eager, fused=fused, plain=plain, reports=reports, outs=outs, xs=xs, warnings=warn.messages, calls=calls, state=state)


def _step(model: nn.Module, x: torch.Tensor):
    out = model(x)
    g = torch.Generator().manual_seed(1)
    loss = sum((v.float() * torch.randn(v.shape, generator=g)).sum() for v in out.values())
    loss.backward()
    return {k: v.detach() for k, v in out.items()}


def _part_state(run, which: str, s: str, d: int):
    """The (gradients, buffers) of strategy ``s``'s ``d``-dims stacks after the first step."""
    model = run[which]
    grads = dict(zip([id(t) for t in model.parameters()], run["state"][which]))
    bufs = dict(zip([id(t) for t in model.buffers()], run["state"][which][len(grads):]))
    p = model.parts[s]
    mods = [{1: p.s1, 2: p.s2, 3: p.s3}[d]]
    return [grads[id(t)] for m in mods for t in m.parameters()], [bufs[id(t)] for m in mods for t in m.buffers()]


def test_compile_ran_the_chain_ops_without_warnings(run):
    for s, rep in run["reports"].items():
        assert len(rep.pairs) == 6 and not rep.skipped, (s, rep)  # 3 stacks of 2 layers per strategy
        modes = {l.mode for m in run["fused"].parts[s].modules() if isinstance(m, convbn.FusedChain) for l in m.layers}
        assert modes <= {s} if s != "auto" else modes <= {"recompute_bn", "recompute_conv"}, modes
    # 3 chains per strategy, 3 strategies, fp32 and bf16: each op once per chain call
    assert run["calls"].get("convbn::chain_fwd") == 18, run["calls"]
    assert run["calls"].get("convbn::chain_bwd") == 18
    assert not [m for m in run["warnings"] if "context_fn" in m or "convbn" in m], run["warnings"]
    # the input's gradient: channels_last like eager's, and equal to it (both paths reach it)
    xc, xe, xp = run["xs"]
    assert xc.grad.stride() == xe.grad.stride() == xp.grad.stride()
    assert_close(xc.grad, xp.grad, rtol=1e-2, atol=1e-2 * xp.grad.abs().max().item())
    # (fp32 and bf16 passes both add into it: eager's own bf16 error bounds the tolerance)
    assert_close(xc.grad, xe.grad, rtol=0.1, atol=0.1 * xe.grad.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compile_channels_last_matches_eager(run, strategy, dims, dtype):
    key = (strategy, dims, dtype)
    out, out_e, out_p = run["outs"]["fused"][key], run["outs"]["eager"][key], run["outs"]["plain"][key]
    assert out.dtype == out_e.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
    assert out.stride() == out_p.stride()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == "fp32" else dict(rtol=3e-2, atol=3e-2)
    assert_close(out.float(), out_e.float(), **tol)
    assert_close(out.float(), out_p.float(), **tol)
    grads, buffers = _part_state(run, "fused", strategy, dims)
    grads_e, buffers_e = _part_state(run, "eager", strategy, dims)
    grads_p, buffers_p = _part_state(run, "plain", strategy, dims)
    assert len(grads) == len(grads_e) > 0 and len(buffers) == len(buffers_e) > 0
    scale = max(g.abs().max().item() for g in grads_e)
    for g, ge, gp in zip(grads, grads_e, grads_p):
        # the fp32 and bf16 passes add into one gradient: against the uncompiled converted
        # model (the same chain code) closely; against eager within bf16's own error
        # (a conv bias before BN has a zero gradient up to rounding: atol on the part's scale)
        assert g is not None
        assert_close(g, gp, rtol=1e-2, atol=1e-2 * scale)
        assert_close(g, ge, rtol=0.2, atol=0.2 * scale)
    for b, be, bp in zip(buffers, buffers_e, buffers_p):
        assert_close(b.float(), bp.float(), rtol=1e-3, atol=1e-4)
        assert_close(b.float(), be.float(), rtol=1e-2, atol=1e-3)
