"""Cross-process BatchNorm: SyncBatchNorm models converted by convbn, under DistributedDataParallel.

Each distributed test launches two CPU processes on ``gloo`` (:func:`convbn.bench.launch.launch_workers`:
``spawn``, a free port, results handed back by file) and compares what the ranks computed with
a single process running the *plain eager* ``nn`` model (``nn.BatchNorm``, no sync) on the
concatenated batch. The split is uneven (3 + 5 samples) and each rank's loss is scaled by
``world_size / global_batch``, so DDP's gradient averaging gives the gradient of the mean loss
over the whole batch: this only matches when counts, means, variances and the backward's
sums are all global.

One launch serves every check (a launch costs seconds): a module fixture starts the two
ranks once for the DDP, standalone and MONAI sections, the workers return everything and the
assertions run in the parent, one test per strategy.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

import convbn
from convbn.nn.sync import SyncBatchNorm

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)

from convbn.bench.launch import launch_workers  # noqa: E402 - needs torch.distributed

WORLD = 2
SPLIT = (3, 5)  # samples per rank: uneven on purpose
GLOBAL = sum(SPLIT)
TIMEOUT = 900.0  # a hang guard only: a loaded 2-core machine runs these steps many times slower
F64 = dict(rtol=1e-10, atol=1e-12)

STRATEGIES: Dict[str, Dict[str, Any]] = {
    "auto": dict(strategy="auto"),
    "recompute_bn": dict(strategy="recompute_bn"),
    "recompute_conv": dict(strategy="recompute_conv"),
    "recompute_conv-nochain": dict(strategy="recompute_conv", chain=False),
}



class Net(nn.Module):
    """Conv-BN-act chains in 1-D, 2-D and 3-D, with BatchNorm options that change the maths.

    ``b2``: ``momentum=None`` (cumulative average); ``b3``: follows a pool, so it stays a
    standalone BatchNorm; ``b4``: ``affine=False``; ``b5``: ``track_running_stats=False``.
    Input ``(N, 2, 4, 4)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.b2 = nn.BatchNorm2d(4, momentum=None)
        self.pool = nn.MaxPool2d(2)
        self.b3 = nn.BatchNorm2d(4)
        self.c3 = nn.Conv3d(1, 3, 3, padding=1, bias=False)
        self.b4 = nn.BatchNorm3d(3, affine=False)
        self.c4 = nn.Conv1d(12, 5, 3, padding=1)
        self.b5 = nn.BatchNorm1d(5, track_running_stats=False)
        self.fc = nn.Linear(5 * 4, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.b1(self.c1(x)))
        x = F.silu(self.b2(self.c2(x)))
        x = self.b3(self.pool(x))  # (N, 4, 2, 2)
        x = F.relu(self.b4(self.c3(x.unsqueeze(1))))  # (N, 3, 4, 2, 2)
        x = x.flatten(1, 2).flatten(2)  # (N, 12, 4)
        x = F.hardswish(self.b5(self.c4(x)))
        return self.fc(x.flatten(1))


def _shard(t: Tensor, rank: int) -> Tensor:
    start = sum(SPLIT[:rank])
    return t[start:start + SPLIT[rank]]


def _named_state(model: nn.Module) -> Dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _grads(model: nn.Module) -> Dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _train_eager(model: nn.Module, batches: List[Tuple[Tensor, Tensor]], lr: float = 0.1) -> Dict[str, List[Any]]:
    """The reference: plain eager model, single process, the whole batch, mean loss."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rec: Dict[str, List[Any]] = {"out": [], "grads": [], "state": []}
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        out = model(x)
        F.cross_entropy(out, y, reduction="sum").div(x.shape[0]).backward()
        opt.step()
        rec["out"].append(out.detach().clone())
        rec["grads"].append(_grads(model))
        rec["state"].append(_named_state(model))
    return rec


# --------------------------------------------------------------------------- 1. DDP training == one process


def _ddp_strategies_worker(rank: int, world: int, state: Dict[str, Tensor],
                           batches: List[Tuple[Tensor, Tensor]]) -> Dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    results: Dict[str, Any] = {}
    for key, kwargs in STRATEGIES.items():
        base = Net().double()
        base.load_state_dict(state)
        synced = nn.SyncBatchNorm.convert_sync_batchnorm(base)
        converted = convbn.convert(synced, **kwargs)
        called = [type(converted.get_submodule(n.target)) for n in converted.forward.graph.nodes if n.op == "call_module"]
        ddp = DDP(converted)
        opt = torch.optim.SGD(synced.parameters(), lr=0.1)
        rec: Dict[str, Any] = {"out": [], "grads": [], "state": [], "called": called}
        for x, y in batches:
            x, y = _shard(x, rank), _shard(y, rank)
            opt.zero_grad(set_to_none=True)
            out = ddp(x)
            F.cross_entropy(out, y, reduction="sum").mul(world / GLOBAL).backward()
            opt.step()
            rec["out"].append(out.detach().clone())
            rec["grads"].append(_grads(synced))  # names of the user's model; same parameter objects
            rec["state"].append(_named_state(converted))
        results[key] = rec
    return results


def _ddp_inputs() -> Tuple[nn.Module, List[Tuple[Tensor, Tensor]]]:
    torch.manual_seed(0)
    net = Net().double()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(GLOBAL, 2, 4, 4, generator=gen, dtype=torch.float64),
                torch.randint(0, 3, (GLOBAL,), generator=gen)) for _ in range(2)]
    return net, batches


@pytest.fixture(scope="module")
def ddp_strategies(launched: Dict[str, Any]) -> Tuple[Dict[str, List[Any]], List[Dict[str, Any]]]:
    net, batches = launched["ddp_inputs"]
    return _train_eager(net, batches), [r["ddp"] for r in launched["ranks"]]


@pytest.mark.parametrize("key", list(STRATEGIES))
def test_ddp_two_steps_equal_single_process_on_concatenated_batch(key: str, ddp_strategies: Any) -> None:
    ref, ranks = ddp_strategies
    for rank, res in enumerate(ranks):
        rec = res[key]
        # really fused: FusedChains in the graph; the BN after the pool is a standalone convbn SyncBatchNorm
        assert convbn.FusedChain in rec["called"]
        assert rec["called"].count(SyncBatchNorm) == 1
        assert not any(issubclass(t, _BatchNorm) and t is not SyncBatchNorm for t in rec["called"])
        for step in range(2):
            where = f"rank {rank}, step {step + 1}"
            torch.testing.assert_close(rec["out"][step], _shard(ref["out"][step], rank), **F64, msg=f"output, {where}")
            assert rec["grads"][step].keys() == ref["grads"][step].keys()
            for name, g in ref["grads"][step].items():
                torch.testing.assert_close(rec["grads"][step][name], g, **F64, msg=f"grad of {name}, {where}")
            assert rec["state"][step].keys() == ref["state"][step].keys()
            for name, v in ref["state"][step].items():  # parameters after the step, running stats, counts
                torch.testing.assert_close(rec["state"][step][name], v, **F64, msg=f"{name} after {where}")
    assert int(ranks[0][key]["state"][1]["b2.num_batches_tracked"]) == 2


# --------------------------------------------------------------------------- 2. checkpoints and the user's model


def test_syncbn_model_conversion_keeps_state_dict_parameters_and_original() -> None:
    base = Net()
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base))
    children = dict(synced.named_modules())
    converted = convbn.convert(synced)

    assert list(converted.state_dict()) == list(synced.state_dict()) == list(base.state_dict())
    for name, p in synced.named_parameters():
        assert converted.get_parameter(name) is p, name
    for name, b in synced.named_buffers():
        assert converted.get_buffer(name) is b, name
    # the user's SyncBatchNorm model is untouched: same modules, still nn.SyncBatchNorm
    assert dict(synced.named_modules()) == children
    assert [n for n, m in synced.named_modules() if type(m) is nn.SyncBatchNorm] == ["b1", "b2", "b3", "b4", "b5"]
    assert not any(isinstance(m, SyncBatchNorm) for m in synced.modules())
    # converted: no nn.SyncBatchNorm left, convbn's shares the original's tensors
    assert not any(type(m) is nn.SyncBatchNorm for m in converted.modules())
    assert isinstance(converted.get_submodule("b3"), SyncBatchNorm)
    assert converted.get_submodule("b3").weight is synced.b3.weight
    # checkpoints load both ways
    converted.load_state_dict(base.state_dict())
    base.load_state_dict(converted.state_dict())


def test_syncbn_conversion_inplace_keeps_parameters() -> None:
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(Net())
    params = dict(synced.named_parameters())
    converted = convbn.convert(synced, inplace=True)
    assert {n: p for n, p in converted.named_parameters() if n in params} == params


# --------------------------------------------------------------------------- 3. no process group


@pytest.mark.parametrize("key", list(STRATEGIES))
def test_without_process_group_syncbn_model_is_plain_batchnorm(key: str) -> None:
    assert not (dist.is_available() and dist.is_initialized())
    torch.manual_seed(0)
    net = Net().double()
    converted = convbn.convert(nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(net)), **STRATEGIES[key])
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(6, 2, 4, 4, generator=gen, dtype=torch.float64),
                torch.randint(0, 3, (6,), generator=gen)) for _ in range(2)]
    ref, got = _train_eager(net, batches), _train_eager(converted, batches)
    for step in range(2):
        torch.testing.assert_close(got["out"][step], ref["out"][step], **F64)
        for name, g in ref["grads"][step].items():
            torch.testing.assert_close(got["grads"][step][name], g, **F64, msg=name)
        for name, v in ref["state"][step].items():
            torch.testing.assert_close(got["state"][step][name], v, **F64, msg=name)
    net.eval(), converted.eval()
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    torch.testing.assert_close(converted(x), net(x), **F64)


@pytest.mark.parametrize("key", ["auto", "recompute_conv-nochain"])
def test_without_process_group_double_backward_like_batchnorm(key: str) -> None:
    """A gradient penalty through a converted SyncBatchNorm model, single process, equals plain BatchNorm's."""
    torch.manual_seed(0)
    net = Net().double()
    converted = convbn.convert(nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(net)), **STRATEGIES[key])
    x = torch.randn(6, 2, 4, 4, dtype=torch.float64)
    grads = []
    for model in (net, converted):
        xi = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(model(xi).square().sum(), xi, create_graph=True)
        gx.square().sum().backward()
        grads.append(_grads(model))
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, **F64, msg=name)


@pytest.mark.parametrize("shape", [(6, 4), (6, 4, 5), (3, 4, 2, 3), (2, 4, 2, 2, 3)])
def test_standalone_sync_batchnorm_without_process_group(shape: Tuple[int, ...]) -> None:
    torch.manual_seed(0)
    ref = nn.BatchNorm1d(4, momentum=None).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5), ref.bias.uniform_(-0.5, 0.5)
    bn = SyncBatchNorm.from_module(copy.deepcopy(ref))
    x = torch.randn(*shape, dtype=torch.float64)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.randn(shape, dtype=torch.float64)
    for _ in range(2):
        yr, ys = F.batch_norm(xr, ref.running_mean, ref.running_var, ref.weight, ref.bias, True,
                              1 / float(ref.num_batches_tracked.add_(1)), ref.eps), bn(xs)
        torch.testing.assert_close(ys, yr, **F64)
    (yr * w).sum().backward(), (ys * w).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, **F64)
    torch.testing.assert_close(bn.weight.grad, ref.weight.grad, **F64)
    torch.testing.assert_close(bn.bias.grad, ref.bias.grad, **F64)
    torch.testing.assert_close(bn.running_mean, ref.running_mean, **F64)
    torch.testing.assert_close(bn.running_var, ref.running_var, **F64)
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 2


def test_sync_batchnorm_input_checks() -> None:
    bn = SyncBatchNorm(4)
    with pytest.raises(ValueError, match="expected at least 2D input"):
        bn(torch.randn(4))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(torch.randn(1, 4))
    assert int(bn.num_batches_tracked) == 0  # a failing call changes no state
    with pytest.raises(TypeError, match="BatchNorm"):
        SyncBatchNorm.from_module(nn.Conv2d(3, 4, 1))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- 4. standalone SyncBatchNorm, 2 processes


SHAPES = [(SPLIT[0], 4), (SPLIT[0], 4, 3, 2), (SPLIT[0], 4, 2, 2, 3)]


class _NoComm:
    """Replaces the collectives of ``torch.distributed`` by ones that raise (to prove eval mode does not talk)."""

    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")

    def __enter__(self) -> "_NoComm":
        self.saved = {n: getattr(dist, n) for n in self.names}
        for n in self.names:
            setattr(dist, n, self._fail)
        return self

    def __exit__(self, *exc: Any) -> None:
        for n, f in self.saved.items():
            setattr(dist, n, f)

    @staticmethod
    def _fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("eval-mode SyncBatchNorm called a collective")


def _standalone_worker(rank: int, world: int, xs: List[Tensor], ws: List[Tensor],
                       state: Dict[str, Tensor]) -> Dict[str, Any]:
    torch.set_num_threads(1)
    out: Dict[str, Any] = {"train": []}
    for x, w in zip(xs, ws):
        ref = nn.SyncBatchNorm(4, momentum=None).double()
        ref.load_state_dict(state)
        bn = SyncBatchNorm.from_module(ref)
        x = _shard(x, rank).clone().requires_grad_()
        rec: Dict[str, Any] = {"y": []}
        for _ in range(2):  # two forwards: momentum=None averages over num_batches_tracked
            rec["y"].append(bn(x))
        (rec["y"][1] * _shard(w, rank)).sum().backward()
        gw, gb = bn.weight.grad.clone(), bn.bias.grad.clone()
        dist.all_reduce(gw), dist.all_reduce(gb)  # each rank holds its share; DDP would average
        rec.update(y=[y.detach() for y in rec["y"]], gx=x.grad, gw=gw, gb=gb, state=_named_state(bn))
        bn.eval()
        with _NoComm():
            rec["eval"] = bn(x.detach())
        out["train"].append(rec)

    # errors under an initialised group (every rank raises alike, so no rank waits in a collective)
    bn = SyncBatchNorm(4).double()
    try:
        bn(torch.randn(4, dtype=torch.float64))
    except ValueError as exc:
        out["1d"] = str(exc)
    x = torch.randn(SPLIT[rank], 4, 3, 3, dtype=torch.float64, requires_grad=True)
    try:
        (gx,) = torch.autograd.grad(bn(x).pow(3).sum(), x, create_graph=True)
        gx.square().sum().backward()
    except RuntimeError as exc:
        out["double_standalone"] = str(exc)
    fused = convbn.FusedConvBN2d.from_modules(nn.Conv2d(4, 4, 3, padding=1).double(), SyncBatchNorm(4).double(),
                                              "silu")
    try:
        (gx,) = torch.autograd.grad(fused(x).pow(3).sum(), x, create_graph=True)
        gx.square().sum().backward()
    except RuntimeError as exc:
        out["double_fused"] = str(exc)

    # one sample per rank and a 1x1 conv output: one value per channel here, two in the group
    # (legal with nn.SyncBatchNorm; every rank behaves alike, so a local error cannot hang)
    for key, model in _one_sample_models().items():
        x = _one_sample_input()[rank:rank + 1].clone().requires_grad_()
        try:
            y = convbn.convert(nn.SyncBatchNorm.convert_sync_batchnorm(model))(x)
            (y * (rank + 1)).sum().backward()
            out[key] = (y.detach(), x.grad)
        except (ValueError, RuntimeError) as exc:
            out[key] = str(exc)

    # planning from example inputs runs measuring forwards inside the group (every rank alike)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(Net().double())
    x = torch.randn(SPLIT[rank], 2, 4, 4, dtype=torch.float64)
    try:
        convbn.convert(net, strategy="auto", example_inputs=x)(x).sum().backward()
        out["example_inputs"] = "ok"
    except (ValueError, RuntimeError) as exc:
        out["example_inputs"] = f"{type(exc).__name__}: {exc}"
    return out


def _one_sample_models() -> Dict[str, nn.Module]:
    torch.manual_seed(5)
    fused = nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).double()
    standalone = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(36)).double()  # BN after a reshape: not fused
    return {"one_sample_fused": fused, "one_sample_standalone": standalone}


def _one_sample_input() -> Tensor:
    return torch.randn(WORLD, 4, 3, 3, generator=torch.Generator().manual_seed(6), dtype=torch.float64)


def _standalone_inputs() -> Tuple[List[Tensor], List[Tensor], Dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(GLOBAL, *s[1:], generator=gen, dtype=torch.float64) * 2 + 1 for s in SHAPES]
    ws = [torch.randn(GLOBAL, *s[1:], generator=gen, dtype=torch.float64) for s in SHAPES]
    ref = nn.BatchNorm1d(4, momentum=None).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5, generator=gen), ref.bias.uniform_(-0.5, 0.5, generator=gen)
    return xs, ws, _named_state(ref)


@pytest.fixture(scope="module")
def standalone(launched: Dict[str, Any]) -> Tuple[List[Tensor], List[Tensor], Dict[str, Tensor], List[Dict[str, Any]]]:
    return (*launched["standalone_inputs"], [r["standalone"] for r in launched["ranks"]])


@pytest.mark.parametrize("i", range(len(SHAPES)), ids=[f"{len(s)}d" for s in SHAPES])
def test_standalone_sync_batchnorm_equals_batchnorm_on_concatenated_batch(i: int, standalone: Any) -> None:
    xs, ws, state, ranks = standalone
    ref = nn.BatchNorm1d(4, momentum=None).double()
    ref.load_state_dict(state)
    x = xs[i].clone().requires_grad_()
    ys = []
    for _ in range(2):
        ref.num_batches_tracked.add_(1)
        ys.append(F.batch_norm(x, ref.running_mean, ref.running_var, ref.weight, ref.bias, True,
                               1 / float(ref.num_batches_tracked), ref.eps))
    (ys[1] * ws[i]).sum().backward()
    y_eval = F.batch_norm(xs[i], ref.running_mean, ref.running_var, ref.weight, ref.bias, False)
    for rank, res in enumerate(ranks):
        rec = res["train"][i]
        for step in range(2):
            torch.testing.assert_close(rec["y"][step], _shard(ys[step], rank).detach(), **F64)
        torch.testing.assert_close(rec["gx"], _shard(x.grad, rank), **F64)
        torch.testing.assert_close(rec["gw"], ref.weight.grad, **F64)
        torch.testing.assert_close(rec["gb"], ref.bias.grad, **F64)
        for name, v in ref.state_dict().items():
            torch.testing.assert_close(rec["state"][name], v, **F64, msg=name)
        # eval: running statistics, no collective (the worker made collectives raise)
        torch.testing.assert_close(rec["eval"], _shard(y_eval, rank).detach(), **F64)


def test_sync_batchnorm_errors_under_process_group(standalone: Any) -> None:
    for res in standalone[3]:
        assert "expected at least 2D input (got 1D input)" in res["1d"]
        assert "double_standalone" in res, "double backward through standalone synced statistics did not raise"
        assert "double_fused" in res, "double backward through fused synced statistics did not raise"
        msg = res["double_fused"]
        assert "double backward" in msg and "SyncBatchNorm" in msg and "single process" in msg


def test_standalone_sync_batchnorm_double_backward_message_names_the_cause(standalone: Any) -> None:
    for res in standalone[3]:
        msg = res["double_standalone"]
        assert "SyncBatchNorm" in msg and "double backward" in msg, msg


# --------------------------------------------------------------------------- 5. a real network: MONAI


def _monai_net() -> nn.Module:
    from monai.networks.nets import resnet10

    return resnet10(spatial_dims=2, n_input_channels=1, num_classes=3)


def _monai_worker(rank: int, world: int, state: Dict[str, Tensor], x: Tensor, y: Tensor) -> Dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    net = _monai_net()
    net.load_state_dict(state)
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    converted = convbn.convert(synced)
    n_chains = sum(isinstance(m, convbn.FusedChain) for _, m in convbn.fused_modules(converted))
    ddp = DDP(converted)
    out = ddp(_shard(x, rank))
    F.cross_entropy(out, _shard(y, rank), reduction="sum").mul(world / GLOBAL).backward()
    return {"out": out.detach(), "grads": _grads(synced), "state": _named_state(converted), "chains": n_chains}


def _monai_inputs() -> Optional[Tuple[nn.Module, Tensor, Tensor]]:
    """MONAI's ResNet-10 and a batch, or None where MONAI is not installed."""
    try:
        with warnings.catch_warnings():  # its torch.jit deprecations, as pytest.importorskip hides them
            warnings.simplefilter("ignore", DeprecationWarning)
            import monai.networks.nets  # noqa: F401
    except ImportError:
        return None
    torch.manual_seed(0)
    net = _monai_net()
    gen = torch.Generator().manual_seed(4)
    return net, torch.randn(GLOBAL, 1, 32, 32, generator=gen), torch.randint(0, 3, (GLOBAL,), generator=gen)


# --------------------------------------------------------------------------- one launch for the module


def _all_worker(rank: int, world: int, ddp: Tuple[Any, ...], standalone: Tuple[Any, ...],
                monai: Optional[Tuple[Any, ...]]) -> Dict[str, Any]:
    """What the DDP, standalone and MONAI tests need of the ranks, in one launch (MONAI's only
    where it is installed): every check of those sections reads this one result."""
    out = {"ddp": _ddp_strategies_worker(rank, world, *ddp),
           "standalone": _standalone_worker(rank, world, *standalone)}
    if monai is not None:
        out["monai"] = _monai_worker(rank, world, *monai)
    return out


@pytest.fixture(scope="module")
def launched() -> Dict[str, Any]:
    """One launch of the two ranks for the whole module (spawning them costs more than most of
    the checks): the inputs each section built, and every rank's results."""
    (net, batches), standalone, monai = _ddp_inputs(), _standalone_inputs(), _monai_inputs()
    monai_args = None if monai is None else (_named_state(monai[0]), *monai[1:])
    ranks = launch_workers(_all_worker, WORLD, (_named_state(net), batches), standalone, monai_args, timeout=TIMEOUT)
    return dict(ddp_inputs=(net, batches), standalone_inputs=standalone, monai_inputs=monai, ranks=ranks)


def test_monai_resnet_one_ddp_step_equals_single_process(launched: Dict[str, Any]) -> None:
    pytest.importorskip("monai.networks.nets")
    net, x, y = launched["monai_inputs"]
    ranks = [r["monai"] for r in launched["ranks"]]
    out = net(x)
    F.cross_entropy(out, y, reduction="sum").div(GLOBAL).backward()
    grads, ref_state = _grads(net), _named_state(net)
    for rank, res in enumerate(ranks):
        assert res["chains"] > 0
        torch.testing.assert_close(res["out"], _shard(out, rank).detach(), rtol=1e-4, atol=1e-5)
        assert res["grads"].keys() == grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(res["grads"][name], g, rtol=1e-3, atol=1e-5, msg=name)
        for name, v in ref_state.items():
            torch.testing.assert_close(res["state"][name], v, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("key", [
    "one_sample_fused",
    "one_sample_standalone",
])
def test_one_value_per_channel_per_rank_is_fine_when_synchronised(key: str, standalone: Any) -> None:
    model = _one_sample_models()[key]
    x = _one_sample_input().requires_grad_()
    y = model(x)
    (y * torch.arange(1, WORLD + 1, dtype=y.dtype).reshape(-1, *[1] * (y.dim() - 1))).sum().backward()
    for rank, res in enumerate(standalone[3]):
        assert not isinstance(res[key], str), res[key]
        torch.testing.assert_close(res[key][0], y[rank:rank + 1].detach(), **F64)
        torch.testing.assert_close(res[key][1], x.grad[rank:rank + 1], **F64)


def test_convert_with_example_inputs_inside_process_group(standalone: Any) -> None:
    for res in standalone[3]:
        assert res["example_inputs"] == "ok", res["example_inputs"]
