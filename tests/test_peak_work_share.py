"""The default plan's price of a byte of step peak against the chains' convolution work (Note: [a byte
of peak against the chains' work] in convbn/passes/plan/peak_planner.py).

Where weight gradients make most of a step's peak, 8 % of the lowest peak (the default tolerance) is
much of its activations, and 16 MAC equivalents per byte (the fixed price) let the default keep a stem
convolution's output whose recompute is a few percent of the chains' work. The planner's inputs
recorded from MONAI's ResNet-18 (batch 8, 3x112x112), and a small net of the same shape converted
end to end, take the lowest peak now and did not under the fixed price alone.
"""
from __future__ import annotations

import functools
from typing import List, Tuple
from unittest import mock

import pytest
import torch
from torch import nn

import convbn
from convbn.memory import timeline
from convbn.nn import FusedChain
from convbn.passes.plan import auto_plan
from convbn.passes.plan.peak_model import ChainCost, step_peak
from convbn.passes.plan.peak_planner import (PEAK_BYTE_COST, PEAK_TOLERANCE, PEAK_WORK_SHARE, chain_options,
                                             lowest_peak, peak_byte_cost, plan_for_peak)
from fusion_checks import assert_chain_ran
from test_convert_peak import _Block  # the basic residual block (conv -> BN -> ReLU -> conv -> BN, + shortcut, ReLU)

#: ``convert(monai resnet18(spatial_dims=2, n_input_channels=3), example_inputs=randn(8, 3, 112, 112))``'s
#: planner inputs, chain by chain in forward order (prefix, y_bytes, x_bytes, macs (recompute cost),
#: acts, w_bytes, s_bytes): chain 0 is the stem conv -> BN -> ReLU (before the max pool), then the
#: basic blocks' chains and their downsampling convs.
RESNET18: List[Tuple] = [
    (46724008, (6422528,), (1204224,), (307041920,), ("output",), (38144,), (512,)),
    (51244968, (1605632, 1605632), (1605632, 1605632), (266901120, 266901120), ("output", "identity"),
     (147968, 147968), (512, 512)),
    (52555688, (1605632, 1605632), (1605632, 1605632), (266901120, 266901120), ("output", "identity"),
     (147968, 147968), (512, 512)),
    (53570472, (802816, 802816), (1605632, 802816), (144873088, 254056064), ("output", "identity"),
     (295936, 590848), (1024, 1024)),
    (52440488, (802816,), (1605632,), (42112640,), ("identity",), (34304,), (1024,)),
    (52062632, (802816, 802816), (802816, 802816), (254056064, 254056064), ("output", "identity"),
     (590848, 590848), (1024, 1024)),
    (49725864, (401408, 401408), (802816, 401408), (135239296, 247633536), ("output", "identity"),
     (1181696, 2361344), (2048, 2048)),
    (48793000, (401408,), (802816,), (32478848,), ("identity",), (134144,), (2048,)),
    (44473768, (401408, 401408), (401408, 401408), (247633536, 247633536), ("output", "identity"),
     (2361344, 2361344), (2048, 2048)),
    (30854568, (262144, 262144), (401408, 262144), (166303360, 316184192), ("output", "identity"),
     (4722688, 9441280), (4096, 4096)),
    (30053800, (262144,), (401408,), (32085632,), ("identity",), (530432,), (4096,)),
    (11437480, (262144, 262144), (262144, 262144), (316184192, 316184192), ("output", "identity"),
     (9441280, 9441280), (4096, 4096)),
]
RESNET18_FLOOR, RESNET18_EXTRA = 10614272, 20176896
RESNET18_GAPS = [46761640, 57963436, 54457256, 55767976, 54080424, 54047144, 53670312, 49729960, 49597864,
                 45280680, 30985640, 30582184, 11969960]


def _resnet18_costs() -> List[ChainCost]:
    return [ChainCost(y, x, m, a, prefix=p, w_bytes=w, s_bytes=s) for p, y, x, m, a, w, s in RESNET18]


def _recompute(costs, keeps) -> int:
    return sum(c.recompute(k) for c, k in zip(costs, keeps))


def test_recorded_resnet18_takes_its_lowest_peak() -> None:
    """The trade of BENCHMARKS.md's issue 24 rows, in bytes: the fixed price keeps the stem conv's
    output (6.4 MB) and peaks in layer 3's first chain at 70529448 bytes; a byte there is worth the
    chains' work over the lowest peak (66.5 per byte), which buys the lowest, 65992104 bytes in the
    stem's own backward, for 265 M MAC equivalents more."""
    costs = _resnet18_costs()
    low = lowest_peak(costs, [chain_options(c) for c in costs], RESNET18_FLOOR, RESNET18_EXTRA, RESNET18_GAPS)
    assert low == 65992104
    old = plan_for_peak(costs, RESNET18_FLOOR, RESNET18_EXTRA, gaps=RESNET18_GAPS, work_share=0)
    assert old[0] == [True]  # the stem conv's output kept
    assert step_peak(costs, old, RESNET18_FLOOR, gaps=RESNET18_GAPS) == (70529448, 6)
    assert 70529448 <= low * (1 + PEAK_TOLERANCE)  # inside the tolerance: the price decided

    new = plan_for_peak(costs, RESNET18_FLOOR, RESNET18_EXTRA, gaps=RESNET18_GAPS)
    assert new[0] == [False]  # the stem conv recomputed in backward
    assert step_peak(costs, new, RESNET18_FLOOR, gaps=RESNET18_GAPS) == (low, 0)
    extra = _recompute(costs, new) - _recompute(costs, old)
    assert extra == 264929280
    # the price: every layer's recompute cost once over the lowest peak, above the fixed one
    work = sum(sum(c.macs) for c in costs)
    assert work == 4381360640
    price = peak_byte_cost(costs, low)
    assert price == PEAK_WORK_SHARE * work / low and PEAK_BYTE_COST < extra / (70529448 - low) < price
    # the fixed price alone is the old rule: the same plan as work_share=0
    assert plan_for_peak(costs, RESNET18_FLOOR, RESNET18_EXTRA, gaps=RESNET18_GAPS, work_share=0,
                         byte_cost=price) == new


def test_peak_byte_cost_is_the_higher_price() -> None:
    c = ChainCost((4, 8), (1, 4), (1000, 3000), ("output", "output"))
    assert peak_byte_cost([c], 100) == 40.0  # 4000 of work over a lowest peak of 100 bytes
    assert peak_byte_cost([c], 100, work_share=0.5) == 20.0
    assert peak_byte_cost([c], 1000) == PEAK_BYTE_COST  # 4 per byte: the fixed price is higher
    assert peak_byte_cost([c], 100, byte_cost=50) == 50
    assert peak_byte_cost([c], 0) == PEAK_BYTE_COST  # no peak to price against
    with pytest.raises(ValueError, match="work_share must be >= 0, but got -1"):
        peak_byte_cost([c], 100, work_share=-1)
    with pytest.raises(ValueError, match="work_share must be >= 0, but got -0.5"):
        plan_for_peak([c], 0, 8, work_share=-0.5)


def _stem_net(width: int = 64, widths: Tuple[int, ...] = (64, 128, 256, 512)) -> nn.Sequential:
    """A stem conv (7x7, stride 2) -> BN -> ReLU -> max pool, then two basic blocks per width."""
    layers: List[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    cin = width
    for i, c in enumerate(widths):
        layers += [_Block(cin, c, 1 if i == 0 else 2), _Block(c, c, 1)]
        cin = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))


def _step(model: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    out = model(x)
    out.float().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
def test_a_stem_net_takes_its_lowest_peak_exactly() -> None:
    """End to end on a stem conv -> BN -> ReLU -> max pool -> basic blocks net: the default's
    predicted peak is the lowest any plan reaches and the step's measured peak to the byte, with the
    stem conv recomputed; with the fixed price alone the same conversion keeps its output and peaks
    higher. The converted step equals eager's (outputs, every gradient, running statistics)."""
    torch.manual_seed(0)
    base = _stem_net()
    x = torch.randn(8, 3, 112, 112)
    model = convbn.convert(_copy(base), example_inputs=(x,))
    stem = _stem_chain(model)
    assert stem.layers[0].mode == "recompute_conv"  # the stem conv recomputed in backward
    eager = _copy(base).train()
    (out_e, grads_e), (out_c, grads_c) = _step(eager, x), _step(model, x)
    torch.testing.assert_close(out_c, out_e)
    for ge, gc in zip(grads_e, grads_c):
        torch.testing.assert_close(gc, ge)
    for (name, be), bc in zip(eager.named_buffers(), model.buffers()):
        torch.testing.assert_close(bc, be, msg=name)
    assert_chain_ran(model(x))

    report = model.convbn_report
    with pytest.warns(UserWarning, match="below the lowest any plan reaches"):
        lowest = convbn.explain(_copy(base), x, peak_budget=1e-6).lowest_peak_bytes
    assert report.predicted_peak_bytes == lowest
    assert timeline(model, x, loss_fn=lambda o: o.mean(),
                    optimizer=torch.optim.SGD(model.parameters(), lr=0.0)).peak == lowest

    fixed = functools.partial(plan_for_peak, work_share=0)
    with mock.patch.object(auto_plan, "plan_for_peak", fixed):
        old = convbn.convert(_copy(base), example_inputs=(x,))
    assert _stem_chain(old).layers[0].mode == "recompute_bn"  # the stem conv's output kept
    assert old.convbn_report.predicted_peak_bytes > lowest


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _stem_chain(model: nn.Module) -> FusedChain:
    chains = [m for _, m in convbn.fused_modules(model) if isinstance(m, FusedChain)]
    stem = [c for c in chains if c.layers[0].conv_owner is model[0]]
    assert len(stem) == 1, [c.layers[0].names for c in chains]
    return stem[0]
