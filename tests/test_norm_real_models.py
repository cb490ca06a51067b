"""``convbn.convert`` on real MONAI networks normalised per sample: exact in float64, every
norm fused, the fused chains ran.

* ``BasicUNet`` (2-D): Conv -> InstanceNorm -> LeakyReLU blocks (nnU-Net's recipe), down and up
  paths with concatenated skips;
* ``SegResNet`` (2-D): pre-activation residual blocks GroupNorm -> ReLU -> Conv.

Each model is drawn in float64 with random norm weights and biases (an affine swapped or
dropped shows), deep-copied, one copy converted with ``example_inputs``; both take one
training step on the same input with the same upstream gradient. Outputs, every parameter
gradient and every buffer must agree to rounding, the ``state_dict`` keys must be the
model's own, every norm the eager step calls must be reported fused and no longer be called
as a module, and the output's autograd graph must hold the fused chain Function.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Set, Tuple

import pytest
import torch
from torch import Tensor, nn
from torch.nn.modules.instancenorm import _InstanceNorm

import convbn

monai_nets = pytest.importorskip("monai.networks.nets")

pytestmark = pytest.mark.slow

TIGHT = dict(rtol=1e-10, atol=1e-10)
NORMS = (nn.GroupNorm, _InstanceNorm, nn.LayerNorm)


def basic_unet() -> Tuple[nn.Module, Tuple[int, ...]]:
    return monai_nets.BasicUNet(spatial_dims=2, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4)), \
        (2, 1, 32, 32)


def segresnet() -> Tuple[nn.Module, Tuple[int, ...]]:
    return monai_nets.SegResNet(spatial_dims=2, in_channels=1, out_channels=2, init_filters=8,
                                blocks_down=(1, 2, 2), blocks_up=(1, 1)), (2, 1, 32, 32)


MODELS: Dict[str, Callable[[], Tuple[nn.Module, Tuple[int, ...]]]] = {
    "monai-BasicUNet-instance": basic_unet,
    "monai-SegResNet-group": segresnet,
}


def randomised(make: Callable[[], Tuple[nn.Module, Tuple[int, ...]]]) -> Tuple[nn.Module, Tensor]:
    """The model in float64 with every norm's affine drawn at random, and its input."""
    torch.manual_seed(0)
    model, shape = make()
    model = model.double().train()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, NORMS) and getattr(m, "weight", None) is not None:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model, torch.randn(shape, dtype=torch.float64)


def norms_called(model: nn.Module, run: Callable[[], Tensor]) -> Tuple[Set[str], Tensor]:
    """Names of the per-sample norm modules ``run`` calls, and its result."""
    called: Set[str] = set()
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, NORMS):
            def hook(mod: nn.Module, args: object, name: str = name) -> None:
                called.add(name)
            hook.convbn_observer = True  # type: ignore[attr-defined]  # an observer: a fused chain stays fused
            handles.append(m.register_forward_pre_hook(hook))
    try:
        return called, run()
    finally:
        for h in handles:
            h.remove()


def chain_function_nodes(out: Tensor) -> List[str]:
    """Names of the fused chain Functions' backward nodes in ``out``'s autograd graph."""
    found, seen, stack = [], {}, [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node  # kept alive: a freed node's id could be reused
        if type(node).__name__.endswith("ChainFunctionBackward"):
            found.append(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return found


def step(model: nn.Module, x: Tensor) -> Tensor:
    model.zero_grad(set_to_none=True)
    out = model(x)
    grad = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(5))
    out.backward(grad)
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_real_per_sample_norm_net_exact_and_fused(name: str) -> None:
    eager, x = randomised(MODELS[name])
    model = copy.deepcopy(eager)
    keys = list(model.state_dict())
    converted = convbn.convert(model, example_inputs=x)
    assert type(converted) is type(eager) and list(converted.state_dict()) == keys

    called_eager, out_eager = norms_called(eager, lambda: step(eager, x))
    called_conv, out = norms_called(converted, lambda: step(converted, x))
    assert called_eager, "the eager step called no per-sample norm: the model is not what this test is about"

    fused = {o.batchnorm for o in converted.convbn_report.outcomes if o.result == "fused"}
    assert called_eager <= fused, f"norms not reported fused: {sorted(called_eager - fused)}"
    assert not called_conv & called_eager, f"norms still called as modules: {sorted(called_conv & called_eager)}"
    assert chain_function_nodes(out), "no fused chain Function in the output's graph: the chains ran as eager modules"

    torch.testing.assert_close(out.detach(), out_eager.detach(), **TIGHT)
    for (pname, p), q in zip(eager.named_parameters(), converted.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TIGHT, msg=lambda m, pname=pname: f"grad {pname}: {m}")
    for (bname, b), c in zip(eager.named_buffers(), converted.buffers()):
        torch.testing.assert_close(c, b, **TIGHT, msg=lambda m, bname=bname: f"buffer {bname}: {m}")
