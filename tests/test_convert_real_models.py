"""``convbn.convert`` on real third-party networks: one SGD step equals eager PyTorch.

Each model is deep-copied; one copy is converted, then both take one training step
with SGD(momentum=0.9) from the same RNG state (the models use dropout and
drop-connect). Outputs, losses, every parameter gradient, the parameters after the
step, every buffer (running statistics, ``num_batches_tracked``) and a second forward
must match eager PyTorch in float32. The converted model must really be converted
(chains present, the fused BatchNorms gone from its graph), so a pass that fused
nothing cannot pass.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
from torch import Tensor, nn

import convbn
from convbn import FusedChain

monai_nets = pytest.importorskip("monai.networks.nets")
efficientnet_pytorch = pytest.importorskip("efficientnet_pytorch")

# (conversion kwargs) per strategy under test; "auto" plans from example inputs.
STRATEGIES: Dict[str, Dict[str, Any]] = {
    "auto": dict(strategy="auto"),
    "recompute_bn": dict(strategy="recompute_bn"),
    "recompute_conv": dict(strategy="recompute_conv"),
    "recompute_conv-nochain": dict(strategy="recompute_conv", chain=False),
}



def resnet50() -> Tuple[nn.Module, Tuple[int, ...]]:
    return monai_nets.resnet50(spatial_dims=2, n_input_channels=3, conv1_t_stride=2, num_classes=10), (2, 3, 64, 64)


def densenet121() -> Tuple[nn.Module, Tuple[int, ...]]:
    return monai_nets.DenseNet121(spatial_dims=2, in_channels=3, out_channels=10), (2, 3, 64, 64)


def unet3d() -> Tuple[nn.Module, Tuple[int, ...]]:
    net = monai_nets.UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(8, 16, 32, 64),
                          strides=(2, 2, 2), norm="batch")
    return net, (2, 1, 32, 32, 32)


def efficientnet_b0() -> Tuple[nn.Module, Tuple[int, ...]]:
    return efficientnet_pytorch.EfficientNet.from_name("efficientnet-b0", num_classes=10), (2, 3, 64, 64)


MODELS: Dict[str, Callable[[], Tuple[nn.Module, Tuple[int, ...]]]] = {
    "monai-resnet50": resnet50,
    "monai-densenet121": densenet121,
    "monai-unet3d": unet3d,
    "efficientnet-b0": efficientnet_b0,
}
SLOW = {"monai-resnet50", "monai-densenet121"}

# float32 tolerances: relative to each tensor's own scale (see ``close``).
RTOL = 2e-4
# Observed: bit-identical for the ReLU networks (same kernels); EfficientNet (SiLU recomputed
# by formula) ~1e-5 on outputs and up to 1.5e-4 of a gradient's scale.
GRAD_RTOL = 5e-4
LR = 0.1


def close(actual: Tensor, expected: Tensor, what: str, floor: float = 0.0, rtol: float = RTOL) -> None:
    """``assert_close`` with an absolute tolerance proportional to ``expected``'s scale.

    ``floor`` is a scale below which a tensor counts as zero (the gradient of a conv
    bias in front of a BatchNorm is mathematically zero and numerically ~1e-9).
    """
    scale = max(float(expected.detach().abs().max()) if expected.numel() else 0.0, floor)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


def train_step(model: nn.Module, x: Tensor, grad_seed: int) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """One SGD(momentum) step with a random upstream gradient; returns output, loss, grads."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model.train()
    torch.manual_seed(1234)
    out = model(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    loss = (out * weights).sum() / out.shape[0]
    opt.zero_grad()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    return out.detach(), loss.detach(), grads


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize(
    "model_name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in MODELS]
)
def test_one_training_step_matches_eager(model_name: str, strategy: str) -> None:
    torch.manual_seed(0)
    eager, shape = MODELS[model_name]()
    model = copy.deepcopy(eager)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    kwargs = dict(STRATEGIES[strategy])
    if strategy == "auto":
        kwargs["example_inputs"] = (x,)
    buffers_before = {n: b.clone() for n, b in model.named_buffers()}
    rng_before = torch.get_rng_state()

    fast = convbn.convert(model, **kwargs)

    # Conversion (and the planner's measuring passes) changed no state.
    for n, b in model.named_buffers():
        torch.testing.assert_close(b, buffers_before[n], rtol=0, atol=0, msg=lambda m: f"buffer {n}: {m}")
    assert torch.equal(torch.get_rng_state(), rng_before)
    # It really converted: chains exist and the fused BatchNorms are no longer called.
    report = fast.convbn_report
    assert report.pairs, report
    chains = [m for _, m in convbn.fused_modules(fast) if isinstance(m, FusedChain)]
    assert len(chains) == report.num_chains > 0
    if strategy == "recompute_conv-nochain":
        assert all(len(c.layers) == 1 for c in chains)
    called = {str(n.target) for n in fast.forward.graph.nodes if n.op == "call_module"}
    assert not called & {p.bn for p in report.pairs}
    modes = {p.strategy for p in report.pairs}
    if strategy in ("recompute_bn", "recompute_conv"):
        assert modes == {strategy}
    # The report accounts for every BatchNorm module exactly once.
    bns = [n for n, m in eager.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert sorted([p.bn for p in report.pairs if p.bn] + [s.bn for s in report.skipped]) == sorted(bns)  # ends: no BN

    out_e, loss_e, grads_e = train_step(eager, x, grad_seed=2)
    out_f, loss_f, grads_f = train_step(fast, x, grad_seed=2)

    close(out_f, out_e, "output")
    close(loss_f, loss_e, "loss")
    assert grads_f.keys() == grads_e.keys()
    floor = 1e-3 * max(float(g.abs().max()) for g in grads_e.values())
    for n in grads_e:
        close(grads_f[n], grads_e[n], f"grad {n}", floor=floor, rtol=GRAD_RTOL)
    # After one step p' = p - lr * g: parameters may differ by lr times the gradient tolerance.
    params_e = dict(eager.named_parameters())
    for n, p in fast.named_parameters():
        tol = 1e-6 * float(params_e[n].detach().abs().max()) + LR * GRAD_RTOL * max(float(grads_e[n].abs().max()), floor)
        torch.testing.assert_close(p.detach(), params_e[n].detach(), rtol=0, atol=tol, msg=lambda m: f"param {n}: {m}")
    buffers_e = dict(eager.named_buffers())
    assert [n for n, _ in fast.named_buffers()] == list(buffers_e)
    for n, b in fast.named_buffers():
        if b.dtype == torch.long:
            assert torch.equal(b, buffers_e[n]), n
        else:
            # floor: a running mean of a zero-mean conv output is ~1e-10 of noise; variances are O(1)
            close(b, buffers_e[n], f"buffer {n}", floor=1e-3, rtol=1e-4)

    # The next forward (new weights, new statistics) still agrees.
    torch.manual_seed(99)
    out2_e = eager(x)
    torch.manual_seed(99)
    out2_f = fast(x)
    close(out2_f.detach(), out2_e.detach(), "second output", rtol=1e-3)
    # And inference.
    eager.eval()
    fast.eval()
    with torch.no_grad():
        close(fast(x), eager(x), "eval output", rtol=1e-3)
