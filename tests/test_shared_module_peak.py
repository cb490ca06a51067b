"""A module called more than once in a step (one activation module shared by every layer),
converted without ``example_inputs``: the first call's peak measurement (``MemTracker``)
took the second call for a next iteration and raised; it measures and the model trains."""
from __future__ import annotations

import copy
import warnings

import torch
from torch import Tensor, nn
from torch.testing import assert_close

import convbn


class SharedAct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.b1 = nn.Linear(16, 32), nn.BatchNorm1d(32)
        self.l2, self.b2 = nn.Linear(32, 32), nn.BatchNorm1d(32)
        self.act = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.b2(self.l2(self.act(self.b1(self.l1(x))))))


def test_a_shared_activation_module_trains_after_convert_without_example_inputs() -> None:
    torch.manual_seed(0)
    eager = SharedAct().double()
    fast = convbn.convert(copy.deepcopy(eager))
    x = torch.randn(24, 16, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            out_f, out_e = fast(x), eager(x)
            out_f.sum().backward()
            out_e.sum().backward()
            assert_close(out_f, out_e, rtol=1e-10, atol=1e-10)
    for (n, p), pe in zip(fast.named_parameters(), eager.parameters()):
        assert_close(p.grad, pe.grad, rtol=1e-10, atol=1e-10, msg=n)
    for (n, b), be in zip(fast.named_buffers(), eager.buffers()):
        assert_close(b, be, rtol=1e-10, atol=1e-10, msg=n)
