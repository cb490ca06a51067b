"""Chains under torch.compile as ops inductor fuses (the default; ``convbn.compile_chains("op")``
selects the custom op): the same values as eager, the same activations saved as the custom
op's, the op not called, and torch's advisory about a ``context_fn`` not logged for them.

Note: [a chain inductor can see into] in ``convbn/autograd/chain_compiled.py``.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from typing import Dict, Iterator, List, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import convbn
from convbn.autograd.chain_plan import ChainPlan
from convbn.autograd.chain_compiled import compile_chains_mode
from convbn.memory import saved_bytes
from fusion_checks import assert_fused
from torch_logs import torch_warnings

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _net() -> nn.Sequential:
    def block(i: int, o: int) -> List[nn.Module]:
        return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]

    torch.manual_seed(0)
    net = nn.Sequential(*block(3, 8), *block(8, 8), *block(8, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return net


def _op_calls(model: nn.Module, x: Tensor, prefix: str = "convbn::chain") -> Dict[str, int]:
    """convbn's chain ops (or others, by ``prefix``) called by one training step of ``model``
    (profiled). ``convbn::conv``, a compiled chain's convolution on the CPU (Note: [a conv
    inductor cannot re-layout]), is not a chain op."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith(prefix)}


@contextlib.contextmanager
def _chains(mode: str) -> Iterator[None]:
    with convbn.compile_chains(mode):
        torch._dynamo.reset()
        yield


def _saved_activation_shapes(model: nn.Module, x: Tensor) -> List[Tuple[int, ...]]:
    """Shapes of the batch-sized storages the (compiled) forward saves for backward."""
    return sorted(tuple(shape) for _, shape, _, _ in saved_bytes(model, x).shapes if len(shape) and shape[0] == x.shape[0])


def _converted(modes: List[str]) -> Tuple[nn.Module, nn.Module]:
    net = _net()
    fast = convbn.convert(copy.deepcopy(net), strategy="recompute_bn")
    chain = dict(convbn.fused_modules(fast))["convbn_chain0"]
    chain.apply_plan(ChainPlan.of_modes(modes))  # a plan with both kinds of layer
    return net, fast


def _assert_step_like_eager(eager: nn.Module, fast: nn.Module, compiled: nn.Module, x: Tensor) -> None:
    """One training step of ``compiled`` (``fast`` compiled) and of ``eager``: outputs, input
    and parameter gradients, running stats and ``num_batches_tracked`` within float32 rounding."""
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_e, out_c = eager(xe), compiled(xc)
    g = torch.randn_like(out_e)
    out_e.backward(g)
    out_c.backward(g)
    assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
    assert_close(xc.grad, xe.grad, rtol=1e-4, atol=1e-5)
    for (n, p), pe in zip(fast.named_parameters(), eager.parameters()):
        assert_close(p.grad, pe.grad, rtol=1e-4, atol=1e-4 * max(1.0, pe.grad.abs().max().item()), msg=n)
    for (n, b), be in zip(fast.named_buffers(), eager.buffers()):
        assert_close(b, be, rtol=1e-5, atol=1e-6, msg=n)


MODES = ["recompute_conv", "recompute_bn", "recompute_conv"]


def test_inductor_chains_match_eager_and_do_not_call_the_op():
    eager, fast = _converted(MODES)
    with _chains("inductor"):
        compiled = torch.compile(fast, fullgraph=True)
        for seed in (1, 2):  # the first traces (under this mode), the second runs the compiled graph
            x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
            _assert_step_like_eager(eager, fast, compiled, x)
        assert_fused(fast)
        assert _op_calls(compiled, torch.randn(4, 3, 8, 8)) == {}  # inductor's ops, not convbn::chain_fwd
        # on the CPU each convolution is convbn::conv (Note: [a conv inductor cannot re-layout]):
        # three in forward, the two recompute_conv layers' again in backward
        assert _op_calls(compiled, torch.randn(4, 3, 8, 8), "convbn::conv") == {"convbn::conv": 5}
    with _chains("op"):  # the contrast: the op is what runs in that mode (Dynamo puts it in the graph,
        # whatever the backend: aot_eager runs it without a second inductor compile)
        compiled_op = torch.compile(_converted(MODES)[1], fullgraph=True, backend="aot_eager")
        assert _op_calls(compiled_op, torch.randn(4, 3, 8, 8)) != {}


def test_inductor_chains_save_what_the_op_saves():
    x = torch.randn(4, 3, 8, 8)
    saved = {}
    for mode in ("op", "inductor"):
        with _chains(mode):
            saved[mode] = _saved_activation_shapes(torch.compile(_converted(MODES)[1], fullgraph=True), x)
    # the chain input and the one kept conv output (8 channels): nothing recomputable kept
    assert saved["inductor"] == saved["op"], saved
    assert (4, 8, 8, 8) in saved["op"]


def test_compile_chains_rejects_other_modes():
    before = compile_chains_mode()
    with pytest.raises(ValueError, match="'fused'"):
        convbn.compile_chains("fused")
    assert compile_chains_mode() == before  # unchanged


def test_inductor_chains_keep_float64():
    """The region's maths in the tensor's own precision (float32 at least): float64 through
    AOTAutograd without inductor equals eager to float64 rounding."""
    eager, fast = _converted(MODES)
    eager, fast = eager.double(), fast.double()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    with _chains("inductor"):
        compiled = torch.compile(fast, fullgraph=True, backend="aot_eager")
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_c = eager(xe), compiled(xc)
        out_e.square().sum().backward()
        out_c.square().sum().backward()
    assert out_c.dtype == torch.float64
    assert_close(out_c, out_e, rtol=1e-10, atol=1e-10)
    assert_close(xc.grad, xe.grad, rtol=1e-9, atol=1e-9)
    for p, pe in zip(fast.parameters(), eager.parameters()):
        assert_close(p.grad, pe.grad, rtol=1e-9, atol=1e-9)


def test_inductor_chains_take_prelu_and_a_dropout_that_drops_nothing():
    """MONAI's blocks: Conv -> BN -> Dropout(p=0) -> PReLU, fused and run as inductor's ops."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Dropout(0.0), nn.PReLU(8),
                        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Dropout(0.0), nn.PReLU())
    fast = convbn.convert(copy.deepcopy(net), strategy="recompute_conv")
    x = torch.randn(4, 3, 8, 8)
    with _chains("inductor"):
        compiled = torch.compile(fast, fullgraph=True)
        _assert_step_like_eager(net, fast, compiled, x)  # the PReLU slopes' gradients too
        assert _op_calls(compiled, x) == {}


def test_inductor_chains_take_transposed_convolutions():
    """A decoder's ConvTranspose -> BN -> ReLU: eager's values, inductor's ops, and the same
    activations saved as the custom op's (batch 2: no weight shares the batch dimension)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.ConvTranspose2d(8, 6, 3, stride=2, padding=1, output_padding=1), nn.BatchNorm2d(6), nn.ReLU())
    x = torch.randn(2, 3, 6, 6)
    saved = {}
    for mode in ("op", "inductor"):
        fast = convbn.convert(copy.deepcopy(net), strategy="recompute_bn")
        with _chains(mode):
            compiled = torch.compile(fast, fullgraph=True)
            saved[mode] = _saved_activation_shapes(compiled, x)
            if mode == "inductor":
                ref = copy.deepcopy(net)
                xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
                out_e, out_c = ref(xe), compiled(xc)
                out_e.square().sum().backward()
                out_c.square().sum().backward()
                assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
                assert_close(xc.grad, xe.grad, rtol=1e-4, atol=1e-4)
                assert _op_calls(compiled, x) == {}
    assert saved["inductor"] == saved["op"], saved


def test_compiled_by_default_as_inductor_chains_without_the_context_fn_advisory():
    assert compile_chains_mode() == "inductor"  # the default (CONVBN_COMPILE_CHAINS unset)
    torch._dynamo.reset()
    fast = _converted(MODES)[1]
    compiled = torch.compile(fast, fullgraph=True)
    with torch_warnings() as logged:
        compiled(torch.randn(4, 3, 8, 8)).sum().backward()
    assert not [m for m in logged if "context_fn" in m], logged
    assert _op_calls(compiled, torch.randn(4, 3, 8, 8)) == {}

    # a user's own context_fn under compile still gets torch's advisory
    def own(x: Tensor) -> Tensor:
        policy = functools.partial(create_selective_checkpoint_contexts, lambda *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
        return checkpoint(torch.sin, x, use_reentrant=False, context_fn=policy)

    user = torch.compile(own, fullgraph=True)
    with torch_warnings() as logged:
        user(torch.randn(3, requires_grad=True)).sum().backward()
    assert [m for m in logged if "context_fn" in m], logged


def test_every_converted_model_compiled_in_one_process_gets_compiled_graphs():
    """Note: [one Dynamo frame per rewritten forward]: six converted models compiled one
    after another each compile (one shared frame would reach Dynamo's recompile limit at the
    fifth and run the rest uncompiled); copies of one converted model share its graphs. Frames,
    guards and recompiles are Dynamo's, whatever the backend: ``aot_eager`` (forward and
    backward traced, no code generated) checks them without inductor's C++ compile of every graph."""
    from torch._dynamo.utils import counters

    def small() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())

    torch._dynamo.reset()
    x = torch.randn(2, 3, 6, 6)
    graphs = []
    for _ in range(6):
        model = torch.compile(convbn.convert(small()), backend="aot_eager")
        before = counters["stats"]["unique_graphs"]
        for _ in range(2):
            model(x).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"] - before)
    assert all(g >= 1 for g in graphs), graphs
    converted = convbn.convert(small())
    torch.compile(converted, backend="aot_eager")(x).sum().backward()
    before = counters["stats"]["unique_graphs"]
    for _ in range(6):
        torch.compile(copy.deepcopy(converted), backend="aot_eager")(x).sum().backward()
    assert counters["stats"]["unique_graphs"] - before <= 2
