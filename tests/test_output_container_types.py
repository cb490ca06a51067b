"""A rewritten module returns its outputs in its own container types.

torch.fx writes a graph's output as plain ``dict``s where the module returned a ``dict``
subclass (``OrderedDict``, Hugging Face's ``ModelOutput``): the first-call check then saw
another output structure and ran the module unfused for good. The rewrite now rebuilds the
module's own structure.
"""
import collections
import copy
import warnings

import torch
from torch import nn

import convbn
from fusion_checks import assert_chain_ran, assert_fused


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> "collections.OrderedDict[str, torch.Tensor]":
        y = torch.relu(self.bn(self.conv(x)))
        return collections.OrderedDict(features=y, pooled=y.mean((2, 3)))


def test_a_dict_subclass_output_keeps_its_type_and_runs_fused() -> None:
    torch.manual_seed(0)
    eager = DictOut().double()
    fast = convbn.convert(copy.deepcopy(eager))
    assert_fused(fast, pairs=1)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    for step in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no "differs from the original" fallback
            out = fast(x)
        ref = eager(x)
        assert type(out) is collections.OrderedDict and list(out) == ["features", "pooled"]
        assert_chain_ran(out["pooled"])
        torch.testing.assert_close(out["features"], ref["features"], rtol=1e-10, atol=1e-10)
        out["pooled"].sum().backward()
        ref["pooled"].sum().backward()
        for p, q in zip(fast.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10)
        for b, c in zip(fast.buffers(), eager.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-10, atol=1e-10)
