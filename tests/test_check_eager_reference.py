"""The eager side of convert's check taken in two runs within a training step's peak (Note: [the
eager reference within a training step's peak]): the same outputs, gradients, buffers and RNG
states as one eager step under a snapshot, bit for bit; the model's state as it was; the
snapshots' copies lent only where no write can reach them; a rewrite whose statistics differ
still caught."""
from __future__ import annotations

import copy
from typing import Any, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convbn
from convbn._compat import pytree
from convbn.passes.check.buffer_copies import copies_lent
from convbn.passes.check.eager_reference import Bound, eager_reference
from convbn.passes.check.quiet_norms import statistics_unwritten
from convbn.passes.check.step import check_step
from convbn.passes.check.validate import StateSnapshot, run_step
from convbn.passes.graph.graph_module import installed
from fusion_checks import assert_fused


class _ParentWritesStats(nn.Module):
    """A parent whose own code runs its BatchNorm's statistics through ``F.batch_norm`` (not
    quietened by the BatchNorm's flag), beside an InstanceNorm with running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.inorm = nn.InstanceNorm2d(6, affine=True, track_running_stats=True)
        self.head = nn.Sequential(nn.Conv2d(6, 4, 3), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        z = F.batch_norm(y, self.bn.running_mean, self.bn.running_var, self.bn.weight, self.bn.bias, True, 0.3)
        return self.head(self.inorm(z + self.bn(y)))


def _nets() -> List[Tuple[str, nn.Module]]:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4), nn.BatchNorm1d(4))
    frozen = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8).eval(), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4))
    two_outputs = nn.ModuleDict({"a": nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))})
    return [("plain", plain), ("frozen", frozen), ("parent", _ParentWritesStats()), ("two", two_outputs)]


class _TwoOutputs(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> Any:
        y = self.inner(x)
        return {"y": y, "z": (y * 2).flatten(1)}


def _model(name: str) -> nn.Module:
    net = dict(_nets())[name]
    return _TwoOutputs(net["a"]) if name == "two" else net


def _one_step(model: nn.Module, x: torch.Tensor) -> Tuple[Any, ...]:
    """The reference as it was taken before: one eager step under a snapshot."""
    rng: List[torch.Tensor] = []
    params = list(model.parameters())
    with StateSnapshot(model):
        out, grads = run_step(Bound(model, {}), (x,), params, seed=0, rng=rng)
        buffers = [b.detach().clone() for b in model.buffers()]
    return out, grads, buffers, rng


def _state(model: nn.Module) -> List[Any]:
    return [b.clone() for b in model.buffers()] + [(type(m).__name__, m.__dict__.get("track_running_stats"))
                                                    for m in model.modules()]


def _equal(a: Any, b: Any) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(p, q) if isinstance(p, torch.Tensor) else p == q for p, q in zip(la, lb))


@pytest.mark.parametrize("name", ["plain", "frozen", "parent", "two"])
def test_the_reference_is_one_eager_step_bit_for_bit_and_the_state_is_as_it_was(name: str) -> None:
    model = _model(name)
    x = torch.randn(4, 3, 8, 8)
    before = _state(model)
    with StateSnapshot(model):  # convert's own snapshot around its check (copies lent from it too)
        expected = _one_step(model, x)
        got = eager_reference(model, (x,), {})
    for i, what in enumerate(("outputs", "gradients", "buffers", "RNG states")):
        assert _equal(got[i], expected[i]), what
    assert len(got[1]) == len(list(model.parameters())) + 1  # the input's gradient too
    assert _equal(_state(model), before)
    if name in ("plain", "parent"):  # statistics that move, a dropout that draws
        assert not _equal(got[2], [b for b in model.buffers()])
    if name == "plain":
        assert got[3], "the dropout's draws"


def test_the_quietened_norms_leave_their_statistics_and_compute_the_same() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.BatchNorm2d(8).eval())
    x = torch.randn(4, 3, 8, 8)
    twin = copy.deepcopy(model)
    ref = twin(x)
    before = [b.clone() for b in model.buffers()]
    with statistics_unwritten(model) as quiet:
        assert len(quiet.buffers) == 6  # the two training-mode BatchNorms' three buffers (not the eval one's)
        out = model(x)
        assert quiet.flag.reads >= 2  # each quietened forward read its flag
    assert torch.equal(out, ref)  # the same kernel on the same batch statistics
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    assert not all(torch.equal(a, b) for a, b in zip(before, twin.buffers()))
    assert all(m.track_running_stats for m in model.modules() if isinstance(m, nn.BatchNorm2d))


def test_a_copy_is_lent_only_while_its_buffer_has_its_bits_and_a_write_in_the_block_is_refused() -> None:
    bn = nn.BatchNorm2d(3)
    with StateSnapshot(bn) as snap:
        held = len(snap.buffers)
        with copies_lent([bn.running_mean]):
            assert len(snap.buffers) == held - 1  # no copy of it alive in the block
        assert len(snap.buffers) == held
        bn.running_var.add_(1.0)  # changed since the snapshot: its copy holds the old bits, not lent
        with copies_lent([bn.running_var]):
            assert len(snap.buffers) == held
        with pytest.raises(RuntimeError, match="were written"):
            with copies_lent([bn.running_mean]):
                bn.running_mean.add_(1.0)
    assert torch.equal(bn.running_var, torch.ones(3))  # the snapshot put back what it held
    assert torch.equal(bn.running_mean, torch.ones(3))  # a lent copy is gone: what the write left


def test_convert_leaves_the_state_where_a_parent_writes_its_batchnorms_statistics() -> None:
    model = _model("parent")
    x = torch.randn(4, 3, 8, 8)
    before = _state(model)
    fast = convbn.convert(model, example_inputs=x, progress=False)
    assert _equal(_state(model), before)
    assert fast.convbn_report.validated == [""]
    assert_fused(fast, pairs=1)


def test_a_rewrite_whose_statistics_differ_is_still_caught() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4))
    fast = convbn.convert(net, strategy="recompute_bn", example_inputs=torch.randn(4, 3, 8, 8), progress=False)
    fwd = installed(fast)
    original = fwd.fn

    def moves_a_statistic(owner: nn.Module, x: torch.Tensor) -> torch.Tensor:
        owner[4].running_var.mul_(1.01)
        return original(owner, x)

    fwd.fn = moves_a_statistic
    result = check_step(fast, (torch.randn(4, 3, 8, 8),), {})
    assert not result.ok
    assert "buffers" in result.describe()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_backward_that_runs_a_batchnorm_again_takes_the_step_whole(reentrant: bool) -> None:
    """A checkpoint recomputes its block in the backward, where eager's step writes the
    statistics a second time: no two-run reference; the check's eager step is one step whole."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    outer = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4))

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.outer, self.inner = outer, inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.inner, self.outer(x), use_reentrant=reentrant)

    model = Checkpointed()
    before = _state(model)
    with StateSnapshot(model):
        assert eager_reference(model, (torch.randn(2, 3, 6, 6),), {}) is None
    assert _equal(_state(model), before)
