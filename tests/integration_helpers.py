"""Shared by the training-loop integration tests: a small real-shaped network, its data, and the
checks that the fused path ran and that two runs ended in the same state."""
import copy
from typing import Dict, List, Set

import torch
from torch import Tensor, nn


def small_net() -> nn.Module:
    """Two Conv -> BatchNorm -> ReLU blocks, pooling and a linear head: two fusable pairs."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


def dataset(n: int = 24, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def grad_fn_names(out: Tensor) -> Set[str]:
    """The names of every autograd node behind ``out``."""
    seen: Set[str] = set()
    stack = [out.grad_fn]
    visited = {}  # the nodes themselves kept alive: a freed node's id can be reused (fusion_checks.chain_nodes)
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in visited:
            continue
        visited[id(fn)] = fn
        seen.add(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    return seen


def assert_fused_path_runs(converted: nn.Module, pairs: int, shape=(2, 3, 8, 8)) -> None:
    """The converted network reports ``pairs`` fused pairs and its training forward runs a chain Function."""
    report = converted.convbn_report
    assert len(report.pairs) == pairs, report
    probe = copy.deepcopy(converted).train()  # a copy: the probe's forward must not move running stats
    with torch.enable_grad():
        names = grad_fn_names(probe(torch.randn(*shape)))
    assert any("Chain" in n for n in names), names
    assert "NativeBatchNormBackward0" not in names and "CudnnBatchNormBackward0" not in names, names


def assert_same_state(a: Dict[str, Tensor], b: Dict[str, Tensor], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Same keys; running statistics and ``num_batches_tracked`` equal; weights within float tolerance."""
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        if k.endswith("num_batches_tracked"):
            assert torch.equal(a[k], b[k]), (k, a[k], b[k])
        else:
            torch.testing.assert_close(a[k].float(), b[k].float(), rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def assert_close_losses(a: List[float], b: List[float], rtol: float = 1e-5) -> None:
    assert len(a) == len(b) and len(a) > 0, (a, b)
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=rtol, atol=rtol)
