"""DDP and FSDP2 (``fully_shard``) with a converted GroupNorm / InstanceNorm net, 2 gloo processes.

Each rank trains an eager twin and a converted model, both wrapped the same way (DDP; or
``fully_shard`` per block and at the root), on its own batch for three SGD steps: outputs,
the (all-reduced or gathered) gradients and the InstanceNorm's running statistics must be
eager's, with the fused norm chains running (their autograd nodes counted in the worker).
Per-sample norms need no cross-rank statistics: the wrappers' own gradient reduction is all.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import convbn

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)
fsdp = pytest.importorskip("torch.distributed.fsdp")

from convbn.bench.launch import launch_workers  # noqa: E402

WORLD = 2
TIMEOUT = 900.0  # a hang guard only: a loaded 2-core machine runs these steps many times slower
TOL = dict(rtol=1e-9, atol=1e-10)


class Block(nn.Module):
    """Conv -> GroupNorm -> SiLU -> Conv -> InstanceNorm (running stats) -> LeakyReLU, plus the skip."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(2, c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.norm2 = nn.InstanceNorm2d(c, affine=True, track_running_stats=True)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.leaky_relu(self.norm2(self.conv2(F.silu(self.norm1(self.conv1(x))))), 0.01)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.blocks = nn.Sequential(Block(4), Block(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(F.relu(self.norm(self.conv(x)))).mean((2, 3)))


def _fully_shard(model: nn.Module) -> nn.Module:
    """``fully_shard`` per block and at the root, on a CPU mesh (as tests/test_fsdp2.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    return model


def _ddp(model: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(model)


def _norm_chain_nodes(y: Tensor) -> int:
    found, seen, stack = 0, set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found += type(node).__name__ == "NormChainFunctionBackward"
        stack.extend(n for n, _ in node.next_functions)
    return found


def _train(model: nn.Module, xs: List[Tensor]) -> Dict[str, Any]:
    outs, grads, nodes = [], [], 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in xs:
        opt.zero_grad(set_to_none=True)
        y = model(x)
        y.square().mean().backward()
        nodes = _norm_chain_nodes(y)
        outs.append(y.detach())
        grads.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                      for n, p in model.named_parameters()})
        opt.step()
    return dict(outs=outs, grads=grads, nodes=nodes, buffers={n: b.detach().clone() for n, b in model.named_buffers()})


def _worker(rank: int, world: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    base = Net().double()
    xs = [torch.randn(2, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rank + s))
          for s in range(3)]
    wraps: Dict[str, Callable[[nn.Module], nn.Module]] = {"ddp": _ddp}
    if hasattr(fsdp, "fully_shard"):
        wraps["fsdp2"] = _fully_shard
    out = {}
    for name, wrap in wraps.items():
        eager = _train(wrap(copy.deepcopy(base)), xs)
        converted = convbn.convert(copy.deepcopy(base))
        out[name] = dict(eager=eager, fast=_train(wrap(converted), xs),
                         report=str(converted.convbn_report), pairs=len(converted.convbn_report.pairs))
    return out


@pytest.mark.expect_unfused("the chains run in the worker processes, checked there by counting their autograd nodes")
def test_ddp_and_fsdp2_train_a_converted_norm_net_like_eager() -> None:
    ranks = launch_workers(_worker, WORLD, timeout=TIMEOUT)
    assert "ddp" in ranks[0]
    for rank, r in enumerate(ranks):
        for name, run in r.items():
            e, f = run["eager"], run["fast"]
            where = f"rank {rank} {name}"
            for s, (ye, yf) in enumerate(zip(e["outs"], f["outs"])):
                torch.testing.assert_close(yf, ye, **TOL, msg=lambda m: f"{where} step {s} output: {m}")
            for s, (ge, gf) in enumerate(zip(e["grads"], f["grads"])):
                assert ge.keys() == gf.keys(), (where, ge.keys(), gf.keys())
                for n in ge:
                    torch.testing.assert_close(gf[n], ge[n], **TOL, msg=lambda m: f"{where} step {s} grad {n}: {m}")
            for n in e["buffers"]:
                torch.testing.assert_close(f["buffers"][n], e["buffers"][n], **TOL,
                                           msg=lambda m: f"{where} buffer {n}: {m}")
            assert run["pairs"] == 5, run["report"]
            assert f["nodes"] >= 3 and e["nodes"] == 0, (where, f["nodes"], run["report"])  # stem, one per block
