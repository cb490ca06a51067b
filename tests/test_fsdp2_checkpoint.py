"""``torch.distributed.checkpoint`` and a converted FSDP2 model, 2 gloo processes.

A model converted before or after ``fully_shard`` (default arguments) saves with
``dcp.save(get_model_state_dict(model))`` (or ``dcp.save(model.state_dict())``) a
checkpoint that a fresh eager FSDP2 model loads, and loads one an eager FSDP2 model saved:
the parameters and buffers (gathered) must equal the saved model's bit for bit, and the
loaded converted model must then compute as the eager one, with its chains running.

Both orders run one after another in one launch of the two ranks (a module fixture; each
order in a folder of its own): the ranks' processes and process group are started once, not
once per order.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import convbn

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)
fsdp = pytest.importorskip("torch.distributed.fsdp")
dcp = pytest.importorskip("torch.distributed.checkpoint")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (fully_shard)", allow_module_level=True)

from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict  # noqa: E402

from convbn.bench.launch import launch_workers  # noqa: E402
from test_fsdp2 import Net, _chain_calls, shard  # noqa: E402

WORLD = 2
TIMEOUT = 900.0  # a hang guard only: a loaded 2-core machine runs these steps many times slower


def _converted(base: torch.nn.Module, order: str) -> torch.nn.Module:
    if order == "convert-then-shard":
        return shard(convbn.convert(copy.deepcopy(base)))
    return convbn.convert(shard(copy.deepcopy(base)))


def _full(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model``, gathered, by its name in the state dict."""
    out = {}
    for k, v in get_model_state_dict(model).items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def _step(model: torch.nn.Module, x: torch.Tensor) -> Dict[str, Any]:
    """One forward and backward; the output and whether a chain ran."""
    y = model(x)
    y.square().mean().backward()
    return dict(out=y.detach(), chains=_chain_calls(y))


def _worker(rank: int, world: int, order: str, root: str) -> Dict[str, Any]:
    torch.manual_seed(0)
    base = Net().double()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7 + rank))
    # the same batch on every rank for the step before saving: the BatchNorms' running
    # statistics (replicated, not sharded) are then the same on every rank, as a checkpoint
    # of replicated tensors assumes (it keeps one rank's copy)
    x0 = torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out: Dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # converted -> eager: train the converted model a step so its state differs from init
        fast = _converted(base, order)
        _step(fast, x0)
        torch.optim.SGD(fast.parameters(), lr=0.5).step()
        saved = _full(fast)
        dcp.save(get_model_state_dict(fast), checkpoint_id=f"{root}/from-converted")
        torch.manual_seed(1)
        eager = shard(Net().double())
        state = get_model_state_dict(eager)
        dcp.load(state, checkpoint_id=f"{root}/from-converted")
        set_model_state_dict(eager, state)
        out["to-eager"] = (saved, _full(eager))
        # the module's own state_dict() / load_state_dict() with the same checkpoint format
        dcp.save(fast.state_dict(), checkpoint_id=f"{root}/plain")
        torch.manual_seed(3)
        plain = shard(Net().double())
        state = plain.state_dict()
        dcp.load(state, checkpoint_id=f"{root}/plain")
        plain.load_state_dict(state)
        out["to-eager-plain"] = (saved, _full(plain))
        # eager -> converted: a fresh converted model loads what eager FSDP2 saved
        dcp.save(get_model_state_dict(eager), checkpoint_id=f"{root}/from-eager")
        torch.manual_seed(2)
        fresh = _converted(Net().double(), order)
        state = get_model_state_dict(fresh)
        dcp.load(state, checkpoint_id=f"{root}/from-eager")
        set_model_state_dict(fresh, state)
        out["to-converted"] = (_full(eager), _full(fresh))
        out["eager-step"] = _step(eager, x)
        out["fast-step"] = _step(fresh, x)
    return out


ORDERS = ["convert-then-shard", "shard-then-convert"]


def _orders_worker(rank: int, world: int, root: str) -> Dict[str, Any]:
    """Every order in turn on this rank, each checkpointing under ``root/<order>``. An order that
    raises stops the launch (its peer may be waiting in a collective), naming the order."""
    out: Dict[str, Any] = {}
    for order in ORDERS:
        try:
            out[order] = _worker(rank, world, order, f"{root}/{order}")
        except Exception as exc:
            raise RuntimeError(f"order {order!r} raised on rank {rank}") from exc
    return out


@pytest.fixture(scope="module")
def ranks_results(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    """Each rank's results of :func:`_orders_worker`, from one launch for the whole module."""
    return launch_workers(_orders_worker, WORLD, str(tmp_path_factory.mktemp("dcp")), timeout=TIMEOUT)


@pytest.mark.expect_unfused("the chains run in the worker processes, checked there by counting their autograd nodes")
@pytest.mark.parametrize("order", ORDERS)
def test_dcp_round_trip_between_converted_and_eager_fsdp2(order: str, ranks_results: List[Dict[str, Any]]) -> None:
    ranks = [by_order[order] for by_order in ranks_results]
    for rank, r in enumerate(ranks):
        for way in ("to-eager", "to-eager-plain", "to-converted"):
            want, got = r[way]
            assert want.keys() == got.keys(), (way, sorted(want), sorted(got))
            for k in want:
                assert torch.equal(got[k], want[k]), f"rank {rank} {way} {k}: {(got[k] - want[k]).abs().max()}"
        torch.testing.assert_close(r["fast-step"]["out"], r["eager-step"]["out"], rtol=1e-9, atol=1e-10)
        assert r["fast-step"]["chains"] >= 3, r["fast-step"]
