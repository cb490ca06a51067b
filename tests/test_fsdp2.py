"""FSDP2 (``torch.distributed.fsdp.fully_shard``) and a converted model, 2 gloo processes.

Each rank trains an eager twin and a converted model, both sharded per block and at the
root, on its own batch: outputs, the sharded gradients (gathered) and the BatchNorms'
running statistics must match eager FSDP2, with the fused chains running. Both orders:
``convert`` then ``fully_shard`` (the class swap and FSDP's hooks make convert capture the
model again for what it is now), and ``fully_shard`` then ``convert()``, in place or with
default arguments (a copy of the modules, into which FSDP2 unshards as into the user's;
with or without ``example_inputs``). FSDP1 (``FullyShardedDataParallel``) given to
``convert`` is refused with a message naming FSDP2.

The four orders, then FSDP1's refusal, run one after another in one launch of the two ranks
(a module fixture): each rank's process and process group are started once, not once per
test (spawning a rank is most of a small step's cost); each order starts from its own copy of
the same base model and batches, and what each gave is checked by its own test.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import convbn

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (fully_shard)", allow_module_level=True)

from convbn.bench.launch import launch_workers  # noqa: E402

WORLD = 2
TIMEOUT = 900.0  # a hang guard only: a loaded 2-core machine runs these steps many times slower
TOL = dict(rtol=1e-9, atol=1e-10)


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.blocks = nn.Sequential(Block(4), Block(4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(F.relu(self.bn(self.conv(x)))).mean((2, 3)))


def shard(model: nn.Module) -> nn.Module:
    """``fully_shard`` per block and at the root, over a mesh of the model's device type (FSDP2's
    default mesh is CUDA's wherever CUDA is available, which a gloo run on CPU must not use)."""
    from torch.distributed.device_mesh import init_device_mesh

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    return model


def train(model: nn.Module, xs: List[Tensor]) -> Dict[str, Any]:
    outs, grads = [], []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in xs:
        opt.zero_grad(set_to_none=True)
        y = model(x)
        y.square().mean().backward()
        outs.append(y.detach())
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
    chains = _chain_calls(y)
    return dict(outs=outs, grads=grads, chains=chains,
                buffers={n: b.detach().clone() for n, b in model.named_buffers()})


def _chain_calls(y: Tensor) -> int:
    found, seen, stack = 0, {}, [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        found += type(node).__name__ == "ChainFunctionBackward"
        stack.extend(n for n, _ in node.next_functions)
    return found


ORDERS = ["convert-then-shard", "shard-then-convert-inplace", "shard-then-convert", "shard-then-convert-example"]


def _all_worker(rank: int, world: int) -> Dict[str, Any]:
    """Every order in turn on this rank, then FSDP1's refusal. An order that raises stops the
    launch (its peer may be waiting in a collective), naming the order: every test fails with it."""
    out: Dict[str, Any] = {}
    for order in ORDERS:
        try:
            out[order] = _fsdp2_worker(rank, world, order)
        except Exception as exc:
            raise RuntimeError(f"order {order!r} raised on rank {rank}") from exc
    out["fsdp1"] = _refusals_worker(rank, world)
    return out


@pytest.fixture(scope="module")
def ranks_results() -> List[Dict[str, Any]]:
    """Each rank's results of :func:`_all_worker`, from one launch for the whole module."""
    return launch_workers(_all_worker, WORLD, timeout=TIMEOUT)


def _fsdp2_worker(rank: int, world: int, order: str) -> Dict[str, Any]:
    torch.manual_seed(0)
    base = Net().double()
    xs = [torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rank + s))
          for s in range(3)]
    eager = train(shard(copy.deepcopy(base)), xs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if order == "convert-then-shard":
            model = shard(convbn.convert(copy.deepcopy(base)))
        elif order == "shard-then-convert-inplace":
            model = convbn.convert(shard(copy.deepcopy(base)), inplace=True)
        else:  # a copy of the sharded model's modules is converted (planned on a batch, or not)
            sharded = shard(copy.deepcopy(base))
            user = _module_state(sharded)
            model = convbn.convert(sharded, **({"example_inputs": xs[0]} if order.endswith("example") else {}))
        fast = train(model, xs)
    report = model.convbn_report
    out = dict(eager=eager, fast=fast, messages=[str(w.message) for w in caught], report=str(report),
               pairs=len(report.pairs))
    if order.startswith("shard-then-convert") and order != "shard-then-convert-inplace":
        out["copy"] = model is not sharded and not any(a is b for a, b in zip(model.modules(), sharded.modules()))
        out["user-untouched"] = _module_state(sharded) == user and "convbn_report" not in vars(sharded)
        out["same-parameters"] = [a is b for a, b in zip(model.parameters(), sharded.parameters())]
        # the copy answers FSDP2's own methods: reshard, unshard, gradient sync
        model.unshard()
        model.reshard()
        model.set_requires_gradient_sync(True)
    return out


def _module_state(model: nn.Module) -> List[Any]:
    """What the user's module objects are: their classes, forwards, submodules, hooks."""
    return [(name, type(m), "forward" in vars(m), tuple(m._modules), tuple(m._forward_pre_hooks),
             tuple(m._forward_hooks)) for name, m in model.named_modules()]


@pytest.mark.expect_unfused("the chains run in the worker processes, checked there by counting their autograd nodes")
@pytest.mark.parametrize("order", ORDERS)
def test_fsdp2_matches_eager_fsdp2_fused(order: str, ranks_results: List[Dict[str, Any]]) -> None:
    ranks = [by_key[order] for by_key in ranks_results]
    for rank, r in enumerate(ranks):
        e, f = r["eager"], r["fast"]
        for s, (ye, yf) in enumerate(zip(e["outs"], f["outs"])):
            torch.testing.assert_close(yf, ye, **TOL, msg=lambda m: f"rank {rank} step {s} output: {m}")
        for s, (ge, gf) in enumerate(zip(e["grads"], f["grads"])):
            assert ge.keys() == gf.keys()
            for n in ge:
                torch.testing.assert_close(gf[n], ge[n], **TOL, msg=lambda m: f"rank {rank} step {s} grad {n}: {m}")
        for n in e["buffers"]:
            torch.testing.assert_close(f["buffers"][n], e["buffers"][n], rtol=1e-9, atol=1e-10,
                                       msg=lambda m: f"rank {rank} buffer {n}: {m}")
        assert r["pairs"] == 5, r["report"]
        assert f["chains"] >= 3, (f["chains"], r["report"], r["messages"])  # stem and one per block at least
        if order in ("shard-then-convert", "shard-then-convert-example"):
            assert r["copy"] and r["user-untouched"], r
            assert r["same-parameters"] and all(r["same-parameters"]), r


def _refusals_worker(rank: int, world: int) -> Dict[str, str]:
    torch.manual_seed(0)
    out = {}
    fsdp1 = fsdp.FullyShardedDataParallel(Net().double(), device_id=torch.device("cpu"))
    before = {n: p.detach().clone() for n, p in fsdp1.named_parameters()}
    try:
        convbn.convert(fsdp1, inplace=True)
    except (TypeError, ValueError) as exc:
        out["fsdp1"] = f"{type(exc).__name__}: {exc}"
    out["fsdp1-untouched"] = str(all(torch.equal(p, before[n]) for n, p in fsdp1.named_parameters())
                                 and "forward" not in vars(fsdp1))
    return out


@pytest.mark.expect_unfused("nothing is converted: the call is refused")
def test_fsdp1_is_refused_clearly(ranks_results: List[Dict[str, Any]]) -> None:
    for r in (by_key["fsdp1"] for by_key in ranks_results):
        assert "FSDP2" in r.get("fsdp1", "") and "fully_shard" in r["fsdp1"], r
        assert r["fsdp1-untouched"] == "True", r
