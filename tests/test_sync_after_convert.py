"""``nn.SyncBatchNorm.convert_sync_batchnorm`` run on a model *after* ``convert`` (a trainer's
sync flag): the BatchNorms must then reduce over the process group, fused, on 2 gloo processes.

Each rank holds half of a batch; the eager reference is the plain model on the whole batch in
one process (what synchronised BatchNorm computes). Outputs (each rank's half), gradients
summed over the ranks (of the sum of all outputs) and running statistics must match it.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import convbn

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)

from convbn.bench.launch import launch_workers  # noqa: E402

WORLD = 2
TOL = dict(rtol=1e-9, atol=1e-10)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def _worker(rank: int, world: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    base = Net().double()
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    eager = copy.deepcopy(base)
    ye = eager(x)
    ye.sum().backward()
    fast = convbn.convert(copy.deepcopy(base))
    fast = nn.SyncBatchNorm.convert_sync_batchnorm(fast)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        part = x[3 * rank:3 * rank + 3]
        y = fast(part)
        y.sum().backward()
    grads = {n: p.grad.clone() for n, p in fast.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
    chain = _chain_ran(y)
    return dict(y=y.detach(), ye=ye.detach()[3 * rank:3 * rank + 3], grads=grads,
                grads_e={n: p.grad for n, p in eager.named_parameters()},
                buffers={n: b for n, b in fast.named_buffers()}, buffers_e={n: b for n, b in eager.named_buffers()},
                messages=[str(w.message) for w in caught], report=str(fast.convbn_report), chain=chain)


def _chain_ran(y: Tensor) -> bool:
    seen, stack = {}, [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if type(node).__name__ == "ChainFunctionBackward":
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


@pytest.mark.expect_unfused("the chains run in the worker processes, checked there through their autograd nodes")
def test_sync_batchnorm_conversion_after_convert_synchronises_fused() -> None:
    for rank, r in enumerate(launch_workers(_worker, WORLD, timeout=900.0)):
        torch.testing.assert_close(r["y"], r["ye"], **TOL, msg=lambda m: f"rank {rank} output: {m}")
        for n, g in r["grads_e"].items():
            torch.testing.assert_close(r["grads"][n], g, **TOL, msg=lambda m: f"rank {rank} grad {n}: {m}")
        for n, b in r["buffers_e"].items():
            torch.testing.assert_close(r["buffers"][n], b, **TOL, msg=lambda m: f"rank {rank} buffer {n}: {m}")
        assert r["chain"], r["report"]
        assert any("SyncBatchNorm" in m and "re-captured" in m for m in r["messages"]), r["messages"]
