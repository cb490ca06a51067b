"""FSDP1 (``FullyShardedDataParallel``) wrapped around a model *after* ``convert``, 2 gloo processes.

Each rank trains an eager FSDP1 twin and the converted model wrapped the same way, on its own
batch, for three SGD steps: outputs, gradients (the flat or the original parameters') and
running statistics must match eager FSDP1. Wrapped at the root (either ``use_orig_params``)
or per block with ``use_orig_params=True``, the chains run (per block, the model is captured
again for what it is now, with one message). Per block with flat parameters
(``use_orig_params=False``), convbn cannot follow the flat parameter's views: the model's own
forward runs, unfused and exact, and one warning says so, naming FSDP2.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import convbn

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "FullyShardedDataParallel"):
    pytest.skip("this torch has no FSDP1", allow_module_level=True)

from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # noqa: E402

from convbn.bench.launch import launch_workers  # noqa: E402
from test_fsdp2 import Block, Net, _chain_calls  # noqa: E402

WORLD = 2
TIMEOUT = 900.0  # a hang guard only: a loaded 2-core machine runs these steps many times slower
TOL = dict(rtol=1e-9, atol=1e-12)
CONFIGS = [("root", False), ("root", True), ("per-block", True), ("per-block", False)]


def _wrap(model: nn.Module, where: str, orig: bool) -> nn.Module:
    policy = dict(auto_wrap_policy=ModuleWrapPolicy({Block})) if where == "per-block" else {}
    return fsdp.FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=orig, **policy)


def _train(model: nn.Module, xs: List[Tensor]) -> Dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs, grads, chains = [], [], []
    for x in xs:
        opt.zero_grad(set_to_none=True)
        y = model(x)
        y.square().mean().backward()
        outs.append(y.detach())
        chains.append(_chain_calls(y))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return dict(outs=outs, grads=grads, chains=chains, buffers={n: b.clone() for n, b in model.named_buffers()})


def _worker(rank: int, world: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    base = Net().double()
    xs = [torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rank + s))
          for s in range(3)]
    out = {}
    for where, orig in CONFIGS:
        eager = _train(_wrap(copy.deepcopy(base), where, orig), xs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fast = _train(_wrap(convbn.convert(copy.deepcopy(base)), where, orig), xs)
        messages = [f"{w.category.__name__}: {w.message}" for w in caught if "convbn" in str(w.message)]
        out[f"{where}-{orig}"] = dict(eager=eager, fast=fast, messages=messages)
    return out


@pytest.mark.expect_unfused("the chains run in the worker processes, checked there by counting their autograd nodes")
def test_fsdp1_after_convert_matches_eager_fsdp1() -> None:
    ranks = launch_workers(_worker, WORLD, timeout=TIMEOUT)
    for rank, r in enumerate(ranks):
        for where, orig in CONFIGS:
            case = r[f"{where}-{orig}"]
            e, f, what = case["eager"], case["fast"], f"rank {rank} {where} use_orig_params={orig}"
            for s, (ye, yf) in enumerate(zip(e["outs"], f["outs"])):
                torch.testing.assert_close(yf, ye, **TOL, msg=lambda m: f"{what} step {s} output: {m}")
            for s, (ge, gf) in enumerate(zip(e["grads"], f["grads"])):
                assert ge.keys() == gf.keys(), (what, s)
                for n in ge:
                    torch.testing.assert_close(gf[n], ge[n], **TOL, msg=lambda m: f"{what} step {s} grad {n}: {m}")
            assert e["buffers"].keys() == f["buffers"].keys()
            for n in e["buffers"]:
                torch.testing.assert_close(f["buffers"][n], e["buffers"][n], **TOL, msg=lambda m: f"{what} {n}: {m}")
            if (where, orig) == ("per-block", False):
                assert f["chains"] == [0, 0, 0], (what, f["chains"])
                assert len(case["messages"]) == 1, (what, case["messages"])
                message = case["messages"][0]
                assert message.startswith("RuntimeWarning") and "FSDP2" in message and "fully_shard" in message
                assert "unfused" in message, message
            else:
                assert min(f["chains"]) >= 3, (what, f["chains"], case["messages"])
                assert len(case["messages"]) == (where == "per-block"), (what, case["messages"])
