"""The exact CPU meter keeps no per-module statistics (Note: [a meter that keeps no module
statistics] in _compat.py) and walks an operator's outputs without pytree (Note: [an operator's
outputs walked without pytree]); the planner records without the module tracker's gradient hooks
(Note: [a module tracker for the forward only] in memory/mod_tracking.py). Every total is the one
torch's tracker and hooks give as they are, point by point, on eager and converted models, and the
planner's recorded steps are the same numbers."""
from __future__ import annotations

from typing import Any, Callable, List, Tuple

import pytest
import torch
from torch import nn

import convbn
from convbn.memory import peaks, tensor_peak, timeline
from convbn.passes.graph.graph_module import eager
from convbn.passes.graph.share_copy import share_copy
from convbn.passes.plan.sliced_measure import record_eager_and_chains
from fusion_checks import assert_fused


class _Hidden(nn.Module):
    """A conv net that holds one layer outside its registered children (a plain list: its
    parameters and buffer are not ``model.parameters()``) and calls one activation module at
    every layer (called again with no parent between: what torch's hook takes for a next step)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.aside = [nn.Sequential(nn.Conv2d(8, 16, 1), nn.BatchNorm2d(16))]  # not registered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.bn1(self.conv1(x)))
        x = self.act(self.bn2(self.conv2(x)))
        return self.aside[0](x).mean((2, 3))


def _gn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(), nn.Conv2d(8, 4, 1))


def _densenet() -> nn.Module:
    from densenet_models import make_densenet_bc

    return make_densenet_bc()


def _resnet18() -> nn.Module:
    pytest.importorskip("torchvision")
    from zoo import import_torchvision_without_fake_kernels

    return import_torchvision_without_fake_kernels().models.resnet18(num_classes=10)


def _torch_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The meter with torch's module hooks, its pytree walk and the module tracker's gradient hooks
    as they are (the reference)."""
    real = peaks.releasing_mod_tracker
    monkeypatch.setattr(peaks, "lean_mem_tracker", lambda base: base)
    monkeypatch.setattr(peaks, "releasing_mod_tracker", lambda backward=True: real())


def _no_grads(model: nn.Module) -> None:
    """Every gradient set to None, the hidden layer's too (each measurement starts alike)."""
    for m in (model, *getattr(model, "aside", ())):
        for p in m.parameters():
            p.grad = None


def _measured(model: nn.Module, x: torch.Tensor, backward_modules: bool = True) -> Tuple[Any, ...]:
    """Every point of one recorded step but its autograd node's ``id`` (an address), and one
    step's ``tensor_peak`` (peak and end)."""
    torch.manual_seed(0)
    _no_grads(model)
    points = [(p.bytes, p.phase, p.module, p.op) for p in timeline(model, x, backward_modules=backward_modules).points]
    _no_grads(model)
    with tensor_peak(model) as tp:
        model(x).float().mean().backward()
    return points, tp.result.peak, tp.result.end


#: name, model, input shape, converted (the hidden layer cannot be traced: eager only)
MODELS: List[Tuple[str, Callable[[], nn.Module], Tuple[int, ...], bool]] = [
    ("hidden", _Hidden, (4, 3, 8, 8), False), ("group_norm", _gn, (4, 3, 8, 8), False),
    ("group_norm_converted", _gn, (4, 3, 8, 8), True), ("resnet18", _resnet18, (4, 3, 32, 32), False),
    ("resnet18_converted", _resnet18, (4, 3, 32, 32), True),
    # layers called with a list of features: the module tracker's hook on their inputs holds gradients
    ("densenet", _densenet, (4, 3, 32, 32), False), ("densenet_converted", _densenet, (4, 3, 32, 32), True)]


@pytest.mark.parametrize("name, make, shape, converted", MODELS, ids=[m[0] for m in MODELS])
def test_every_point_is_the_one_torchs_module_hooks_give(monkeypatch: pytest.MonkeyPatch, name: str,
                                                         make: Callable[[], nn.Module], shape: Tuple[int, ...],
                                                         converted: bool) -> None:
    torch.manual_seed(0)
    model, x = make(), torch.randn(shape)
    if converted:
        model = convbn.convert(model, example_inputs=x, progress=False)
        assert_fused(model)
    assert type(tensor_peak(model)._tracker).__name__ == "LeanMemTracker"  # the lean meter runs
    lean, forward_only = _measured(model, x), _measured(model, x, backward_modules=False)
    with monkeypatch.context() as m:
        _torch_hooks(m)
        assert type(tensor_peak(model)._tracker).__name__ != "LeanMemTracker"
        reference = _measured(model, x)
    assert lean == reference
    assert len(lean[0]) > 20 and lean[1] > 0
    # without the backward's module names: the same points, the backward outside every module
    named = [p if p[1] != "backward" else (p[0], p[1], "", p[3]) for p in reference[0]]
    assert forward_only == (named, *reference[1:])
    assert any(p[1] == "backward" and p[2] for p in reference[0])


def test_a_module_held_outside_the_model_is_counted_once_it_runs() -> None:
    """The one thing the hooks do for a total: the hidden layer's parameters and buffers count
    from its first call (registered, they are live before the step and never counted)."""
    torch.manual_seed(0)
    hidden, x = _Hidden(), torch.randn(4, 3, 8, 8)
    shown = _Hidden()
    shown.load_state_dict(hidden.state_dict())
    shown.aside = hidden.aside
    shown.registered = hidden.aside[0]  # now one of the model's children
    a, b = timeline(hidden, x).points, timeline(shown, x).points
    own = sum(t.numel() * t.element_size() for t in (*hidden.aside[0].parameters(), *hidden.aside[0].buffers()))
    first = next(i for i, p in enumerate(a) if p.module == "0")  # the hidden conv
    assert own > 0 and [p.op for p in a] == [p.op for p in b]
    assert [p.bytes - q.bytes for p, q in zip(a, b)] == [0] * first + [own] * (len(a) - first)


def test_the_planners_recorded_steps_are_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager step's saved bytes, peak and timeline and every number of the planner's inputs,
    recorded with the lean meter and with torch's module hooks, at the example batch."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    fast = convbn.convert(_resnet18(), example_inputs=x, progress=False)
    assert_fused(fast, pairs=20)
    with eager(fast):
        reference_model = share_copy(fast)

    def record() -> Tuple[Any, ...]:
        torch.manual_seed(0)
        r = record_eager_and_chains(reference_model, fast, (x,))
        return r.eager_saved, r.eager_peak, r.eager_points, r.eager_ops, r.inputs, [id(c) for c in r.ordered]

    lean = record()
    with monkeypatch.context() as m:
        _torch_hooks(m)
        reference = record()
    assert lean == reference
    assert lean[4].points and lean[1] > 0


def test_convert_compares_eager_and_fused_peaks_read_by_one_meter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's last resort (Note: [never above eager]) compares the fused step's peak with
    eager's; both are read with the same module tracker (backward hooks off). Read with the
    hooks on, the fused step was 1.45x eager's on transformers' EncodecModel (its multi-tensor
    modules' hooks held ~1 MB the plain step frees) and all 20 fused GroupNorms ran as eager."""
    from convbn.passes.plan import auto_plan, plan_inputs, sliced_measure

    seen: List[bool] = []
    real = plan_inputs.measure_peak

    def spy(*args: Any, backward_modules: bool = True, **kwargs: Any) -> Any:
        seen.append(backward_modules)
        return real(*args, backward_modules=backward_modules, **kwargs)

    for module in (auto_plan, plan_inputs, sliced_measure):
        monkeypatch.setattr(module, "measure_peak", spy)
    last_resort: List[int] = []
    real_last = auto_plan._eager_if_above
    monkeypatch.setattr(auto_plan, "_eager_if_above", lambda *a: (last_resort.append(1), real_last(*a))[1])
    torch.manual_seed(0)  # weights dominate 2x2 maps: the predicted peak is within 10 % of eager's
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.GroupNorm(4, 64), nn.ReLU(),
                          nn.Conv2d(64, 64, 3, padding=1), nn.GroupNorm(4, 64), nn.ReLU())
    convbn.convert(model, example_inputs=torch.randn(8, 3, 2, 2))
    assert last_resort == [1]
    assert len(seen) >= 3 and set(seen) == {False}, seen
