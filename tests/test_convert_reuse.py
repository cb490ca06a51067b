"""A conversion made once (Note: [a conversion made once]): ``convert(example_inputs=x)``'s
decisions travel with a checkpoint as ``convbn_report.plan.as_dict()``; converting the same
model again with ``plan=`` gives the identical conversion without running the model (no
check, no measurement: asserted by making both raise), and trains exactly as eager."""
from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import convbn
import convbn.passes.convert.api as convert_api
import convbn.passes.plan.auto_plan as auto_plan
from capture_helpers import assert_steps_match
from fusion_checks import assert_fused, fused_chains


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.a = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                               nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.down = nn.Sequential(nn.Conv2d(8, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.a(x))
        return self.head(self.down(x).mean((2, 3)))


def _saved(plan: convbn.ConvertPlan) -> dict:
    """The plan as a checkpoint holds it: through torch.save / torch.load (weights_only)."""
    buf = io.BytesIO()
    torch.save({"convbn_plan": plan.as_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["convbn_plan"]


def _no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a reused plan must not run the model")

    monkeypatch.setattr(convert_api, "check_on_slice", refuse)
    monkeypatch.setattr(convert_api, "plan_auto", refuse)
    monkeypatch.setattr(convert_api, "measure_saved", refuse)
    monkeypatch.setattr(auto_plan, "measure_peak", refuse)


@pytest.mark.parametrize("strategy", ["auto", "recompute_conv"])
def test_reconvert_after_resume_is_the_same_conversion_without_running(monkeypatch: pytest.MonkeyPatch,
                                                                       strategy: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    first = convbn.convert(_Net().double(), example_inputs=x, strategy=strategy)
    plan = first.convbn_report.plan
    assert isinstance(plan, convbn.ConvertPlan) and plan.checks == (("", ""),)  # the model was checked whole
    assert not first.convbn_report.reused_plan
    torch.manual_seed(1)
    eager = _Net().double()  # the resumed run's model: other weights, same structure
    model = _Net().double()
    model.load_state_dict(eager.state_dict())
    keys = list(model.state_dict())
    _no_runs(monkeypatch)
    again = convbn.convert(model, example_inputs=x.clone(), strategy=strategy, plan=_saved(plan))
    report = again.convbn_report
    assert report.reused_plan
    assert report.plan == plan  # the identical plan, fingerprint and figures included
    assert [c.plan for c in fused_chains(again)] == [c.plan for c in fused_chains(first)]
    assert str(report) == str(first.convbn_report)  # every pair, its strategy, kept bytes, MACs
    assert report.validated == [""]
    assert list(again.state_dict()) == keys
    monkeypatch.undo()
    assert_fused(again, pairs=4, chains=3)
    assert_steps_match(eager, again, torch.randn(4, 3, 16, 16, dtype=torch.float64), steps=2)


def test_a_plan_for_other_inputs_or_options_converts_from_scratch() -> None:
    x = torch.randn(4, 3, 16, 16)
    plan = convbn.convert(_Net(), example_inputs=x).convbn_report.plan
    for other, kwargs in ((torch.randn(2, 3, 16, 16), {}), (x, {"strategy": "recompute_bn"}),
                          (x.double(), {"model": _Net().double()})):
        model = kwargs.pop("model", _Net())
        with pytest.warns(UserWarning, match=r"convert\(plan=\.\.\.\) was made for another model"):
            fresh = convbn.convert(model, example_inputs=other, plan=plan, **kwargs)
        assert not fresh.convbn_report.reused_plan
        assert fresh.convbn_report.plan != plan


def test_plan_arguments_are_checked_before_any_change() -> None:
    model = _Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = convbn.convert(model, example_inputs=torch.randn(2, 3, 8, 8)).convbn_report.plan
    with pytest.raises(ValueError, match="plan needs example_inputs"):
        convbn.convert(model, plan=plan)
    with pytest.raises(TypeError, match="plan must be a convbn.ConvertPlan .* but got str"):
        convbn.convert(model, example_inputs=torch.randn(2, 3, 8, 8), plan="plan.json")
    with pytest.raises(ValueError, match="plan must be a convbn.ConvertPlan or the dict"):
        convbn.convert(model, example_inputs=torch.randn(2, 3, 8, 8), plan={"chains": []})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert "forward" not in vars(model) and "convbn_report" not in vars(model)
    assert convbn.ConvertPlan.from_dict(plan.as_dict()) == plan


def test_a_plan_whose_check_found_a_difference_replays_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the first convert's check found the whole model's rewrite differing and converted it
    part by part, the reused plan converts part by part again without running the check."""
    x = torch.randn(4, 3, 16, 16)
    model = _Net()
    first = convbn.convert(model, example_inputs=x)
    plan = first.convbn_report.plan
    differs = convbn.ConvertPlan(plan.key, (("", "outputs differ: max |difference| 1 > allowed 0.001"),) +
                                 tuple((name, "") for name in ("stem", "a", "down")), plan.chains, plan.figures)
    _no_runs(monkeypatch)
    monkeypatch.setattr(convert_api, "_plan_again", lambda work, conv: True)  # plans: not the point here
    again = convbn.convert(_Net(), example_inputs=x, plan=differs)
    assert [u[0] for u in again.convbn_report.untraced] == [""]
    assert "converted part by part" in again.convbn_report.untraced[0][1]
    assert again.convbn_report.validated == ["stem", "a", "down"]


class _ModeNet(nn.Module):
    """A root whose graph depends on its mode (a branch on ``self.training``) around a part that does not."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return y * 2.0 if self.training else y


def _modes_of(model: nn.Module) -> dict:
    from convbn.passes.graph.graph_module import installed

    return {n: getattr(installed(m), "modes", None) is not None for n, m in model.named_modules()
            if installed(m) is not None}


def test_a_reused_plan_answers_mode_dependence_without_tracing_the_other_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note: [a mode dependence answered once]: the second trace of each module (``training``
    flipped) is not run again with a plan, the answers are the same, and a mode-dependent graph
    still runs the module's own forward in the other mode; answers missing from a plan are asked."""
    import convbn.passes.tracing.trace as trace_mod

    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    first = convbn.convert(_ModeNet().double(), example_inputs=x)
    plan = first.convbn_report.plan
    assert [answer for _, answer in plan.modes] == [True]  # one graph (the model, traced whole), mode dependent
    asked = []
    real = trace_mod._mode_dependent
    monkeypatch.setattr(trace_mod, "_mode_dependent", lambda *a, **k: asked.append(1) or real(*a, **k))
    torch.manual_seed(1)
    model = _ModeNet().double()
    again = convbn.convert(model, example_inputs=x, plan=_saved(plan))
    assert again.convbn_report.reused_plan and again.convbn_report.plan == plan
    assert asked == []  # no module traced in the other mode
    assert _modes_of(again) == _modes_of(first) and any(_modes_of(again).values())
    again.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x), model.eval()(x))  # eval: no doubling, as the model's own code
    partial = dict(_saved(plan), modes=[])
    third = convbn.convert(_ModeNet().double(), example_inputs=x, plan=partial)
    assert third.convbn_report.reused_plan and asked  # asked again where the plan has no answer
    assert _modes_of(third) == _modes_of(first)
